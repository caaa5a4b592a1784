"""The kit's steps as units: what each runs, its time limit, and how its result reads.

A unit's function takes the run (:class:`Run`: config, folder, earlier results) and the seconds
it may take, and returns a JSON-able dict. The runner (:mod:`benchmarks.gpu.cli`) runs it in a
process of its own (:mod:`benchmarks.gpu.unit`) so a hang, a crash or the memory of one variant
stays there.
"""

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("tests", "calibrate", "bench", "estimate", "offload")
CUDA_TESTS = ROOT / "tests" / "cuda"


@dataclass(frozen=True)
class Unit:
    step: str
    name: str
    limit_s: int
    run: Callable  # (Run, timeout seconds) -> dict

    @property
    def key(self) -> str:
        return f"{self.step}/{self.name}"


@dataclass
class Run:
    config: dict
    folder: Path
    results: dict  # unit key -> result of the units done so far

    @property
    def device(self):
        import torch

        return torch.device(self.config["device"])

    @property
    def size(self):
        from benchmarks.gpu.llama import LlamaSize

        return LlamaSize(**self.config["size"])


def units(config: dict) -> list[Unit]:
    """Every unit of the run, in the order they run."""
    dry = config["dry"]
    out: list[Unit] = []
    if dry:
        out.append(Unit("tests", "collect", 120, lambda run, t: _pytest(run, t, "collect", [str(CUDA_TESTS)], True)))
    else:
        for path in sorted(CUDA_TESTS.glob("test_*.py")):
            out.append(Unit("tests", path.stem, 300,
                            lambda run, t, path=path: _pytest(run, t, path.stem, [str(path)])))
        out.append(Unit("tests", "marked-elsewhere", 420,
                        lambda run, t: _pytest(run, t, "marked-elsewhere",
                                               [str(ROOT / "tests"), f"--ignore={CUDA_TESTS}"])))
    out.append(Unit("calibrate", "profile", 300, _calibrate))
    for feature in config["features"]:
        for who in ("plain", "atorch"):  # each atorch variant right after its plain twin
            if who == "plain" and feature == "search" and "bf16" in config["features"]:
                continue  # the search's twin is plain bf16, measured already
            out.append(Unit("bench", f"{who}-{feature}", 540 if feature in ("compile", "compile_fused", "search") else 300,
                            lambda run, t, who=who, feature=feature: _bench(run, who, feature)))
    out.append(Unit("estimate", "cost-model", 300, _estimate))
    out.append(Unit("offload", "fsdp-cpu-offload", 420, _offload))
    return out


def _command(argv: list[str], timeout: float, log: Path) -> subprocess.CompletedProcess:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as file:
        return subprocess.run(argv, cwd=ROOT, stdout=file, stderr=subprocess.STDOUT, timeout=timeout, check=False)


def _pytest(run: Run, timeout: float, name: str, paths: list[str], collect_only: bool = False) -> dict:
    """The CUDA-marked tests of ``paths``: counts, and each failure with its first line."""
    junit = run.folder / "junit" / f"{name}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-q", "-p", "no:cacheprovider",
            f"--timeout={int(max(timeout - 30, 30))}", f"--junitxml={junit}"]
    if collect_only:
        argv.append("--collect-only")
    log = run.folder / "logs" / f"pytest-{name}.log"
    done = _command(argv, timeout, log)
    if done.returncode not in (0, 1, 5):  # 1: tests failed (a result); 5: none collected
        raise RuntimeError(f"pytest exited {done.returncode}; see {log}:\n{_tail(log)}")
    if collect_only:
        return {"collected": collected_count(log.read_text()), "command": " ".join(argv[1:])}
    return {**junit_counts(junit), "command": " ".join(argv[1:]), "log": str(log)}


