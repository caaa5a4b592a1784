"""The same job searched three times (no cache) on 2 gloo ranks gets the same pick: each
candidate's readings are its median timed step, and readings that cannot be told apart are a
declared tie settled by a fixed rule (tests/auto/search/test_ties.py has the rule itself)."""

import pytest

from tests.auto.search.test_search import FAST, search_and_train
from tests.helpers.dist import run_distributed

# data parallel, zero1 and a 2-stage pipeline (the pair whose readings swung 3x in issue 36)
OTHERS = ["module_replace", "checkpoint", "amp_native", "zero2", "fsdp", "tensor_parallel", "mixed_parallel",
          "ds_3d_parallel", "sequence_parallel", "fp8", "half", "native_dynamo"]


def _three_searches(directory: str) -> list:
    from atorch.auto.registry import method_names

    excluded = [name for name in OTHERS if name in method_names()]
    picks = []
    for i in range(3):
        out = search_and_train(f"{directory}/report{i}.json", steps=1, excluded=excluded, use_search_cache=False,
                               **FAST)
        picks.append(out["strategy_json"])
    return picks


@pytest.mark.slow
def test_three_searches_of_one_job_pick_the_same(tmp_path):
    for rank, picks in enumerate(run_distributed(_three_searches, 2, str(tmp_path))):
        assert picks[0] == picks[1] == picks[2], (rank, picks)
