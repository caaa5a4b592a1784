"""The same search, run again and again: each search's pick, who it was tied with, and every
measured candidate's readings (median throughput, range, the timed steps). What the "same pick"
column of search_quality.py counts, with the readings that decided it.

    .venv/bin/python benchmarks/search_repeat.py --scenario small --searches 5    # about 1 min
    .venv/bin/python benchmarks/search_repeat.py --scenario gpt2-tied --searches 3 --nproc 2 --fresh --busy

Searches a scenario of benchmarks/search_quality.py (its model, data and budget rule) on 4 gloo
ranks, no search cache, 3 timed steps a dry run as search_quality gives it; no exhaustive run,
so a budget rule that needs the exhaustive run's peaks is not supported (``small``, ``bert`` and
``gpt2-tied`` have none). Each measured candidate's row gives its estimated step, its readings
(one a dry run: its median step's samples/s; several for a close call timed again one by one)
and, for a close call timed side by side in the search, its samples/s there. With
``--side-by-side N`` the first search's pick and the candidates it was tied with are then timed
against each other in N interleaved blocks of 5 steps: how far apart a tie's members really are.
Writes benchmarks/results/search_repeat_<scenario>.{json,md}.
"""

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, search_quality  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS_TEXT = "interleaved blocks of 5 steps, the median step"


