"""``python -m benchmarks.gpu``: run the GPU check's units in order, resuming a cut run.

    python -m benchmarks.gpu                     # every step (about 20-25 min on one H100)
    python -m benchmarks.gpu --budget 540        # start no unit after 9 min; run again to go on
    python -m benchmarks.gpu --step tests        # one step (tests, calibrate, bench, estimate)
    python -m benchmarks.gpu --fresh             # forget the earlier run of this device
    python -m benchmarks.gpu --dry               # the CPU dry path, even where CUDA is

Exit status: 0 when the steps asked for are finished and nothing failed, 1 when a unit or a test
failed (the report says which), 3 when the budget ran out first (run the same command again).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from atorch.utils.cache_dir import cache_root
from benchmarks.gpu.state import FINISHED, State
from benchmarks.gpu.steps import ROOT, STEPS, Run, units

RESULTS = ROOT / "benchmarks" / "results"
BUDGET_LEFT_TO_START = 30  # seconds: a unit is not started with less of the budget left


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", action="append", choices=STEPS, help="run this step only (repeatable; default: all)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds this invocation may take: no unit starts past it, a unit running at it is "
                        "stopped and runs again next time (default: none)")
    p.add_argument("--fresh", action="store_true", help="start again instead of resuming")
    p.add_argument("--retry-failed", action="store_true", help="run failed units again")
    p.add_argument("--dry", action="store_true", help="the CPU dry path even where CUDA is available")
    p.add_argument("--work-dir", default=None, help="the run's folder (state, logs, calibration); default "
                   "$ATORCH_CACHE_DIR/gpu-check/<device>, else $XDG_CACHE_HOME/atorch/...")
    p.add_argument("--out-dir", default=None, help="where gpu_<device>_<date>.{json,md} go (default: "
                   "benchmarks/results on CUDA, the run's folder on the dry path)")
    p.add_argument("--calibration", default=None, help="take this calibration file instead of running atorch "
                   "calibrate (e.g. one measured earlier on the same device)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps a variant (default 3; dry 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps a variant (default 10; dry 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences a step (default 4; dry 2)")
    p.add_argument("--features", default=None, help="comma-separated of bf16,checkpoint,compile,fp8,"
                   "fused_optimizer,compile_fused,fused_kernels,search (default all)")
    p.add_argument("--in-process", action="store_true",
                   help="run the units in this process (no time limit a unit; for tests and debugging)")
    return p


def device_slug() -> tuple[str, str, bool]:
    """(the GPU's name, its slug for file names, whether CUDA is here)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", "cpu-dry", False
    from atorch.auto.search.calibrate import device_name

    name = torch.cuda.get_device_name(0)
    return name, device_name(torch.device("cuda", 0)).removeprefix("cuda-"), True


def make_config(args, device_name: str, slug: str, cuda: bool) -> dict:
    from benchmarks.gpu.llama import DRY, FEATURES, LLAMA_1B

    dry = args.dry or not cuda
    size = (DRY if dry else LLAMA_1B).as_dict()
    if args.batch:
        size["batch"] = args.batch
    features = args.features.split(",") if args.features else list(FEATURES)
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise SystemExit(f"unknown features {unknown}; choose from {list(FEATURES)}")
    return {"device": "cpu" if dry else "cuda", "dry": dry, "device_name": "cpu (dry path)" if dry else device_name,
            "slug": "cpu-dry" if dry else slug, "size": size, "features": features,
            "warmup": args.warmup if args.warmup is not None else (1 if dry else 3),
            "steps": args.steps if args.steps is not None else (2 if dry else 10),
            "calibration": str(Path(args.calibration).resolve()) if args.calibration else None}


def default_work_dir(slug: str) -> Path:
    return cache_root() / "gpu-check" / slug


def run_isolated(state: State, unit, timeout: float) -> tuple[str, dict]:
    """The unit in a child process; ("done", result), ("failed", why) or ("timeout", why)."""
    folder = state.path.parent
    result_path = folder / "units" / (unit.key.replace("/", "--") + ".json")
    log = folder / "logs" / (unit.key.replace("/", "--") + ".log")
    result_path.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks.gpu.unit", str(state.path), unit.key, str(result_path), str(timeout)]
    with open(log, "w") as file:
        try:
            code = subprocess.run(argv, cwd=ROOT, stdout=file, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "timeout", {"error": f"stopped after {timeout:.0f}s", "log": str(log)}
    if code or not result_path.is_file():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        return "failed", {"error": f"exited {code}", "log": str(log), "tail": tail}
    return "done", json.loads(result_path.read_text())


def run_in_process(state: State, unit, timeout: float) -> tuple[str, dict]:
    import traceback

    results = {k: u["result"] for k, u in state.data["units"].items() if u["status"] == "done"}
    try:
        return "done", unit.run(Run(state.data["config"], state.path.parent, results), timeout)
    except Exception as error:  # noqa: BLE001 - a unit's failure is recorded, the run goes on
        return "failed", {"error": f"{type(error).__name__}: {error}", "tail": traceback.format_exc().splitlines()[-15:]}


def run_units(state: State, todo: list, budget: float | None, runner=run_isolated, retry_failed: bool = False,
              say=print) -> bool:
    """Run the units not finished, each by ``runner``; False when the budget stopped the run
    before the end."""
    began = time.monotonic()
    for unit in todo:
        status = state.unit(unit.key)["status"]
        if status in FINISHED and not (retry_failed and status == "failed"):
            continue
        limit = float(unit.limit_s)
        by_budget = False
        if budget is not None:
            left = budget - (time.monotonic() - began)
            if left < BUDGET_LEFT_TO_START:
                say(f"budget spent: {unit.key} and later units are left for the next run (the same command)")
                return False
            by_budget, limit = left < limit, min(limit, left)
        say(f"[{time.strftime('%H:%M:%S')}] {unit.key} (at most {limit:.0f}s) ...")
        state.mark(unit.key, "running")
        outcome, result = runner(state, unit, limit)
        if outcome == "timeout" and by_budget:
            state.mark(unit.key, "pending", note="stopped by the budget: runs again next time")
            say("  stopped by the budget; the next run starts here")
            return False
        if outcome == "done" and set(result) == {"skipped"}:
            state.mark(unit.key, "skipped", note=result["skipped"])
        elif outcome == "done":
            state.mark(unit.key, "done", result=result)
        else:
            state.mark(unit.key, "failed", note=result.get("error", ""), result=result)
        unit_state = state.unit(unit.key)
        say(f"  {unit_state['status']} in {unit_state.get('seconds', 0):.0f}s"
            + (f": {unit_state['note']}" if unit_state.get("note") else ""))
    return True


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    name, slug, cuda = device_slug()
    if not cuda:
        print("no CUDA device here: running the CPU dry path (the steps, their bookkeeping and the report on a "
              "tiny Llama on the CPU); on a GPU machine the same command runs the GPU check")
    elif args.dry:
        print(f"CUDA device {name} here, but --dry: running the CPU dry path")
    config = make_config(args, name, slug, cuda)
    folder = Path(args.work_dir) if args.work_dir else default_work_dir(config["slug"])
    state, how = State.open(folder / "state.json", config, args.fresh)
    print(how)
    # every invocation of this run, as a run under a device budget is one command called again
    # and again with other --step and --budget: the report names them all, not only the last
    state.data.setdefault("invocations", []).append(
        {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": list(sys.argv[1:] if argv is None
                                                                                    else argv)})
    state.save()
    chosen = args.step or list(STEPS)
    todo = [unit for unit in units(config) if unit.step in chosen]
    finished = run_units(state, todo, args.budget, run_in_process if args.in_process else run_isolated,
                         args.retry_failed)
    from benchmarks.gpu.report import build, summary, write

    report = build(state, units(config))
    out_dir = Path(args.out_dir) if args.out_dir else (folder if config["dry"] else RESULTS)
    paths = write(report, out_dir)
    print(summary(report))
    print(f"results: {paths[0]} and {paths[1]}")
    if not finished:
        print("not finished: run the same command again to go on from here")
        return 3
    return 1 if report["problems"] else 0
