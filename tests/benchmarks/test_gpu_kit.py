"""The GPU check kit (benchmarks/gpu) on its CPU dry path: steps, bookkeeping, resume, report.

What needs a GPU (the CUDA tests, the 1B benchmark, CUDA calibration) runs where one is lent:
`python -m benchmarks.gpu` (README, Contributing).
"""

import json
import sys

import pytest

from benchmarks.gpu import cli, steps
from benchmarks.gpu.state import State
from benchmarks.gpu.steps import Unit

pytest.importorskip("transformers")


@pytest.fixture
def calibration(tmp_path):
    """A profile file in place of `atorch calibrate`'s (that command has its own tests)."""
    from atorch.auto.search.profiles import FOLDER

    data = json.loads((FOLDER / "h100_80gb.json").read_text())
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps({**data, "name": "calibrated-for-test"}))
    return path


def test_dry_path_measures_estimates_and_writes_the_report(tmp_path, calibration, capsys):
    work = tmp_path / "run"
    argv = ["--dry", "--in-process", "--work-dir", str(work), "--calibration", str(calibration), "--step", "calibrate",
            "--step", "bench", "--step", "estimate", "--step", "offload", "--features", "bf16,fp8", "--warmup", "1",
            "--steps", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "CPU dry path" in out and "bench bf16: atorch" in out and "estimate bf16 (calibrated)" in out
    [report_path] = work.glob("gpu_cpu-dry_*.json")
    report = json.loads(report_path.read_text())
    bench = {(r["who"], r["feature"]): r for r in report["bench"]}
    for who in ("plain", "atorch"):
        row = bench[(who, "bf16")]
        assert row["status"] == "done" and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    # the same weights and batch: both sides start from the same loss
    assert bench[("plain", "bf16")]["losses"][0] == pytest.approx(bench[("atorch", "bf16")]["losses"][0], rel=1e-3)
    assert bench[("atorch", "bf16")]["strategy"] == ["amp_native"]
    assert bench[("atorch", "fp8")]["status"] == "skipped" and "CUDA" in bench[("atorch", "fp8")]["note"]
    [estimate] = [e for e in report["estimates"] if e["feature"] == "bf16"]
    assert estimate["step_s"] > 0 and estimate["peak_bytes"] > 0 and estimate["step_ratio"] > 0
    assert report["pending"] == ["tests/collect"] and not report["complete"]
    # the offload unit: on the dry path the host optimizer's rate only, and it says why
    assert report["offload"]["host_optimizer_seconds_per_byte"] > 0 and "CUDA" in report["offload"]["skipped"]
    markdown = report_path.with_suffix(".md").read_text()
    assert "## CPU offload" in markdown
    assert "| bf16 | atorch | done |" in markdown and "not complete" in markdown
    # a second run finds everything asked for done and runs nothing again
    assert cli.main(argv) == 0
    again = capsys.readouterr().out
    assert "resuming" in again and "..." not in again
    # and the report names both invocations, not only the last
    report = json.loads(report_path.read_text())
    assert [i["argv"] for i in report["invocations"]] == [argv, argv]
    assert report_path.with_suffix(".md").read_text().count(f"`{' '.join(argv)}`") == 2


@pytest.mark.slow
def test_dry_path_runs_the_compiled_and_fused_variants_and_the_search(tmp_path, calibration, capsys, monkeypatch):
    # inductor compiles C++ here (about 20 s a compiled variant), and the search picks on the CPU
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "")  # inductor sets it itself
    work = tmp_path / "run"
    argv = ["--dry", "--in-process", "--work-dir", str(work), "--calibration", str(calibration), "--step", "bench",
            "--features", "bf16,fused_optimizer,compile,compile_fused,fused_kernels,search", "--warmup", "2",
            "--steps", "2"]
    assert cli.main(argv) == 0
    [report_path] = work.glob("gpu_cpu-dry_*.json")
    bench = {(r["who"], r["feature"]): r for r in json.loads(report_path.read_text())["bench"]}
    assert ("plain", "search") not in bench  # its twin is plain bf16's row
    for feature in ("fused_optimizer", "compile", "compile_fused", "search"):
        row = bench[("atorch", feature)]
        assert row["status"] == "done" and row["tokens_per_s"] > 0, row
        # the same weights and batches as the plain twin: the same first loss
        twin = bench[("plain", "bf16" if feature == "search" else feature)]
        assert row["losses"][0] == pytest.approx(twin["losses"][0], rel=1e-2)
    assert sorted(bench[("atorch", "compile_fused")]["strategy"]) == ["amp_native", "fused_optimizer", "native_dynamo"]
    assert bench[("atorch", "fused_kernels")]["status"] == "skipped" and "CUDA" in bench[("atorch", "fused_kernels")]["note"]


