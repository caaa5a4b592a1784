"""How good and how fast is the fully automatic search, against trying every candidate?

    .venv/bin/python benchmarks/search_quality.py --nproc 4 --repeats 11 --steps 5

Six scenarios on 4 gloo processes (issue 18), each a Llama of benchmarks/workload.py and a
per-rank memory budget:
- ``small``: hidden 128, 4 blocks, 64 tokens; no budget (the device's memory);
- ``memory-bound``: the same model, a budget of 75% of plain data parallel's measured peak, so
  the winner has to shard, checkpoint or split the model;
- ``boundary``: the same model, a budget 3% above the smallest peak of the space (the highest of
  that candidate's measured readings, ``BOUNDARY_READINGS``; or, for a candidate whose peak was not
  measured, the estimate at its error bound, see below), so only a few candidates fit and those
  near the budget must be dry-run to be told apart;
- ``deep-narrow``: 16 blocks of hidden 64 on 256 tokens, 60% of plain data parallel's peak:
  activations dominate and must go;
- ``tensor-best``: 8 heads on 16-token sequences (parameters and Adam state dominate), 70% of
  plain data parallel's peak, with sharding and pipelines excluded: only tensor layouts fit;
- ``pipeline-best``: the same kind of model with 8 blocks, 60% of plain data parallel's peak,
  with sharding and tensor parallelism excluded: only pipeline layouts fit;
- models that are not Llamas (benchmarks/search_jobs.py), each from a config: ``bert`` (a BERT
  masked LM, an encoder), ``gpt2-tied`` (a GPT-2 whose head is
  its token embedding) with no budget, and ``mlp-heavy`` (a residual MLP of wide blocks on
  ``(input, target)`` batches, weights and Adam's state most of its memory) at 80% of plain data
  parallel's peak.

Each scenario is searched ``--searches`` times (5), no cache: the "same pick" column counts how
often the most frequent pick came back. "estimate rank" is Spearman's rank correlation of the
estimated with the measured throughput over the exhaustive run's candidates (goal >= 0.8). The
benchmark calibrates this machine's rates first (``atorch calibrate``, cached), as a user would.

For each scenario the exhaustive run dry-runs every candidate of the search's own space (atorch's
``measure``): the layouts of ``layout_space`` combined by ``candidate_space``, with the scenario's
``excluded`` methods, exactly as ``auto_accelerate``'s search builds it. Then ``auto_accelerate``
searches with the same budget and ``excluded``. The best of the exhaustive run is its fastest
candidate that fits the budget, judged as the search judges its dry runs: the measured peak is
at most the budget, or, for a candidate whose peak was not measured (the tracker failed), its
estimate fits even at the lowest estimated / measured ever seen (``cost.ESTIMATE_FLOOR``).
Pipeline candidates' peaks are measured inside the schedule since 2026-11-24. The picked and the
best strategy are then timed against each other in interleaved blocks. Figures of merit: picked /
best throughput (goal >= 0.95), search wall time / exhaustive wall time (goal <= 0.10), and
whether the pick fits (its measured peak against the budget). Since 2026-11-28 "the best" is the
exhaustive best given the methods the search tries on its own pick (the fused step, torch.compile;
benchmarks/refined_best.py): the fastest of its variants, timed in the same blocks as the pick.

The exhaustive run dry-runs each distinct candidate once (those that planning makes the same on
this model are counted in "candidates" but run once): on 2026-11-26, with gradient accumulation,
selective checkpointing and virtual stages in the space, 204 of 408 on small, 48 of 96 on
tensor-best, 60 of 120 on pipeline-best, 132 of 396 on gpt2-tied, 198 of 396 on bert. The search's time is its fixed
cost (probes, the optimizer's step timed) and up to ``max_dryruns``=8 dry runs, fewer where the
early stop says nothing left can win: a small space keeps the ratio high, since two dry runs are
the least the early stop needs (mlp-heavy as one flat ``nn.Sequential``, 16 distinct candidates,
read 0.27; as blocks, 138 distinct, 0.033).

``--exhaustive-from PATTERN`` reruns only the searches and the side-by-side timing against an
earlier run's exhaustive part (its table, budget, time and estimate rank, from the JSON that
``--out`` wrote): what a change to the search's own rules (ties, close calls) needs; a change to
the estimates or the dry runs needs the whole run.

Wall time on 2 shared cores with 4 ranks: ``--tiny --repeats 2 --steps 2`` takes about 8 minutes
(exhaustive 34-92 s and search 8-19 s per scenario, plus start-up and timing); its figures only
show that it runs (its estimates were 0.3-0.5 of the measured peaks while the dry runs counted
the dataset a batch views, 2 MiB against a toy model's few hundred KiB; not re-measured since). At full size (2026-11-26) the exhaustive runs
take 5-6 minutes on small, memory-bound and boundary, 8-9 on bert and gpt2-tied, 5-10 on
mlp-heavy, 22 on deep-narrow, 2 on tensor-best and pipeline-best, and a scenario with its 5
searches and side-by-side timing 4-25 minutes; it is best run a scenario at a time (``--scenarios``, each with its own ``--out``). Before the search released each dry run's copy (2026-11-24), the
exhaustive run of 64 candidates grew to 6 GB per rank and was killed for memory.
"""

