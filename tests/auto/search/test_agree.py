"""The search's agreements (atorch/auto/search/agree.py): every rank takes the same decision from
values that differ between ranks."""

import torch.distributed as dist

from atorch.auto.search.agree import agreed, from_rank0, gathered
from tests.helpers.dist import run_distributed


def _agree():
    rank = dist.get_rank()
    return (agreed(("reason", rank), float(rank), None if rank == 1 else 5.0, 10.0 - rank),
            gathered({"rank": rank}), from_rank0(rank))


def test_one_agreement_gives_rank_0s_first_value_and_the_largest_of_the_others():
    for values, every, first in run_distributed(_agree, 2, timeout_s=120):
        # rank 0's reason; the largest of each value; None where a rank has none
        assert values == (("reason", 0), 1.0, None, 10.0)
        assert every == [{"rank": 0}, {"rank": 1}] and first == 0


def test_one_process_agrees_with_itself():
    assert agreed("why", 1.0, None) == ("why", 1.0, None)
    assert gathered(3) == [3]
