"""Pipeline bubble: step time of atorch's PipelineModel against the ideal, as microbatches grow.

    python benchmarks/pipeline_bubble.py --nproc 2 --microbatches 2,4,8,16

A chain of equal MLP blocks is split over ``--nproc`` gloo ranks (one core each is the fair
setting: on a 2-core machine use 2 ranks) and trained with the 1F1B schedule (one stage per
rank) and interleaved 1F1B (two stages per rank), each microbatch of the same size, so the work
grows with the number of microbatches M (at least P: torch's 1F1B needs one per stage). The ideal step is the compute alone: every rank runs
forward and backward of its own layers M times with nothing to wait for (measured in the same
processes, interleaved with the pipelined steps), taken two ways: all ranks computing together
(they share the machine's cores and memory bandwidth, as in a pipeline's steady state) and each
rank alone (the others wait; what the theory assumes). The ratio measured / ideal is the bubble
plus communication; theory for P ranks: 1F1B (M + P - 1) / M, interleaved with v stages per rank
(M + (P - 1) / v) / M. Writes JSON and a markdown table to benchmarks/results/ and a plot to
docs/images/.

    python benchmarks/pipeline_bubble.py --traced --microbatches 4,8

The traced path against the layout path: the same blocks, once as an ``nn.Sequential`` (split by
its layout) and once in a plain module whose forward loops over an ``nn.ModuleList`` of them
(split by tracing), both 1F1B, timed side by side; writes benchmarks/results/pipeline_traced.*.
"""

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

VIRTUAL = 2  # stages per rank of the interleaved schedule


def chain(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)))


def _loss(batch, output):
    return output.square().mean()


def sgd_step(model, inputs: dict):
    """One training step of a pipelined chain on ``inputs`` (SGD over the rank's parameters)."""
    optim = torch.optim.SGD(model.local_parameters(), lr=1e-4)

    def step():
        model.run_train(**inputs)
        optim.step()
        optim.zero_grad()

    return step


def pipelined_step(schedule: str, virtual: int, width: int, layers: int, micro: int, m: int):
    from atorch.pipeline import PipelineModel

    model = PipelineModel(chain(width, layers), num_microbatches=m, virtual_pipeline_size=virtual,
                          auto_partition=True, schedule=schedule, loss_fn=_loss)
    return sgd_step(model, {"input": torch.randn(micro * m, width)}), model


class LoopChain(nn.Module):
    """The chain's blocks in a plain module whose forward loops over them: no layout knows it."""

    def __init__(self, sequential: nn.Sequential):
        super().__init__()
        self.blocks = nn.ModuleList(sequential)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def split_step(traced: bool, width: int, layers: int, micro: int, m: int):
    """One 1F1B training step of the chain, split by its layout or (``traced``) by tracing."""
    from atorch.pipeline import PipelineModel

    module = LoopChain(chain(width, layers)) if traced else chain(width, layers)
    model = PipelineModel(module, num_microbatches=m, auto_partition=True, loss_fn=_loss)
    return sgd_step(model, {"x" if traced else "input": torch.randn(micro * m, width)})


def run_traced(microbatches: list[int], width: int, layers: int, micro: int, repeats: int, steps: int) -> list[dict]:
    """On every rank: per M, the layout path and the traced path of the same chain, side by side."""
    rows = []
    for m in microbatches:
        variants = {"layout": split_step(False, width, layers, micro, m), "traced": split_step(True, width, layers,
                                                                                             micro, m)}
        samples = harness.interleave(variants, repeats, steps)
        rows.append({"microbatches": m, **{name: harness.summary(samples[name]) for name in variants},
                     "traced_over_layout": harness.ratio(samples, "traced", "layout")})
    return rows


def report_traced(rows: list[dict], args) -> str:
    body = [[r["microbatches"], harness.fmt_ms(r["layout"]["median"]), harness.fmt_ms(r["traced"]["median"]),
             f"{r['traced_over_layout']:.3f}"] for r in rows]
    load = getattr(args, "load", None)
    note = harness.load_note(load)
    markdown = note + harness.table(["microbatches", "layout ms (1F1B)", "traced ms (1F1B)", "traced / layout"], body)
    harness.write(args.out, {"nproc": args.nproc, "width": args.width, "layers": args.layers,
                             "microbatch_size": args.micro, "repeats": args.repeats, "steps_per_block": args.steps,
                             "load_average": load, "rows": rows}, markdown)
    return markdown


def compute_step(model, width: int, micro: int, m: int):
    """This rank's own forward and backward, M microbatches, nothing to wait for."""
    stages = list(model.stage_modules)
    x = torch.randn(micro, width)
    optim = torch.optim.SGD(model.local_parameters(), lr=1e-4)

    def step():
        for _ in range(m):
            for stage in stages:
                stage(x.requires_grad_()).square().mean().backward()
        optim.step()
        optim.zero_grad()

    return step


def alone_step(compute, pp: int):
    """The ranks' compute steps one rank at a time (the others wait at a barrier): P times the
    compute of one rank running alone, so no two ranks share the cores or memory bandwidth."""
    import torch.distributed as dist

    def step():
        for turn in range(pp):
            dist.barrier()
            if dist.get_rank() == turn:
                compute()
        dist.barrier()

    return step


