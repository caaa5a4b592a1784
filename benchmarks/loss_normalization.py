"""What exact loss normalization costs: a step weighted by its label tokens against the old per-part mean.

    .venv/bin/python benchmarks/loss_normalization.py --nproc 2 --repeats 9 --steps 5

Two copies of the same job (a 4-layer Llama built from a config, right-padded batches whose
label tokens run from 2 to the whole sequence) train side by side in the same gloo processes.
"exact" is atorch's loop as it ships: each part's loss weighted by its count, one all-reduce of
``[count, sum, samples]`` a step (before the backward; with accumulation after the last one, then
the gradients are scaled once). "per-part mean" is the loop as it was before issue 51: the loss
divided by the accumulation steps, no count, no all-reduce (the same result with the weighting
state removed). Blocks of ``--steps`` steps alternate (A B, then B A), slowest rank, median over
``--repeats``; the figure is the ratio exact / per-part mean (goal: within the noise, ~1.02).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

SPLITS = {
    "ddp": ({}, 1),
    "ddp x accumulation 2": ({}, 2),
    "zero1": ({"zero1": True}, 1),
}
MEDIUM = {"vocab": 1024, "hidden": 128, "layers": 4, "seq": 128, "batch": 16}
TINY = {"vocab": 64, "hidden": 32, "layers": 2, "seq": 16, "batch": 4}


class Padded(torch.utils.data.Dataset):
    """Right-padded token sequences, labels -100 on the padding."""

    def __init__(self, vocab: int, seq: int, n: int):
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(1, vocab, (n, seq), generator=gen)
        lengths = torch.randint(2, seq + 1, (n,), generator=gen)
        self.mask = (torch.arange(seq) < lengths[:, None]).long()

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = self.tokens[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.tokens[i], "attention_mask": self.mask[i], "labels": labels}


def _llama(size: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                                        intermediate_size=4 * size["hidden"], num_hidden_layers=size["layers"],
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))


def _stepper(size: dict, split: str, exact: bool):
    """One optimizer step of the job per call (``accumulation`` loader batches)."""
    from atorch.auto import auto_accelerate

    extra, accumulation = SPLITS[split]
    strategy = ["parallel_mode", *(["zero1"] if extra.get("zero1") else [])]
    _, result, _ = auto_accelerate(
        _llama(size), torch.optim.AdamW, Padded(size["vocab"], size["seq"], 4096), lambda batch, out: out.loss,
        optim_args={"lr": 1e-4}, dataloader_args={"batch_size": size["batch"] // accumulation},
        model_input_format="unpack_dict", load_strategy=strategy, gradient_accumulation_steps=accumulation)
    if not exact:
        result.loss_tokens = None  # the loop as it was: loss / accumulation, nothing counted
    batches = iter(result.dataloader)

    def step():
        for _ in range(accumulation):
            batch = result.prepare_input(next(batches), torch.device("cpu"))
            result.backward(result.loss_func(batch, result.model(**batch)))
            result.step()

    return step


def job(size: dict, splits: list[str], repeats: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for split in splits:
        steppers = {"exact": _stepper(size, split, True), "per-part mean": _stepper(size, split, False)}
        samples = harness.interleave(steppers, repeats, steps)
        rows.append({"split": split, "exact": harness.summary(samples["exact"]),
                     "per_part_mean": harness.summary(samples["per-part mean"]),
                     "ratio": harness.ratio(samples, "exact", "per-part mean")})
    return rows


def main(argv=None) -> str:
    p = harness.parser(__doc__, "loss_normalization", "splits", SPLITS, repeats=9, steps=5,
                       tiny="a toy size that only shows the benchmark runs")
    args = p.parse_args(argv)
    splits = harness.choices(p, args.splits, SPLITS, "split")
    size = TINY if args.tiny else MEDIUM
    from atorch.distributed.local import run_local

    rows = run_local(job, args.nproc, (size, splits, args.repeats, args.steps), timeout_s=3600)[0]
    table = harness.table(
        ["split", "exact (ms/step)", "per-part mean (ms/step)", "exact / per-part mean"],
        [[r["split"], harness.fmt_ms(r["exact"]["median"]), harness.fmt_ms(r["per_part_mean"]["median"]),
          f"{r['ratio']:.3f}"] for r in rows])
    markdown = (f"Loss normalization's cost on {args.nproc} gloo ranks, {size} (medians of {args.repeats} "
                f"blocks of {args.steps} steps, side by side):\n\n{table}")
    return str(harness.write(args.out, {"size": size, "rows": rows}, markdown).read_text())


if __name__ == "__main__":
    print(main())
