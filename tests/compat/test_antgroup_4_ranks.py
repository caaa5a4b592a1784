"""Issue 39's ATorch items on 4 gloo ranks, in one spawn, checked as their 2-rank runs are
(test_antgroup_round2.py, test_antgroup_bf16.py): the getters after auto_accelerate's
parallel_mode, ATorch's calls on best_strategy, the bf16 amp skip with its BF16GradScaler,
ColumnParallelLinear's split output over 4 column shards, the FSDP2 unit count, half bf16 with
zero1 refused; atorch's own Strategy pickled and rescaled, save_strategy_to_file read back, and
bf16 amp and ("half", "bf16") with fp32 master weights against one process on 4 ranks' rows."""

from tests.compat.test_antgroup_bf16 import _runs, check_recipes
from tests.compat.test_antgroup_round2 import _round2, check_round2
from tests.helpers.dist import run_distributed


def _both(saved: str) -> dict:
    return {"round2": _round2(), "recipes": _runs(saved)}


def test_atorch_round2_and_recipes_on_4_ranks(tmp_path):
    results = run_distributed(_both, 4, str(tmp_path / "best.st"))
    check_round2([result["round2"] for result in results])
    check_recipes([result["recipes"] for result in results])