def searches(name: str, count: int, report_dir: str) -> list[dict]:
    """``count`` searches of scenario ``name`` on this process group; each one's pick and readings."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    from atorch import auto_accelerate
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search.report import MEASURED, SearchReport
    from atorch.utils.log import quiet

    spec = search_quality.SCENARIOS[name]
    if spec.budget is not None:
        raise SystemExit(f"{name}: its budget comes from the exhaustive run; use search_quality.py")
    work = search_quality.JOBS[spec.job]
    build, data = functools.partial(work.build, spec.size), functools.partial(work.dataset, spec.size)
    job = {"optim_args": {"lr": 1e-3}, "dataloader_args": {"batch_size": spec.size.global_batch, "shuffle": True},
           "model_input_format": work.model_input_format}
    world = DeviceContext.detect().world_size
    out = []
    for index in range(count):
        path = f"{report_dir}/search{index}.json"
        with quiet():
            _, _, picked = auto_accelerate(build(), torch.optim.AdamW, data(), work.loss_func,
                                           excluded=list(spec.excluded) or None, use_search_cache=False,
                                           dryrun_steps=3, report_file=path, **job)
        dist.barrier()  # rank 0 has written the report
        report = SearchReport.load(path)
        measured = [c for c in report.candidates if c.status == MEASURED and c.throughput]
        out.append({"pick": search_quality._label(picked.to_dict(), world),
                    "tied": [search_quality._label(report.candidates[i].strategy, world) for i in report.tied or []],
                    "measured": [{"strategy": search_quality._label(c.strategy, world), "throughput": c.throughput,
                                  "range": c.throughput_range, "step_seconds": sorted(c.step_seconds or []),
                                  "estimated_step_seconds": c.estimated_step_seconds, "readings": c.throughputs,
                                  "side_by_side": c.side_by_side,
                                  "config": c.strategy}
                                 for c in sorted(measured, key=lambda c: -c.throughput)]})
    return out


def side_by_side(name: str, run: dict, blocks: int) -> dict[str, float]:
    """Median step seconds of a search's pick and the candidates it was tied with, timed in
    ``blocks`` interleaved blocks of 5 steps (search_quality's way of timing picked against best)."""
    import json
    import statistics

    from atorch.auto.strategy import Strategy
    from atorch.utils.log import quiet

    spec = search_quality.SCENARIOS[name]
    work = search_quality.JOBS[spec.job]
    configs = {m["strategy"]: m["config"] for m in run["measured"]}
    with quiet():
        variants = {label: search_quality._step(work, spec.size, Strategy.from_json(json.dumps(configs[label])))
                    for label in [run["pick"], *run["tied"]]}
    samples = harness.interleave(variants, blocks, 5)
    return {label: statistics.median(values) for label, values in samples.items()}


def calibrated_searches(name: str, count: int, report_dir: str, blocks: int, calibrated: bool = True) -> dict:
    from atorch.auto.search.calibrate import calibrate

    if calibrated:
        calibrate()  # the search estimates at this machine's rates (cached once)
    runs = searches(name, count, report_dir)
    return {"runs": runs, "side_by_side": side_by_side(name, runs[0], blocks) if blocks else None}


def markdown(name: str, runs: list[dict], timed: dict[str, float] | None = None) -> str:
    lines = [f"Search of `{name}` repeated {len(runs)} times (samples/s: the median timed step's, "
             "its range the slowest and fastest step's; the steps in ms):", ""]
    for index, run in enumerate(runs, 1):
        tied = f", tied with {', '.join(run['tied'])}" if run["tied"] else ""
        lines += [f"{index}. picked {run['pick']}{tied}", ""]
        rows = [[m["strategy"], f"{m['throughput']:.1f}", f"{m['range'][0]:.1f}-{m['range'][1]:.1f}",
                 str(len(m["step_seconds"])), " ".join(f"{s * 1e3:.1f}" for s in m["step_seconds"]),
                 _estimate_ms(m), " ".join(f"{r:.0f}" for r in m.get("readings") or [m["throughput"]]),
                 f"{m['side_by_side']:.0f}" if m.get("side_by_side") else "-"]
                for m in run["measured"]]
        lines += [harness.table(["candidate", "median", "range", "steps", "step ms", "estimated ms",
                                 "readings", "side by side"], rows), ""]
    if timed:
        fastest = min(timed.values())
        lines += [f"The first search's pick and its ties side by side ({BLOCKS_TEXT}):", "",
                  harness.table(["candidate", "median step ms", "step / fastest"],
                                [[label, f"{value * 1e3:.1f}", f"{value / fastest:.3f}"]
                                 for label, value in sorted(timed.items(), key=lambda item: item[1])]), ""]
    return "\n".join(lines)


def _estimate_ms(measured: dict) -> str:
    seconds = measured.get("estimated_step_seconds")
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def _busy_core(busy: bool):
    """Another process spinning on one core meanwhile (a shared machine), when ``busy``."""
    if not busy:
        yield
        return
    import multiprocessing

    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        spinner.terminate()
        spinner.join()


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="small", choices=sorted(search_quality.SCENARIOS))
    p.add_argument("--searches", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--side-by-side", type=int, default=0, metavar="BLOCKS",
                   help="time the first search's pick and its ties in BLOCKS interleaved blocks of 5 steps")
    p.add_argument("--out", default=None, help="default: benchmarks/results/search_repeat_<scenario>")
    p.add_argument("--fresh", action="store_true", help="as a new user: an empty cache, no calibration (the "
                   "search measures bf16's speedup itself)")
    p.add_argument("--busy", action="store_true", help="another process keeps one core busy throughout")
    args = p.parse_args(argv)
    from atorch.distributed.local import run_local

    with tempfile.TemporaryDirectory() as report_dir, _busy_core(args.busy):
        if args.fresh:
            os.environ["ATORCH_CACHE_DIR"] = str(Path(report_dir) / "cache")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(report_dir) / "inductor")  # compiles cold, as a new user's
        found = run_local(functools.partial(calibrated_searches, args.scenario, args.searches, report_dir,
                                            args.side_by_side, not args.fresh), args.nproc, timeout_s=3600)[0]
    found["conditions"] = {"fresh": args.fresh, "busy": args.busy}
    text = markdown(args.scenario, found["runs"], found["side_by_side"])
    harness.write(args.out or RESULTS / f"search_repeat_{args.scenario.replace('-', '_')}",
                  {"scenario": args.scenario, "nproc": args.nproc, **found}, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
