"""A damaged or hostile search-cache entry or calibration file is skipped, with a warning naming the
file, on every rank alike (rank 0 used to raise alone before the broadcast, leaving rank 1 waiting)."""

import json
import logging

import pytest
import torch

from atorch.auto.search import cache, calibrate
from atorch.auto.search.report import SearchReport
from atorch.auto.strategy import Strategy
from tests.helpers.dist import run_distributed

_HOSTILE_STRATEGY = [{"name": "parallel_mode"}, {"name": "zero2", "config": {
    "use_ds_zero": True, "ds_config": {"tensorboard": {"enabled": True, "output_path": "/tmp/x"}}}}]
_REPORT = {"world_size": 1, "device": "cpu", "memory_budget_bytes": 1}
CACHE_ENTRIES = {
    "deep nesting": "[" * 100_000,  # RecursionError
    "not json": "{oops",
    "a list": "[1]",
    "no report": json.dumps({"strategy": []}),  # KeyError
    "report of a number": json.dumps({"strategy": [], "report": 5}),
    "bad candidate": json.dumps({"strategy": [], "report": {"candidates": [5]}}),  # TypeError
    "unknown method": json.dumps({"strategy": ["nope"], "report": _REPORT}),
    "hostile ds_config": json.dumps({"strategy": _HOSTILE_STRATEGY, "report": _REPORT}),
    "a note that is not text": json.dumps({"strategy": [], "report": {**_REPORT, "note": 5}}),  # TypeError in load
}
CALIBRATIONS = {
    "deep nesting": "{" + '"a":[' * 50_000,
    "a list": "[1]",
    "calibration of a number": json.dumps({"calibration": 5}),
    "empty": "{}",
}


@pytest.mark.parametrize("kind", sorted(CACHE_ENTRIES))
def test_a_bad_cache_entry_is_skipped_with_a_warning_naming_the_file(tmp_path, caplog, kind):
    (tmp_path / "k.json").write_text(CACHE_ENTRIES[kind])
    with caplog.at_level(logging.WARNING, logger="atorch"):
        assert cache.load(tmp_path, "k") is None
    assert str(tmp_path / "k.json") in caplog.text and "searching again" in caplog.text


def test_a_good_cache_entry_still_loads(tmp_path):
    strategy = Strategy(["parallel_mode", ("zero2", {"use_ds_zero": True, "ds_config": {"gradient_clipping": 1.0}})])
    cache.store(tmp_path, "k", strategy, SearchReport(**_REPORT))
    loaded, report = cache.load(tmp_path, "k")
    assert loaded == strategy and "from the search cache" in report.note


@pytest.mark.parametrize("kind", sorted(CALIBRATIONS))
def test_a_bad_calibration_gives_nominal_rates_and_names_the_file(tmp_path, caplog, kind):
    path = calibrate.cache_path(torch.device("cpu"), 1, tmp_path)
    path.write_text(CALIBRATIONS[kind])
    with caplog.at_level(logging.WARNING, logger="atorch"):
        rates, line = calibrate.cached_rates(torch.device("cpu"), 1, tmp_path)
    assert rates is None and str(path) in line and "does not read as a calibration" in line
    assert str(path) in caplog.text


def _read_bad_files(directory: str):
    from pathlib import Path

    rates, line = calibrate.cached_rates(torch.device("cpu"), 2, directory)
    return cache.load(Path(directory), "k"), rates, line


def test_two_ranks_both_skip_the_bad_files(tmp_path):
    (tmp_path / "k.json").write_text(CACHE_ENTRIES["deep nesting"])
    calibrate.cache_path(torch.device("cpu"), 2, tmp_path).write_text(CALIBRATIONS["deep nesting"])
    results = run_distributed(_read_bad_files, 2, str(tmp_path), timeout_s=60)
    for entry, rates, line in results:
        assert entry is None and rates is None and "nominal rates" in line


def test_a_report_with_a_reason_of_16_mb_prints_at_once():
    # Issue 56: `atorch explain` on such a report wrapped one 16 MB word for minutes; a cell is cut
    # at report.CELL_LIMIT characters.
    import time

    from atorch.auto.search.report import CELL_LIMIT, CandidateResult

    report = SearchReport(world_size=1, device="cpu", memory_budget_bytes=1)
    report.candidates.append(CandidateResult({"methods": [{"name": "parallel_mode"}]}, status="failed",
                                             reason="x" * 16_000_000))
    start = time.perf_counter()
    text = report.table()
    assert time.perf_counter() - start < 5
    assert len(text) < 10 * CELL_LIMIT and "more" in text and "characters)" in text
