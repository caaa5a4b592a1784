"""atorch's overhead: the same job through auto_accelerate and written by hand in plain PyTorch.

    .venv/bin/python benchmarks/overhead.py --nproc 2 --repeats 7 --steps 5

For each strategy (DDP, ZeRO-1, FSDP, bf16 autocast, activation checkpointing) both versions of
a Llama (workload.MEDIUM, steps of 270-390 ms (fp32)) live in the same 2 gloo processes, start from the
same weights, and take turns in interleaved blocks of steps. The figure of merit is the ratio of median step times,
atorch / hand-written (goal: at or under 1.02).
"""

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.workload import MEDIUM, TINY, Size, Tokens, atorch_step, build_llama, hand_loader, plain_step  # noqa: E402

STRATEGIES = {
    "ddp": ["parallel_mode"],
    "zero1": ["parallel_mode", "zero1"],
    "fsdp": ["parallel_mode", "fsdp"],
    "bf16": ["parallel_mode", ("amp_native", "bf16")],
    "checkpoint": ["parallel_mode", "checkpoint"],
}


def _decoder_layers(model):
    return list(model.model.layers)


def hand_written(name: str, size: Size):
    """The plain-PyTorch version of strategy ``name``, as a user would write it."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_llama(size)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if name == "checkpoint":
        layers = set(_decoder_layers(model))
        apply_activation_checkpointing(model, check_fn=lambda m: m in layers)
    if name == "fsdp":
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    elif distributed:
        model = DDP(model)
    if name == "zero1" and distributed:
        optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = hand_loader(Tokens(size), size.global_batch)
    return plain_step(model, optim, loader, torch.bfloat16 if name == "bf16" else None)


def run(names: list[str], size: Size, repeats: int, steps: int) -> list[dict]:
    """On every rank: time atorch against hand-written PyTorch for each strategy in ``names``."""
    rows = []
    for name in names:
        variants = {"atorch": atorch_step(build_llama(size), size, STRATEGIES[name]),
                    "pytorch": hand_written(name, size)}
        samples = harness.interleave(variants, repeats, steps)
        rows.append({"strategy": name, "atorch": harness.summary(samples["atorch"]),
                     "pytorch": harness.summary(samples["pytorch"]),
                     "ratio": harness.ratio(samples, "atorch", "pytorch"), "samples": samples})
    return rows


def report(rows: list[dict], size: Size, nproc: int, repeats: int, steps: int, out: str, plot: str | None) -> str:
    body = [[r["strategy"], harness.fmt_ms(r["atorch"]["median"]),
             f"{harness.fmt_ms(r['atorch']['min'])}–{harness.fmt_ms(r['atorch']['max'])}",
             harness.fmt_ms(r["pytorch"]["median"]),
             f"{harness.fmt_ms(r['pytorch']['min'])}–{harness.fmt_ms(r['pytorch']['max'])}", f"{r['ratio']:.3f}"]
            for r in rows]
    markdown = harness.table(["strategy", "atorch ms/step", "min–max", "plain PyTorch ms/step", "min–max",
                              "atorch / PyTorch"], body)
    harness.write(out, {"size": size.as_dict(), "nproc": nproc, "repeats": repeats, "steps_per_block": steps,
                        "rows": rows}, markdown)
    if plot:
        harness.ratio_plot(plot, [r["strategy"] for r in rows], {"atorch / plain PyTorch": [r["ratio"] for r in rows]},
                           f"atorch overhead, {nproc} gloo ranks, median of {repeats}", goal=1.02)
    return markdown


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "overhead", "strategies", STRATEGIES, repeats=7, steps=5,
                            tiny="a toy size that only shows the benchmark runs")
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.strategies, STRATEGIES, "strategies")
    size = TINY if args.tiny else MEDIUM
    from atorch.distributed.local import run_local

    job = functools.partial(run, names, size, args.repeats, args.steps)
    rows = run_local(job, args.nproc, timeout_s=3600)[0]
    markdown = report(rows, size, args.nproc, args.repeats, args.steps, args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