import functools
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, refined_best  # noqa: E402
from benchmarks.search_jobs import JOBS  # noqa: E402
from benchmarks.workload import TINY, Size, batches  # noqa: E402

MIB = 2**20
# Methods that would let something other than the layout under test fit (sharding over the data
# ranks, or the other way of splitting the model); excluded from both the search and the
# exhaustive run of that scenario.
_SHARDING = ("zero1", "zero2", "fsdp", "mixed_parallel")
# Dry runs of the smallest candidate, beside its exhaustive one, whose highest measured peak sets
# the boundary scenario's budget. A peak is a draw: a collective's buffer freed by the backend's
# thread may or may not be alive at the worst moment. Tensor=2 x pipeline=2 with checkpointing read
# 4.91 MiB in most single-step dry runs and 4.96-5.22 in the others (2026-11-24); a budget 3% over
# a low reading then lies inside the spread of the search's own reading of the same candidate.
BOUNDARY_READINGS = 3


@dataclass(frozen=True)
class Scenario:
    size: Size
    tiny: Size
    # None: no budget; ("ddp", f): f x plain data parallel's measured peak; ("smallest", f): f x the
    # smallest peak of the space, as the search judges peaks (_judged_peak)
    budget: tuple[str, float] | None = None
    excluded: tuple[str, ...] = ()
    job: str = "llama"  # benchmarks/search_jobs.py's JOBS


_TINY_TP = replace(TINY, heads=4)  # 2 key/value heads: tensor=2 divides them (8 and 4 in full: tensor=4 too)
SCENARIOS = {
    "small": Scenario(Size(), TINY),
    "memory-bound": Scenario(Size(), TINY, ("ddp", 0.75)),
    "boundary": Scenario(Size(), TINY, ("smallest", 1.03)),
    "deep-narrow": Scenario(Size(hidden=64, layers=16, seq=256), replace(TINY, layers=4, seq=64), ("ddp", 0.6)),
    "tensor-best": Scenario(Size(heads=8, seq=16), replace(_TINY_TP, seq=8), ("ddp", 0.7),
                            (*_SHARDING, "pipeline_parallel")),
    "pipeline-best": Scenario(Size(layers=8, seq=16), replace(TINY, layers=4, seq=8), ("ddp", 0.6),
                              (*_SHARDING, "tensor_parallel")),
    # models that are not Llamas (benchmarks/search_jobs.py)
    "bert": Scenario(Size(), TINY, job="bert"),
    "gpt2-tied": Scenario(Size(), TINY, job="gpt2"),
    "mlp-heavy": Scenario(Size(hidden=512, layers=4, vocab=256, seq=64), replace(TINY, hidden=64, seq=16),
                          ("ddp", 0.8), job="mlp"),
    # held out: models and sizes no rule of the search was tuned on (run them with --fresh: no
    # calibration, an empty cache, as a new user's first search)
    "hidden-bert-cls": Scenario(Size(hidden=128, layers=4, heads=4, vocab=1024, seq=64), TINY, ("ddp", 0.8),
                                job="bert-cls"),
    "hidden-gpt2-wide": Scenario(Size(hidden=128, layers=4, heads=4, vocab=4096, seq=64), replace(TINY, vocab=512),
                                 job="gpt2"),
    "hidden-mlp": Scenario(Size(hidden=256, layers=6, vocab=64, seq=128), replace(TINY, hidden=64, seq=16),
                           ("ddp", 0.9), job="mlp"),
}
# Searches of each scenario (the first one's pick is the scenario's), no cache: the reproducibility column
SEARCHES = 5


