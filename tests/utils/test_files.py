"""Strategy and report files saved from every rank at once (the README's ``strategy.save``)."""

import os
import stat

from atorch.auto import Strategy
from atorch.auto.search.report import CandidateResult, SearchReport
from atorch.utils.files import write_text_atomic
from tests.helpers.dist import run_distributed

ROUNDS = 30


def _save_together(directory: str, rounds: int) -> list[str]:
    """Every rank saves the same strategy and report to the same paths, ``rounds`` times, starting
    each round together; returns the errors met (none expected)."""
    import torch.distributed as dist

    strategy = Strategy(["parallel_mode", ("amp_native", "bf16")])
    report = SearchReport(2, "cpu", 2**30, [CandidateResult(strategy.to_dict(), "measured", throughput=1.0)])
    errors = []
    for _ in range(rounds):
        dist.barrier()
        for save, name in ((strategy.save, "strategy.json"), (report.save, "report.json")):
            try:
                save(os.path.join(directory, name))
            except OSError as error:  # the race: FileNotFoundError on '<name>.tmp'
                errors.append(repr(error))
        dist.barrier()
        # What a reader meets between saves is always a whole file.
        assert Strategy.load(os.path.join(directory, "strategy.json")) == strategy
        assert SearchReport.load(os.path.join(directory, "report.json")).candidates[0].throughput == 1.0
    return errors


def test_every_rank_saves_the_same_files_30_times(tmp_path):
    results = run_distributed(_save_together, 2, str(tmp_path), ROUNDS)
    assert results == [[], []]
    # No temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "strategy.json"]


def test_atomic_write_keeps_files_readable(tmp_path):
    path = tmp_path / "s.json"
    write_text_atomic(path, "one\n")
    assert path.read_text() == "one\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not the temporary file's private 0600
    path.chmod(0o640)
    write_text_atomic(path, "two\n")
    assert path.read_text() == "two\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