def collected_count(output: str) -> int:
    """The number of tests ``pytest --collect-only -q`` selected, from its last lines."""
    per_file = re.findall(r"^\S+\.py: (\d+)$", output, re.MULTILINE)  # -q: one "path: count" line a file
    if per_file:
        return sum(map(int, per_file))
    match = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
    return int(match.group(1)) if match else sum(1 for line in output.splitlines() if "::" in line)


def junit_counts(path: Path) -> dict:
    """Passed, failed, skipped (with reasons) and errors of a pytest junit XML file."""
    root = ElementTree.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for case in cases:
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        first = (outcome.get("message") or outcome.text or "").strip().splitlines()
        message = first[0][:300] if first else ""
        if outcome.tag == "skipped":
            counts["skipped"] += 1
            counts["skips"].append({"test": test, "reason": message})
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            counts["failures"].append({"test": test, "message": message})
    return counts


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


def _calibrate(run: Run, timeout: float) -> dict:
    """``atorch calibrate`` on this device, one rank, into the run's folder (or the file named by
    ``--calibration``, taken as it is)."""
    folder = run.folder / "calibration"
    given = run.config.get("calibration")
    if given:
        folder.mkdir(parents=True, exist_ok=True)
        path = Path(shutil.copy(given, folder / Path(given).name))
        command = f"given: {given}"
    else:
        argv = [sys.executable, "-m", "atorch.cli.main", "calibrate", "--nproc", "1", "--device",
                run.config["device"], "--refresh", "--cache-dir", str(folder)]
        log = run.folder / "logs" / "calibrate.log"
        done = _command(argv, timeout, log)
        if done.returncode:
            raise RuntimeError(f"atorch calibrate exited {done.returncode}; see {log}:\n{_tail(log)}")
        found = sorted(folder.glob("*.json"))
        if not found:
            raise RuntimeError(f"atorch calibrate wrote no file in {folder}")
        path, command = found[0], "atorch " + " ".join(argv[3:])
    from atorch.auto.search.profiles import profile_from_data

    data = json.loads(path.read_text())
    profile_from_data(data, path)  # it must read as a profile
    return {"path": str(path), "command": command, "profile": data}


def _bench(run: Run, who: str, feature: str) -> dict:
    from benchmarks.gpu.llama import measure

    return measure(run.size, who, feature, run.device, run.config["warmup"], run.config["steps"])


def _estimate(run: Run, timeout: float) -> dict:
    """Each strategy's estimate on the calibrated profile and, where this GPU has one, the
    datasheet profile; the optimizer's step timed on this device (as the search times it)."""
    import torch

    from atorch.auto.search.cost import optimizer_seconds_per_byte
    from atorch.auto.search.profiles import profile_from_data
    from benchmarks.gpu import estimate, llama

    calibration = run.results.get("calibrate/profile")
    profiles = {}
    if calibration:
        profiles["calibrated"] = profile_from_data(calibration["profile"], calibration["path"])
    if run.device.type == "cuda":
        datasheet, _ = estimate.datasheet_profile(run.config["device_name"])
        if datasheet is not None:
            profiles[datasheet.name] = datasheet
    if not profiles:
        raise RuntimeError("no calibration to estimate with: run the calibrate step first")
    per_byte = optimizer_seconds_per_byte(torch.optim.AdamW, {"lr": llama.LR}, run.device)
    rows = {}
    for name, profile in profiles.items():
        for feature in run.config["features"]:
            try:
                rows[f"{name}/{feature}"] = estimate.estimate(run.size, feature, profile, run.device.type, per_byte)
            except Exception as error:  # noqa: BLE001 - one strategy's failure is a result, not the unit's
                rows[f"{name}/{feature}"] = {"error": f"{type(error).__name__}: {error}"}
    return {"profiles": list(profiles), "optimizer_seconds_per_byte": per_byte, "rows": rows}


def _offload(run: Run, timeout: float) -> dict:
    """fsdp's cpu_offload term against FSDP2's CPUOffloadPolicy here (benchmarks/gpu/offload.py)."""
    from benchmarks.gpu import offload

    return offload.measure(run)
