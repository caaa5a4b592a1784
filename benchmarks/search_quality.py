"""How good and how fast is the fully automatic search, against trying every candidate?

    .venv/bin/python benchmarks/search_quality.py --nproc 2 --repeats 5 --steps 3

Three scenarios on 2 gloo processes:
- ``small``: a small Llama, memory to spare;
- ``budget``: the same model with a per-rank memory budget of 75% of what plain DDP measured, so
  the winner has to shard (or checkpoint);
- ``deep``: a deeper Llama on longer sequences with a budget of 60% of plain DDP's peak, so
  activations must go (checkpointing).
For each: the exhaustive run dry-runs every candidate of the search space (atorch's ``measure``),
then ``auto_accelerate`` searches with the same budget. The best of the exhaustive run is the
fastest candidate whose measured peak fits the budget. The picked and the best strategy are then
timed against each other in interleaved blocks. Figures of merit: picked / best throughput
(goal >= 0.95) and search wall time / exhaustive wall time (goal <= 0.25).
"""

import functools
import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.workload import TINY, Size, Tokens, atorch_step, build_llama, loss_func  # noqa: E402

SCENARIOS = {"small": (Size(), None), "budget": (Size(), 0.75), "deep": (Size(layers=8, seq=128), 0.6)}


def _agreed_seconds(start: float) -> float:
    import torch.distributed as dist

    value = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _label(strategy: dict) -> str:
    names = [m["name"] for m in strategy["methods"] if m["name"] != "parallel_mode"]
    return " + ".join(names) or "ddp"


def scenario(size: Size, fraction: float | None, repeats: int, steps: int) -> dict:
    """Exhaustive run, search, then picked vs best timed side by side (on every rank)."""
    from atorch import auto_accelerate
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import measure
    from atorch.auto.search.space import candidate_space
    from atorch.auto.strategy import Strategy
    from atorch.utils.log import quiet

    job = {"optim_args": {"lr": 1e-3}, "dataloader_args": {"batch_size": size.global_batch, "shuffle": True},
           "model_input_format": "unpack_dict"}
    candidates = candidate_space(DeviceContext.detect())
    start = time.perf_counter()
    with quiet():
        exhaustive = measure(build_llama(size), candidates, torch.optim.AdamW, Tokens(size), loss_func,
                             timed_steps=3, warmup_steps=1, max_dryruns=len(candidates), **job)
    exhaustive_s = _agreed_seconds(start)
    measured = [c for c in exhaustive.candidates if c.throughput is not None]
    plain = next(c for c in measured if _label(c.strategy) == "ddp")
    budget = None if fraction is None else int(plain.measured_peak_bytes * fraction)
    fitting = [c for c in measured if budget is None or c.measured_peak_bytes <= budget]
    table = [{"strategy": _label(c.strategy), "throughput": c.throughput, "measured_peak_bytes": c.measured_peak_bytes,
              "estimated_peak_bytes": c.estimated_peak_bytes, "estimated_step_seconds": c.estimated_step_seconds,
              "status": c.status, "reason": c.reason} for c in exhaustive.candidates]
    common = {"budget": budget, "candidates": len(candidates), "exhaustive_seconds": exhaustive_s, "exhaustive": table}
    if not fitting:
        return {**common, "search_seconds": None, "picked": None, "best": None, "throughput_ratio": None,
                "note": "no candidate's measured peak fits the budget"}
    best = max(fitting, key=lambda c: c.throughput)

    start = time.perf_counter()
    with quiet():
        status, _, picked = auto_accelerate(build_llama(size), torch.optim.AdamW, Tokens(size), loss_func,
                                            memory_budget=budget, use_search_cache=False, dryrun_steps=3, **job)
    search_s = _agreed_seconds(start)
    if not status:
        return {**common, "search_seconds": search_s, "picked": None, "best": best.strategy, "throughput_ratio": 0.0,
                "note": "the search returned no strategy"}
    best_strategy = Strategy.from_json(json.dumps(best.strategy))
    if best_strategy == picked:
        ratio, samples = 1.0, None
    else:
        with quiet():
            variants = {"picked": atorch_step(build_llama(size), size, picked),
                        "best": atorch_step(build_llama(size), size, best_strategy)}
        samples = harness.interleave(variants, repeats, steps)
        ratio = harness.ratio(samples, "best", "picked")  # step time best/picked = throughput picked/best
    return {**common, "search_seconds": search_s, "picked": picked.to_dict(), "best": best.strategy,
            "throughput_ratio": ratio, "samples": samples}


def run(names: list[str], tiny: bool, repeats: int, steps: int) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = {}
    for name in names:
        size, fraction = SCENARIOS[name]
        if tiny:
            size = replace(TINY, layers=size.layers // 2 or 1)
        out[name] = scenario(size, fraction, repeats, steps)
    return out


def report(results: dict, nproc: int, out: str, plot: str | None) -> str:
    body = []
    for name, r in results.items():
        budget = "none" if r["budget"] is None else f"{r['budget'] / 2**20:.1f} MiB"
        if r["best"] is None:
            body.append([name, budget, r["candidates"], "-", "-", r["note"], "-", f"{r['exhaustive_seconds']:.0f}", "-"])
            continue
        picked = "(none)" if r["picked"] is None else _label(r["picked"])
        body.append([name, budget, r["candidates"], picked, _label(r["best"]), f"{r['throughput_ratio']:.3f}",
                     f"{r['search_seconds']:.0f}", f"{r['exhaustive_seconds']:.0f}",
                     f"{r['search_seconds'] / r['exhaustive_seconds']:.2f}"])
    markdown = harness.table(["scenario", "budget/rank", "candidates", "search picked", "exhaustive best",
                              "picked/best throughput", "search s", "exhaustive s", "search/exhaustive time"], body)
    harness.write(out, {"nproc": nproc, "scenarios": results}, markdown)
    if plot:
        done = {name: r for name, r in results.items() if r["best"] is not None}
        harness.ratio_plot(plot, list(done), {
            "picked / best throughput (goal >= 0.95)": [r["throughput_ratio"] for r in done.values()],
            "search / exhaustive wall time (goal <= 0.25)": [r["search_seconds"] / r["exhaustive_seconds"]
                                                             for r in done.values()],
        }, f"strategy search vs exhaustive, {nproc} gloo ranks", ylabel="ratio")
    return markdown


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "search_quality", "scenarios", SCENARIOS, repeats=5, steps=3,
                            tiny="toy sizes that only show the benchmark runs")
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.scenarios, SCENARIOS, "scenarios")
    from tests.helpers.dist import run_distributed

    results = run_distributed(functools.partial(run, names, args.tiny, args.repeats, args.steps), args.nproc,
                              timeout_s=3600)[0]
    markdown = report(results, args.nproc, args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
