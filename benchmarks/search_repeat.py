"""The same search, run again and again: each search's pick, who it was tied with, and every
measured candidate's readings (median throughput, range, the timed steps). What the "same pick"
column of search_quality.py counts, with the readings that decided it.

    .venv/bin/python benchmarks/search_repeat.py --scenario small --searches 5    # about 1 min

Searches a scenario of benchmarks/search_quality.py (its model, data and budget rule) on 4 gloo
ranks, no search cache, 3 timed steps a dry run as search_quality gives it; no exhaustive run,
so a budget rule that needs the exhaustive run's peaks is not supported (``small``, ``bert`` and
``gpt2-tied`` have none). Writes benchmarks/results/search_repeat_<scenario>.{json,md}.
"""

import argparse
import functools
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, search_quality  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


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
                                  "range": c.throughput_range, "step_seconds": sorted(c.step_seconds or [])}
                                 for c in sorted(measured, key=lambda c: -c.throughput)]})
    return out


def calibrated_searches(name: str, count: int, report_dir: str) -> list[dict]:
    from atorch.auto.search.calibrate import calibrate

    calibrate()  # the search estimates at this machine's rates (cached once)
    return searches(name, count, report_dir)


def markdown(name: str, runs: list[dict]) -> str:
    lines = [f"Search of `{name}` repeated {len(runs)} times (samples/s: the median timed step's, "
             "its range the slowest and fastest step's; the steps in ms):", ""]
    for index, run in enumerate(runs, 1):
        tied = f", tied with {', '.join(run['tied'])}" if run["tied"] else ""
        lines += [f"{index}. picked {run['pick']}{tied}", ""]
        rows = [[m["strategy"], f"{m['throughput']:.1f}", f"{m['range'][0]:.1f}-{m['range'][1]:.1f}",
                 str(len(m["step_seconds"])), " ".join(f"{s * 1e3:.1f}" for s in m["step_seconds"])]
                for m in run["measured"]]
        lines += [harness.table(["candidate", "median", "range", "steps", "step ms"], rows), ""]
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="small", choices=sorted(search_quality.SCENARIOS))
    p.add_argument("--searches", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--out", default=None, help="default: benchmarks/results/search_repeat_<scenario>")
    args = p.parse_args(argv)
    from atorch.distributed.local import run_local

    with tempfile.TemporaryDirectory() as report_dir:
        runs = run_local(functools.partial(calibrated_searches, args.scenario, args.searches, report_dir), args.nproc,
                         timeout_s=3600)[0]
    text = markdown(args.scenario, runs)
    harness.write(args.out or RESULTS / f"search_repeat_{args.scenario.replace('-', '_')}",
                  {"scenario": args.scenario, "nproc": args.nproc, "runs": runs}, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
