"""AtorchTrainer's overhead: its step time against the plain transformers Trainer, same strategy.

    .venv/bin/python benchmarks/integrations_overhead.py --nproc 2 --repeats 7 --steps 10

Both trainers fine-tune the same GPT-2 (built from a config, same weights, same data and seed) in
the same 2 gloo processes. The plain Trainer gets the strategy the way its own arguments build it:
DDP (``ddp_find_unused_parameters=False``, as atorch's DDP) and ``bf16=True`` (autocast, as
``amp_native``); AtorchTrainer gets ``parallel_mode`` and ``("amp_native", "bf16")``. Each
repetition calls ``train()`` on each trainer in turn (A B, then B A, ...) for ``--steps`` + 1
optimizer steps and times the last ``--steps`` of them from inside the loop (a callback at each
step's end, slowest rank), so the Trainer's setup and teardown are left out and its loop, the
data loading, clipping, the LR schedule and logging are in. The figure of merit is the ratio of
median step times, AtorchTrainer / Trainer (goal: at or under 1.02).

FSDP is left out: on a CPU-only machine Accelerate (which the plain Trainer prepares its model
with) builds DDP whatever its FSDP plugin says, so there is no plain-Trainer FSDP to compare with.
"""

import functools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

# name -> (atorch strategy, plain TrainingArguments that build the same by hand)
STRATEGIES = {
    "ddp": (["parallel_mode"], {}),
    "bf16": (["parallel_mode", ("amp_native", "bf16")], {"bf16": True}),
}
SIZE = {"vocab": 1024, "seq": 128, "embd": 128, "layers": 4, "heads": 4, "per_device": 4}
TINY = {"vocab": 64, "seq": 16, "embd": 32, "layers": 2, "heads": 2, "per_device": 2}


class Tokens(torch.utils.data.Dataset):
    """Sequences counting up by a per-sample stride (mod vocab)."""

    def __init__(self, vocab: int, seq: int, n: int):
        gen = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, vocab, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _gpt2(size: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=size["vocab"], n_positions=size["seq"], n_embd=size["embd"],
                                      n_layer=size["layers"], n_head=size["heads"]))


def _clock():
    """A callback timing the steps after the first, slowest rank; ``seconds_per_step()`` reads it."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.end, self.steps = None, None, 0

        def on_step_end(self, args, state, control, **kwargs):
            if self.start is None:
                dist.barrier()
                self.start = time.perf_counter()
            else:
                self.end, self.steps = time.perf_counter(), self.steps + 1

        def seconds_per_step(self) -> float:
            seconds = torch.tensor([(self.end - self.start) / self.steps], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            return float(seconds)

    return Clock()


def _trainer(atorch: bool, name: str, size: dict, steps: int, output_dir: str):
    from transformers import Trainer, TrainingArguments

    strategy, by_hand = STRATEGIES[name]
    args = TrainingArguments(
        output_dir, per_device_train_batch_size=size["per_device"], max_steps=steps + 1, learning_rate=1e-3,
        weight_decay=0.01, warmup_steps=2, max_grad_norm=1.0, logging_steps=5, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_drop_last=True,
        ddp_find_unused_parameters=False, **({} if atorch else by_hand))
    clock = _clock()
    kwargs = dict(model=_gpt2(size), args=args, train_dataset=Tokens(size["vocab"], size["seq"], 1024),
                  callbacks=[clock])
    if atorch:
        from atorch.integrations.transformers import AtorchTrainer

        return AtorchTrainer(strategy=strategy, **kwargs), clock
    return Trainer(**kwargs), clock


def run(names: list[str], size: dict, repeats: int, steps: int) -> list[dict]:
    """On every rank: AtorchTrainer against the plain Trainer for each strategy in ``names``."""
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            variants = {"atorch": _trainer(True, name, size, steps, f"{tmp}/atorch"),
                        "trainer": _trainer(False, name, size, steps, f"{tmp}/plain")}
            for trainer, _ in variants.values():  # warm-up
                trainer.train()
            samples: dict[str, list[float]] = {key: [] for key in variants}
            order = list(variants)
            for rep in range(repeats):
                for key in order if rep % 2 == 0 else reversed(order):
                    trainer, clock = variants[key]
                    trainer.train()
                    samples[key].append(clock.seconds_per_step())
        rows.append({"strategy": name, "atorch": harness.summary(samples["atorch"]),
                     "trainer": harness.summary(samples["trainer"]),
                     "ratio": harness.ratio(samples, "atorch", "trainer"), "samples": samples})
    return rows


def report(rows: list[dict], size: dict, nproc: int, repeats: int, steps: int, out: str, plot: str | None) -> str:
    body = [[r["strategy"], harness.fmt_ms(r["atorch"]["median"]),
             f"{harness.fmt_ms(r['atorch']['min'])}–{harness.fmt_ms(r['atorch']['max'])}",
             harness.fmt_ms(r["trainer"]["median"]),
             f"{harness.fmt_ms(r['trainer']['min'])}–{harness.fmt_ms(r['trainer']['max'])}", f"{r['ratio']:.3f}"]
            for r in rows]
    markdown = harness.table(["strategy", "AtorchTrainer ms/step", "min–max", "Trainer ms/step", "min–max",
                              "AtorchTrainer / Trainer"], body)
    harness.write(out, {"size": size, "nproc": nproc, "repeats": repeats, "steps_per_block": steps, "rows": rows},
                  markdown)
    if plot:
        harness.ratio_plot(plot, [r["strategy"] for r in rows], {"AtorchTrainer / Trainer": [r["ratio"] for r in rows]},
                           f"AtorchTrainer overhead, {nproc} gloo ranks, median of {repeats}", goal=1.02)
    return markdown


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "integrations_overhead", "strategies", STRATEGIES, repeats=7, steps=10,
                            tiny="a toy size that only shows the benchmark runs")
    parser.set_defaults(plot="")  # a table in docs/integrations.md, no figure
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.strategies, STRATEGIES, "strategies")
    size = TINY if args.tiny else SIZE
    from atorch.distributed.local import run_local

    job = functools.partial(run, names, size, args.repeats, args.steps)
    rows = run_local(job, args.nproc, timeout_s=1800)[0]
    markdown = report(rows, size, args.nproc, args.repeats, args.steps, args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
