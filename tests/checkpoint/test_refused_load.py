"""A load that is refused changes nothing: not the parameters, the optimizer, the lr scheduler,
the dataloader position or the random stream, on any rank; the error is atorch's CheckpointError
(an Exception: torch's CheckpointException is a BaseException that ``except Exception`` misses)."""

import pytest
import torch

import atorch.checkpoint as ckpt
from atorch.errors import CheckpointError
from tests.checkpoint import faults
from tests.checkpoint.jobs import build, full_weights
from tests.helpers.dist import run_distributed


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(faults.refused_loads, 2, str(tmp_path_factory.mktemp("refused")), timeout_s=400)


def test_one_process_refusals_change_nothing(tmp_path):
    cases = faults.refused_loads(str(tmp_path), strategies=("single",))["single"]
    _assert_refused(cases, "single")


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_two_rank_refusals_change_nothing_on_either_rank(two_ranks, strategy):
    for rank in range(2):
        _assert_refused(two_ranks[rank][strategy], f"{strategy} rank {rank}")


def _assert_refused(cases: dict, where: str) -> None:
    message, changed = cases["batch"]
    assert message.startswith("CheckpointError") and "global batches of 8 samples" in message, (where, message)
    assert not changed, (where, changed)
    message, changed = cases["damaged"]
    assert message.startswith("CheckpointError") and "__0_0.distcp" in message and "changed since the save" in message, (
        where, message)
    assert not changed, (where, changed)
    # The manifest rewritten to match: the damage is found while DCP reads, into new buffers.
    message, changed = cases["damaged_forged"]
    assert message.startswith("CheckpointError") and "reading " in message and "nothing was changed" in message, (
        where, message)
    assert not changed, (where, changed)


def test_a_failed_save_is_a_checkpoint_error_and_keeps_the_last_checkpoint(tmp_path):
    result = build("single")
    ckpt.save(tmp_path / "ck", result.model, extra={"step": 1})
    expected = full_weights(result)
    broken = torch.nn.Linear(4, 4, device="meta")  # no data to write: DCP fails inside its write step
    with pytest.raises(CheckpointError, match=r"saving .*ck failed \(rank 0: NotImplementedError: Cannot copy out of meta"):
        ckpt.save(tmp_path / "ck", broken)
    target = build("single", seed=5)
    assert ckpt.load(tmp_path / "ck", target.model) == {"step": 1}
    weights = full_weights(target)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
