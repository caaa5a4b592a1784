"""The resume matrix (issue 56; what it checks is in tests/checkpoint/matrix.py): every strategy
saves, and, in new processes, loads under another. The default run loads each strategy's
checkpoint under the next one (every strategy saves once and loads once) and mixed_parallel's
under itself; the slow run loads every pair."""

import math

import pytest

from tests.checkpoint import matrix
from tests.helpers.dist import run_distributed

# mixed under itself: its stage's tensor-parallel streams must survive the first step's shape
# inference (docs/dev/negative_controls.md); zero2 and pipeline under themselves run with -m slow
SAME_STRATEGY = [("mixed", "mixed")]
DROPOUT_RTOL = 0.01  # dropout masks differ across strategies: a bound, not an equality


def _problems(pairs: list[tuple[str, str]], tmp_path) -> list:
    directory = str(tmp_path / "matrix")
    sources = sorted({source for source, _ in pairs}, key=list(matrix.STRATEGIES).index)
    saved = run_distributed(matrix.save_all, 2, directory, sources, timeout_s=600)[0]
    loaded = run_distributed(matrix.load_all, 2, directory, saved, pairs, timeout_s=600, fresh=True)
    problems = []
    for rank, cells in enumerate(loaded):
        for (source, target, model, dropout), cell in cells.items():
            expected = saved[f"{source}-{model}-{dropout}"]["continued"]
            gap = max(abs(a - b) / abs(b) for a, b in zip(cell["continued"], expected))
            bound = matrix.CROSS_RTOL if dropout == 0 or source == target else DROPOUT_RTOL
            if not cell["same_weights"] or not math.isfinite(gap) or gap > bound:
                problems.append(f"rank {rank}: {source} -> {target}, {model}, dropout {dropout}: "
                                f"same weights {cell['same_weights']}, loss gap {gap:.2e}")
    return problems


def test_each_strategy_resumes_under_the_next_and_under_itself(tmp_path):
    pytest.importorskip("transformers")
    problems = _problems(matrix.cycle_pairs() + SAME_STRATEGY, tmp_path)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_every_strategy_resumes_under_every_strategy(tmp_path):
    pytest.importorskip("transformers")
    assert _problems(matrix.all_pairs(), tmp_path) == []