def run(microbatches: list[int], width: int, layers: int, micro: int, repeats: int, steps: int) -> list[dict]:
    """On every rank: per M, time 1F1B, interleaved 1F1B and the compute-only ideal side by side."""
    import torch.distributed as dist

    pp = dist.get_world_size()
    rows = []
    for m in microbatches:
        one, one_model = pipelined_step("1f1b", 1, width, layers, micro, m)
        inter, _ = pipelined_step("interleaved", VIRTUAL, width, layers, micro, m)
        compute = compute_step(one_model, width, micro, m)
        variants = {"ideal": compute, "alone": alone_step(compute, pp), "1f1b": one, "interleaved": inter}
        samples = harness.interleave(variants, repeats, steps)
        samples["alone"] = [t / pp for t in samples["alone"]]
        rows.append({
            "microbatches": m, **{name: harness.summary(samples[name]) for name in variants},
            "alone_1f1b": harness.ratio(samples, "1f1b", "alone"),
            "alone_interleaved": harness.ratio(samples, "interleaved", "alone"),
            "ratio_1f1b": harness.ratio(samples, "1f1b", "ideal"),
            "ratio_interleaved": harness.ratio(samples, "interleaved", "ideal"),
            "theory_1f1b": (m + pp - 1) / m, "theory_interleaved": (m + (pp - 1) / VIRTUAL) / m,
        })
    return rows


def plot(path: Path, rows: list[dict], nproc: int, load: dict | None = None) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ms = [r["microbatches"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for key, label, color in (("1f1b", "1F1B", "tab:blue"), ("interleaved", f"interleaved (v={VIRTUAL})", "tab:orange")):
        ax.plot(ms, [r[f"ratio_{key}"] for r in rows], "o-", color=color, label=f"{label} / ideal (together)")
        ax.plot(ms, [r[f"alone_{key}"] for r in rows], "s:", color=color, label=f"{label} / ideal (alone)")
        ax.plot(ms, [r[f"theory_{key}"] for r in rows], "--", color=color, label=f"{label} theory")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("microbatches per step")
    ax.set_ylabel("step time / ideal (compute only)")
    busy = f", load avg {load['before']:.1f} on {load['cpus']} cores" if load else ""
    ax.set_title(f"Pipeline bubble, {nproc} gloo ranks on CPU{busy}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(rows: list[dict], args) -> str:
    body = [[r["microbatches"], harness.fmt_ms(r["ideal"]["median"]), harness.fmt_ms(r["alone"]["median"]),
             harness.fmt_ms(r["1f1b"]["median"]), f"{r['ratio_1f1b']:.2f} / {r['alone_1f1b']:.2f}",
             f"{r['theory_1f1b']:.2f}", harness.fmt_ms(r["interleaved"]["median"]),
             f"{r['ratio_interleaved']:.2f} / {r['alone_interleaved']:.2f}", f"{r['theory_interleaved']:.2f}"]
            for r in rows]
    load = getattr(args, "load", None)
    note = harness.load_note(load)
    markdown = note + harness.table(["microbatches", "ideal ms (together)", "ideal ms (alone)", "1F1B ms",
                              "1F1B / ideal (together / alone)", "theory", f"interleaved (v={VIRTUAL}) ms",
                              "interleaved / ideal (together / alone)", "theory"], body)
    harness.write(args.out, {"nproc": args.nproc, "width": args.width, "layers": args.layers,
                             "microbatch_size": args.micro, "repeats": args.repeats, "steps_per_block": args.steps,
                             "load_average": getattr(args, "load", None), "rows": rows}, markdown)
    if args.plot:
        plot(Path(args.plot), rows, args.nproc, getattr(args, "load", None))
    return markdown


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--microbatches", default="2,4,8,16", help="comma-separated microbatch counts")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="blocks in the chain (at least 2 x nproc)")
    parser.add_argument("--micro", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed block")
    parser.add_argument("--tiny", action="store_true", help="toy sizes that only show the benchmark runs")
    parser.add_argument("--traced", action="store_true", help="the traced path against the layout path instead")
    parser.add_argument("--out", default=str(harness.RESULTS / "pipeline_bubble"))
    parser.add_argument("--plot", default=str(harness.IMAGES / "pipeline_bubble.png"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.microbatches, args.width, args.layers, args.micro, args.repeats, args.steps = "2,4", 8, 4, 2, 1, 1
    microbatches = [int(m) for m in args.microbatches.split(",") if m]
    if args.layers < VIRTUAL * args.nproc:
        parser.error(f"--layers must be at least {VIRTUAL * args.nproc} to give every interleaved stage a block")

    if args.traced:
        if args.out == str(harness.RESULTS / "pipeline_bubble"):
            args.out = str(harness.RESULTS / "pipeline_traced")
        job = functools.partial(run_traced, microbatches, args.width, args.layers, args.micro, args.repeats, args.steps)
        rows, args.load = harness.run_loaded(job, args.nproc)
        markdown = report_traced(rows, args)
        print(markdown)
        return markdown
    job = functools.partial(run, microbatches, args.width, args.layers, args.micro, args.repeats, args.steps)
    rows, args.load = harness.run_loaded(job, args.nproc)
    markdown = report(rows, args)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