def _agreed_seconds(start: float) -> float:
    import torch.distributed as dist

    value = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _layout(strategy, world: int) -> str:
    from atorch.auto.registry import get_method
    from atorch.auto.search.engine import layout_dims
    from atorch.auto.search.space import layout_text

    config = next((c.model_dump() for name, c in strategy.items() if get_method(name).layouts is not None), None)
    return layout_text(layout_dims(strategy, world).items(), config)


def _label(strategy: dict, world: int) -> str:
    """The methods on top of the layout, each variant named as the search's report names it, and
    the layout: ``checkpoint (selective) + gradient_accumulation x4 [pipeline=2 x data=2, microbatches=4]``.
    Without the variants, two candidates of one space read the same (gradient_accumulation x2 and
    x4), and a table keyed by label paired one's measurement with the other's estimate."""
    from atorch.auto.registry import get_method
    from atorch.auto.search.space import method_labels
    from atorch.auto.strategy import Strategy

    parsed = Strategy.from_data(strategy)
    names = method_labels((n, c) for n, c in parsed.items() if n != "parallel_mode" and get_method(n).layouts is None)
    return f"{' + '.join(names) or 'plain'} [{_layout(parsed, world)}]"


def _judged_peak(candidate, model, world: int) -> float | None:
    """The peak the search holds a dry-run candidate to (engine._judge_peak): the measured one, or
    for a candidate whose peak was not measured (the tracker failed), its estimate over the lowest
    estimated / measured ratio ever seen (``cost.ESTIMATE_FLOOR``)."""
    from atorch.auto.search import cost

    if candidate.measured_peak_bytes is not None:
        return candidate.measured_peak_bytes
    if candidate.estimated_peak_bytes is None:
        return None
    return candidate.estimated_peak_bytes / cost.ESTIMATE_FLOOR


def _fits(candidate, budget: int | None, model, world: int) -> bool:
    """Whether a dry-run candidate fits ``budget`` as the search judges it."""
    if budget is None:  # the device's memory: a dry run that ran fits it
        return True
    peak = _judged_peak(candidate, model, world)
    return peak is not None and peak <= budget


def _fits_text(candidate, budget: int | None, fits: bool) -> str:
    """The pick's peak (as the search's report has it) against the budget."""
    if candidate.measured_peak_bytes is not None:
        peak, how = candidate.measured_peak_bytes, "measured"
    elif candidate.estimated_peak_bytes is not None:
        peak, how = candidate.estimated_peak_bytes, "estimated" + (", surely fits" if fits else "")
    else:
        return "yes (no budget; peak not known)" if fits else "NO: peak not known"
    limit = "no budget" if budget is None else f"{'<=' if fits else '>'} {budget / MIB:.2f}"
    return f"{'yes' if fits else 'NO'}: {peak / MIB:.2f} MiB {how} ({limit})"


