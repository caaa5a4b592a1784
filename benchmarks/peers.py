"""atorch against what users would otherwise run: Hugging Face Accelerate and DeepSpeed.

    .venv/bin/python benchmarks/peers.py --nproc 2 --repeats 9 --steps 5

The same Llama (workload.MEDIUM, a step of 250-390 ms in fp32), data and global batch, strategy for
strategy, in the same 2 gloo processes, timed in interleaved blocks (each repetition alternates
which side runs first):
- DDP and bf16 autocast: atorch vs Accelerate (``Accelerator(cpu=True)``, its documented loop);
- ZeRO-1, ZeRO-2, and FSDP vs ZeRO-3: atorch (PyTorch-native back-ends) vs ``deepspeed.initialize``.
Accelerate's FSDP plugin is not compared: on a CPU-only machine Accelerate prepares DDP whatever
the plugin says. The figure of merit is atorch / peer, median step times (goal: <= 1.0).
"""

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.workload import MEDIUM, TINY, Size, Tokens, atorch_step, batches, build_llama  # noqa: E402

# strategy -> (atorch strategy, peer, peer option)
ROWS = {
    "ddp": (["parallel_mode"], "accelerate", None),
    "bf16": (["parallel_mode", ("amp_native", "bf16")], "accelerate", "bf16"),
    "zero1": (["parallel_mode", "zero1"], "deepspeed", 1),
    "zero2": (["parallel_mode", "zero2"], "deepspeed", 2),
    "fsdp": (["parallel_mode", "fsdp"], "deepspeed", 3),
}


def accelerate_step(size: Size, mixed_precision: str | None):
    """Accelerate's documented loop: prepare(model, optimizer, dataloader), accelerator.backward."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one Accelerator per row; its state is process-wide
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision or "no")
    model = build_llama(size)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world = accelerator.num_processes
    loader = torch.utils.data.DataLoader(Tokens(size), batch_size=size.global_batch // world, shuffle=True)
    model, optim, loader = accelerator.prepare(model, optim, loader)
    it = batches(loader)

    def step():
        loss = model(**next(it)).loss
        accelerator.backward(loss)
        optim.step()
        optim.zero_grad()

    return step


def deepspeed_step(size: Size, stage: int):
    """DeepSpeed's documented loop: engine(batch), engine.backward(loss), engine.step()."""
    import deepspeed
    import torch.distributed as dist

    from benchmarks.workload import hand_loader

    model = build_llama(size)
    world = dist.get_world_size() if dist.is_initialized() else 1
    config = {"train_micro_batch_size_per_gpu": size.global_batch // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=config, dist_init_required=False)
    it = batches(hand_loader(Tokens(size), size.global_batch))

    def step():
        loss = engine(**next(it)).loss
        engine.backward(loss)
        engine.step()

    return step


def run(names: list[str], size: Size, repeats: int, steps: int) -> list[dict]:
    """On every rank: time atorch against its peer for each row in ``names``."""
    from atorch.utils.log import quiet

    rows = []
    for name in names:
        strategy, peer, option = ROWS[name]
        with quiet():
            peer_step = accelerate_step(size, option) if peer == "accelerate" else deepspeed_step(size, option)
            variants = {"atorch": atorch_step(build_llama(size), size, strategy), peer: peer_step}
        samples = harness.interleave(variants, repeats, steps)
        rows.append({"strategy": name, "peer": peer, "peer_config": option,
                     "atorch": harness.summary(samples["atorch"]), "peer_time": harness.summary(samples[peer]),
                     "ratio": harness.ratio(samples, "atorch", peer), "samples": samples})
    return rows


def report(rows, size: Size, nproc: int, repeats: int, steps: int, out: str, plot: str | None) -> str:
    def peer_label(r):
        return f"DeepSpeed ZeRO-{r['peer_config']}" if r["peer"] == "deepspeed" else "Accelerate"

    body = [[r["strategy"], peer_label(r), harness.fmt_ms(r["atorch"]["median"]),
             f"{harness.fmt_ms(r['atorch']['min'])}–{harness.fmt_ms(r['atorch']['max'])}",
             harness.fmt_ms(r["peer_time"]["median"]),
             f"{harness.fmt_ms(r['peer_time']['min'])}–{harness.fmt_ms(r['peer_time']['max'])}", f"{r['ratio']:.3f}"]
            for r in rows]
    markdown = harness.table(["strategy", "peer", "atorch ms/step", "min–max", "peer ms/step", "min–max",
                              "atorch / peer"], body)
    harness.write(out, {"size": size.as_dict(), "nproc": nproc, "repeats": repeats, "steps_per_block": steps,
                        "rows": rows}, markdown)
    if plot:
        labels = [f"{r['strategy']}\nvs {peer_label(r)}" for r in rows]
        harness.ratio_plot(plot, labels, {"atorch / peer": [r["ratio"] for r in rows]},
                           f"atorch vs peers, {nproc} gloo ranks, median of {repeats}", goal=1.0)
    return markdown


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "peers", "strategies", ROWS, repeats=7, steps=5,
                            tiny="a toy size that only shows the benchmark runs")
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.strategies, ROWS, "strategies")
    size = TINY if args.tiny else MEDIUM
    from atorch.distributed.local import run_local

    rows = run_local(functools.partial(run, names, size, args.repeats, args.steps), args.nproc, timeout_s=3600)[0]
    markdown = report(rows, size, args.nproc, args.repeats, args.steps, args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
