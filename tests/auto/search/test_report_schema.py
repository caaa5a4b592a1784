"""A search report read back (`atorch explain`, the search cache) is checked field by field: every
field of the report and of a candidate, given a value of the wrong type, is refused by name with
what it should hold; never a TypeError from inside the table."""

import json
from dataclasses import fields

import pytest

from atorch.auto.search.candidate import CandidateResult
from atorch.auto.search.report import SearchReport
from atorch.cli.main import main

GOOD = {"world_size": 2, "device": "cpu", "memory_budget_bytes": 1 << 30, "winner": 0, "tied": None,
        "candidates": [{"strategy": {"methods": [{"name": "parallel_mode"}]}, "status": "measured",
                        "throughput": 10.0, "measured_peak_bytes": 100, "side_by_side_behind": [1.0, 1.0, 1.0]}]}


def _wrong(value_type_field) -> object:
    """A value of another type than the field holds."""
    return "x" if value_type_field not in ("device", "note", "rates", "stopped", "reason", "layout", "pruned_by",
                                            "generated_as", "status") else 5


@pytest.mark.parametrize("where, name", [("report", f.name) for f in fields(SearchReport) if f.name != "candidates"]
                         + [("candidate", f.name) for f in fields(CandidateResult)])
def test_a_wrong_typed_field_is_refused_by_name(tmp_path, capsys, where, name):
    data = json.loads(json.dumps(GOOD))
    target = data if where == "report" else data["candidates"][0]
    target[name] = _wrong(name)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is not an atorch search report" in err and name in err, err


def test_a_good_report_and_the_searchs_own_load(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(GOOD))
    assert main(["explain", str(path)]) == 0 and "parallel_mode" in capsys.readouterr().out
    from tests.auto.search.replay import replay

    replay("tests-tiny", tmp_path)  # a report a search wrote, every field filled, loads as it is
    assert SearchReport.load(tmp_path / "tests-tiny.json").candidates