def _step(job, size: Size, strategy):
    """One step of the documented loop (result.backward and result.step: a pipeline's way too)."""
    import atorch

    status, result, _ = atorch.auto_accelerate(
        job.build(size), torch.optim.AdamW, job.dataset(size), job.loss_func, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": size.global_batch, "shuffle": True}, model_input_format=job.model_input_format,
        load_strategy=strategy,
    )
    if not status:
        raise RuntimeError(f"atorch could not apply {strategy}")
    it = batches(result.dataloader)

    def step():  # one optimizer step: every micro-batch a strategy accumulates (result.sync_gradients)
        while True:
            batch = result.prepare_input(next(it), atorch.device())
            output = result.model(batch[0]) if job.model_input_format == "input_target" else result.model(**batch)
            result.backward(result.loss_func(batch, output))
            result.step()
            if result.sync_gradients:
                break

    return step


def _budget(rule, measured, model, world: int, remeasure) -> int | None:
    """The scenario's budget. For ``("smallest", f)``: f x the highest of the smallest candidate's
    readings, its exhaustive one and ``BOUNDARY_READINGS`` more (``remeasure(strategy)`` gives the
    measured peak of one dry run)."""
    if rule is None:
        return None
    kind, factor = rule
    if kind == "ddp":
        plain = next(c for c in measured if [m["name"] for m in c.strategy["methods"]] == ["parallel_mode"])
        return int(plain.measured_peak_bytes * factor)
    judged = [(p, c) for c in measured if (p := _judged_peak(c, model, world)) is not None]
    peak, smallest = min(judged, key=lambda pair: pair[0])
    if smallest.measured_peak_bytes is not None:
        peak = max([peak, *(remeasure(smallest.strategy) or 0 for _ in range(BOUNDARY_READINGS))])
    return int(peak * factor)