def _fake_units(calls):
    def unit(name, result=None, fail=False):
        def run(run, timeout):
            calls.append(name)
            if fail:
                raise RuntimeError("broke")
            return result or {"value": name}
        return Unit("bench", name, 60, run)

    return [unit("a"), unit("b", fail=True), unit("c", {"skipped": "not here"}), unit("d")]


def test_a_cut_run_resumes_at_the_first_unit_not_done(tmp_path):
    calls, path = [], tmp_path / "state.json"
    todo = _fake_units(calls)
    state, _ = State.open(path, {"x": 1})
    state.mark("bench/a", "running")
    state.mark("bench/a", "done", result={"value": "a"})
    state.mark("bench/b", "running")  # the command was killed here
    state, how = State.open(path, {"x": 1})
    assert "1 cut and run again" in how and state.unit("bench/b")["status"] == "pending"
    assert cli.run_units(state, todo, None, cli.run_in_process, say=lambda _: None)
    assert calls == ["b", "c", "d"]
    units = State.open(path, {"x": 1})[0].data["units"]
    assert [units[k]["status"] for k in ("bench/a", "bench/b", "bench/c", "bench/d")] == \
        ["done", "failed", "skipped", "done"]
    assert "broke" in units["bench/b"]["note"] and units["bench/b"]["attempts"] == 2
    assert units["bench/c"]["note"] == "not here"
    cli.run_units(state, todo, None, cli.run_in_process, retry_failed=True, say=lambda _: None)
    assert calls[3:] == ["b"]
    assert State.open(path, {"x": 2})[0].data["units"] == {}  # another configuration starts again


def test_the_budget_stops_before_a_unit_and_puts_a_cut_one_back(tmp_path):
    calls = []
    todo = _fake_units(calls)
    state, _ = State.open(tmp_path / "state.json", {})
    assert not cli.run_units(state, todo, 0, cli.run_in_process, say=lambda _: None)
    assert calls == [] and all(u["status"] == "pending" for u in state.data["units"].values())

    def cut(state, unit, limit):
        assert limit <= 50  # the unit gets at most what is left of the budget (its own limit: 60)
        return "timeout", {"error": f"stopped after {limit:.0f}s"}

    assert not cli.run_units(state, todo, 50, cut, say=lambda _: None)
    assert state.unit("bench/a")["status"] == "pending" and "budget" in state.unit("bench/a")["note"]


def test_a_unit_runs_in_a_process_of_its_own_and_its_failure_is_kept(tmp_path):
    state, _ = State.open(tmp_path / "state.json", {"dry": True, "features": []})
    outcome, result = cli.run_isolated(state, Unit("tests", "no-such", 60, None), 60)
    assert outcome == "failed" and "no unit 'tests/no-such'" in "\n".join(result["tail"])
    assert sys.executable  # the child ran under this interpreter (benchmarks.gpu.unit)


def test_pytest_outputs_are_read():
    assert steps.collected_count("tests/cuda/test_a.py: 4\ntests/cuda/test_b.py: 3\n") == 7
    assert steps.collected_count("===== 12 tests collected in 0.5s =====") == 12


def test_junit_counts(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text("""<testsuites><testsuite>
      <testcase classname="tests.cuda.test_x" name="ok"/>
      <testcase classname="tests.cuda.test_x" name="bad"><failure message="assert 1 == 2">tb</failure></testcase>
      <testcase classname="tests.cuda.test_x" name="off"><skipped message="needs a CUDA GPU"/></testcase>
    </testsuite></testsuites>""")
    counts = steps.junit_counts(path)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"] == [{"test": "tests.cuda.test_x::bad", "message": "assert 1 == 2"}]


def test_units_of_a_gpu_run_each_fit_a_ten_minute_command():
    from benchmarks.gpu.llama import FEATURES

    config = {"dry": False, "features": list(FEATURES)}
    all_units = steps.units(config)
    assert [u.step for u in all_units][0] == "tests" and all_units[-1].key == "offload/fsdp-cpu-offload"
    assert all(u.limit_s < 600 for u in all_units)
    bench = [u.name for u in all_units if u.step == "bench"]
    # every feature by hand and through atorch, but the search, whose twin is plain bf16's row
    assert bench[:2] == ["plain-bf16", "atorch-bf16"] and len(bench) == 2 * len(FEATURES) - 1
    assert "atorch-search" in bench and "plain-search" not in bench


def test_h100_and_h200_take_their_peak_from_the_repository_profile():
    from benchmarks.gpu.estimate import datasheet_profile

    h100, source = datasheet_profile("NVIDIA H100 80GB HBM3")
    assert h100.name == "h100_80gb" and h100.peak("half") == pytest.approx(989.4e12) and "datasheet" in source
    h200, source = datasheet_profile("NVIDIA H200")
    assert h200.peak("half") == h100.peak("half") and "H200 datasheet" in source
    assert datasheet_profile("NVIDIA A100-SXM4-80GB")[0] is None