def exhaustive_run(size: Size, spec: Scenario) -> dict:
    """Every candidate of the search's own space dry-run (on every rank): the table, the budget and
    the scenario's common figures."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import measure
    from atorch.auto.search.space import candidate_space, layout_space
    from atorch.auto.strategy import Strategy
    from atorch.utils.log import quiet

    work = JOBS[spec.job]
    build, data = functools.partial(work.build, size), functools.partial(work.dataset, size)
    job = {"optim_args": {"lr": 1e-3}, "dataloader_args": {"batch_size": size.global_batch, "shuffle": True},
           "model_input_format": work.model_input_format}
    excluded = list(spec.excluded) or None
    device_ctx = DeviceContext.detect()
    world = device_ctx.world_size
    model = build()  # not trained: for the space and for estimates
    # The search's own space (engine.search): its layouts, combined with the other methods.
    layouts, _ = layout_space(model, device_ctx, size.global_batch, job["model_input_format"], excluded, None)
    candidates = candidate_space(device_ctx, excluded, None, None, layouts, model=model, global_batch=size.global_batch)
    start = time.perf_counter()
    with quiet():
        # the search's dry runs: its default warm-up steps, the 3 timed steps the search below is given
        exhaustive = measure(build(), candidates, torch.optim.AdamW, data(), work.loss_func,
                             timed_steps=3, max_dryruns=len(candidates), **job)
    exhaustive_s = _agreed_seconds(start)
    measured = [c for c in exhaustive.candidates if c.throughput is not None]

    def remeasure(strategy):
        with quiet():
            report = measure(build(), [Strategy.from_data(strategy)], torch.optim.AdamW, data(), work.loss_func,
                             timed_steps=1, warmup_steps=1, max_dryruns=1, **job)
        return report.candidates[0].measured_peak_bytes

    budget = _budget(spec.budget, measured, model, world, remeasure)
    fitting = [c for c in measured if _fits(c, budget, model, world)]
    table = [{"strategy": _label(c.strategy, world), "config": c.strategy, "throughput": c.throughput,
              "measured_peak_bytes": c.measured_peak_bytes, "estimated_peak_bytes": c.estimated_peak_bytes,
              "estimated_step_seconds": c.estimated_step_seconds, "fits": c in fitting, "status": c.status,
              "reason": c.reason} for c in exhaustive.candidates]
    return {"budget": budget, "excluded": list(spec.excluded), "size": size.as_dict(), "candidates": len(candidates),
            "dry_run": len(measured), "exhaustive_seconds": exhaustive_s, "exhaustive": table, "job": spec.job,
            "spearman": rank_agreement(table)}


def previous_exhaustive(path: str, name: str) -> dict:
    """The exhaustive part of an earlier run's results for ``name`` (its --out JSON): the search's
    rules (ties, close calls) do not enter it, so the searches can be rerun against it alone."""
    previous = json.loads(Path(path).read_text())["scenarios"][name]
    keep = ("budget", "excluded", "size", "candidates", "dry_run", "exhaustive_seconds", "exhaustive", "job", "spearman")
    return {**{key: previous[key] for key in keep}, "exhaustive_from": path}


def scenario(name: str, size: Size, spec: Scenario, repeats: int, steps: int, report_dir: str,
             searches: int = SEARCHES, previous: str | None = None) -> dict:
    """Exhaustive run (or ``previous``'s), search, then picked vs best timed side by side (on every rank)."""
    import torch.distributed as dist

    from atorch import auto_accelerate
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search.report import SearchReport
    from atorch.auto.strategy import Strategy
    from atorch.utils.log import quiet

    work = JOBS[spec.job]
    build, data = functools.partial(work.build, size), functools.partial(work.dataset, size)
    job = {"optim_args": {"lr": 1e-3}, "dataloader_args": {"batch_size": size.global_batch, "shuffle": True},
           "model_input_format": work.model_input_format}
    excluded = list(spec.excluded) or None
    world = DeviceContext.detect().world_size
    model = build()  # not trained: for judging the pick's peak
    common = exhaustive_run(size, spec) if previous is None else previous_exhaustive(previous, name)
    budget = common["budget"]
    fitting = [c for c in common["exhaustive"] if c["fits"] and c.get("throughput")]
    if not fitting:
        return {**common, "search_seconds": None, "picked": None, "best": None, "throughput_ratio": None,
                "fits": "-", "note": "no candidate fits the budget"}
    best = max(fitting, key=lambda c: c["throughput"])

    picks, times = [], []
    for index in range(searches):  # the first search's pick, report and time are the scenario's
        start = time.perf_counter()
        with quiet():
            found = auto_accelerate(build(), torch.optim.AdamW, data(), work.loss_func, memory_budget=budget,
                                    excluded=excluded, use_search_cache=False, dryrun_steps=3,
                                    report_file=f"{report_dir}/{name}{index}.json", **job)
        times.append(_agreed_seconds(start))
        picks.append(None if not found[0] else _label(found[2].to_dict(), world))
        if len(picks) == 1:
            status, _, picked = found
    search_s = times[0]
    dist.barrier()  # rank 0 has written the reports
    reports = [SearchReport.load(f"{report_dir}/{name}{index}.json") for index in range(searches)]
    report = reports[0]
    # what the search measured, beside the exhaustive run's measurements of the same candidates
    ran = [{"strategy": _label(c.strategy, world), "status": c.status, "throughput": c.throughput, "throughputs": c.throughputs,
            "side_by_side": c.side_by_side,
            "measured_peak_bytes": c.measured_peak_bytes, "estimated_step_seconds": c.estimated_step_seconds,
            "reason": c.reason} for c in report.candidates if c.status in ("measured", "failed")]
    # each search's close call side by side: samples/s of each candidate's median turn, and its turns
    side_by_side = [{_label(c.strategy, world): {"samples_per_s": c.side_by_side, "turn_seconds": c.side_by_side_seconds}
                     for c in each.candidates if c.side_by_side} for each in reports]
    search = {"search_seconds": search_s, "search_times": times, "picks": picks, "search_generated": report.generated,
              "search_stage_seconds": [each.stage_seconds for each in reports],  # where each search's time went
              "search_side_by_side": side_by_side,
              "search_dry_run": report.dry_run, "search_stopped": report.stopped,
              "search_pruned": report.pruned, "search_note": report.note, "search_ran": ran}
    winner = None if report.winner is None else report.candidates[report.winner]
    if not status:
        return {**common, **search, "picked": None, "best": best["config"], "throughput_ratio": 0.0,
                "fits": "-", "note": "the search returned no strategy"}
    best_strategy = Strategy.from_json(json.dumps(best["config"]))
    with quiet():  # the best given the search's trials on the pick too (benchmarks/refined_best.py)
        timed = refined_best.picked_against_best(functools.partial(_step, work, size), picked, best_strategy,
                                                 excluded, repeats, steps)
    return {**common, **search, "picked": picked.to_dict(), "best": timed["best"].to_dict(),
            "exhaustive_best": best["config"], "best_variant": timed["best_label"], "picked_is": timed["picked_is"],
            "variants_failed": timed["failed"], "variants_warmup_seconds": timed["warmup_seconds"],
            "throughput_ratio": timed["ratio"], "fits": _fits_text(winner, budget, _fits(winner, budget, model, world)),
            "samples": timed["samples"]}


def run(names: list[str], tiny: bool, repeats: int, steps: int, report_dir: str, searches: int,
        previous: str | None = None, calibrated: bool = True) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    from atorch.auto.search.calibrate import calibrate

    if calibrated:
        calibrate()  # the search estimates at this machine's rates, as docs/search.md has a user do (cached once)
    out = {}
    for name in names:
        spec = SCENARIOS[name]
        out[name] = scenario(name, spec.tiny if tiny else spec.size, spec, repeats, steps, report_dir, searches,
                             None if previous is None else previous.format(scenario=name))
    return out


def rank_agreement(table: list[dict]) -> float | None:
    """Spearman's rank correlation of the estimated throughput (1 / estimated step time) with the
    measured one over the exhaustive run's measured candidates: 1 when the estimate orders them
    as the dry runs do (the issue's goal: 0.8 or more)."""
    pairs = [(1 / c["estimated_step_seconds"], c["throughput"]) for c in table
             if c.get("throughput") and c.get("estimated_step_seconds")]
    return harness.spearman(*map(list, zip(*pairs))) if len(pairs) > 1 else None


def reproducibility(picks: list) -> str:
    """How often the most frequent pick came back, of the searches: ``5/5``, or ``3/5 (2 other)``."""
    if not picks:
        return "-"
    top = max(set(picks), key=picks.count)
    others = len(picks) - picks.count(top)
    return f"{picks.count(top)}/{len(picks)}" + (f" ({others} other)" if others else "")


def peak_ratios(exhaustive: list[dict]) -> str:
    """Estimated / measured peak over the exhaustive run's measured candidates: the range, and
    how many lie within 0.9-1.1 (the cost model's goal)."""
    ratios = [c["estimated_peak_bytes"] / c["measured_peak_bytes"] for c in exhaustive
              if c.get("estimated_peak_bytes") and c.get("measured_peak_bytes")]
    if not ratios:
        return "-"
    within = sum(0.9 <= r <= 1.1 for r in ratios)
    return f"{min(ratios):.2f}-{max(ratios):.2f} ({within}/{len(ratios)} in 0.9-1.1)"


def report(results: dict, nproc: int, out: str, plot: str | None) -> str:
    body = []
    for name, r in results.items():
        budget = "none" if r["budget"] is None else f"{r['budget'] / MIB:.2f} MiB"
        space = f"{r['candidates']} ({r['dry_run']} distinct)"
        peaks = peak_ratios(r["exhaustive"])
        if r["best"] is None:
            body.append([name, budget, space, "-", "-", r["note"], "-", f"{r['exhaustive_seconds']:.0f}", "-", "-",
                         "-", _rho(r), peaks])
            continue
        picked = "(none)" if r["picked"] is None else _label(r["picked"], nproc)
        body.append([name, budget, space, picked, _label(r["best"], nproc), f"{r['throughput_ratio']:.3f}",
                     f"{r['search_seconds']:.0f}", f"{r['exhaustive_seconds']:.0f}",
                     f"{r['search_seconds'] / r['exhaustive_seconds']:.3f}", r["fits"],
                     reproducibility(r.get("picks", [])), _rho(r), peaks])
    markdown = harness.table(["scenario", "budget/rank", "candidates", "search picked", "exhaustive best",
                              "picked/best throughput", "search s", "exhaustive s", "search/exhaustive time",
                              "fits", "same pick", "estimate rank (Spearman)", "estimated/measured peak"], body)
    stages = stage_table(results)
    if stages:
        markdown += "\n\nWhere each search's time went (seconds by stage, the search report's `stage_seconds`):\n\n" + stages
    harness.write(out, {"nproc": nproc, "scenarios": results}, markdown)
    if plot:
        done = {name: r for name, r in results.items() if r["best"] is not None}
        harness.ratio_plot(plot, list(done), {
            "picked / best throughput (goal >= 0.95)": [r["throughput_ratio"] for r in done.values()],
            "search / exhaustive wall time (goal <= 0.10)": [r["search_seconds"] / r["exhaustive_seconds"]
                                                             for r in done.values()],
        }, f"strategy search vs exhaustive, {nproc} gloo ranks", ylabel="ratio")
    return markdown


def stage_table(results: dict) -> str:
    """A row per search of each scenario: its stages' seconds, its time and the exhaustive run's."""
    from atorch.auto.search.state import STAGES

    body = []
    for name, r in results.items():
        for index, stages in enumerate(r.get("search_stage_seconds") or ()):
            if stages:
                body.append([name, str(index + 1), *(f"{stages.get(stage, 0.0):.1f}" for stage in STAGES),
                             f"{r['search_times'][index]:.0f}", f"{r['exhaustive_seconds']:.0f}"])
    return harness.table(["scenario", "search", *(f"{stage} s" for stage in STAGES), "search s", "exhaustive s"],
                         body) if body else ""


def _rho(r: dict) -> str:
    rho = r.get("spearman")
    return "-" if rho is None else f"{rho:.2f}"


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "search_quality", "scenarios", SCENARIOS, repeats=11, steps=5,
                            tiny="toy sizes that only show the benchmark runs")
    parser.set_defaults(nproc=4)
    parser.add_argument("--searches", type=int, default=SEARCHES,
                        help=f"searches of each scenario, no cache, for the same-pick column (default {SEARCHES})")
    parser.add_argument("--exhaustive-from", default=None, metavar="PATTERN",
                        help="reuse an earlier run's exhaustive part (its JSON; {scenario} is replaced by the "
                             "scenario's name) and rerun only the searches and the side-by-side timing")
    parser.add_argument("--fresh", action="store_true", help="as a new user: no calibration, an empty search cache "
                        "and an empty inductor cache (the search measures bf16's speedup itself)")
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.scenarios, SCENARIOS, "scenarios")
    from atorch.distributed.local import run_local

    with tempfile.TemporaryDirectory() as report_dir:
        if args.fresh:
            os.environ["ATORCH_CACHE_DIR"] = str(Path(report_dir) / "cache")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(report_dir) / "inductor")  # compiles cold, as a new user's
        results = run_local(functools.partial(run, names, args.tiny, args.repeats, args.steps, report_dir,
                                              args.searches, args.exhaustive_from, not args.fresh),
                                  args.nproc, timeout_s=3600)[0]
    markdown = report(results, args.nproc, args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
