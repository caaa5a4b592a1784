"""Megatron-LM's published H100 layouts, costed by ``atorch plan --search`` (h100_80gb, estimated):
what the cost model makes of tensor x pipeline x data layouts that the fastest code of the field
measured.

    .venv/bin/python benchmarks/published_layouts.py          # about 8 minutes on a 2-core CPU
    .venv/bin/python benchmarks/published_layouts.py --tiny   # the 70B run (tensor 8 x pipeline 2)

The runs are Megatron-LM's weak-scaling table (benchmarks/published_tables.MEGATRON_H100): GPT
models of 1.7B-462B on 48-6144 H100s, each on its own layout, teraFLOP/s a GPU as published. Each
model is built as a Llama of the same parameters and FLOPs (an untied head, a gated MLP 8/3 x the
hidden size, to a multiple of 64) and the plan searches its GPUs at its global batch. Beside the
published figure:

- **the published layout as atorch would run it**: the fastest candidate that fits with the same
  tensor, pipeline and data sizes (any of atorch's methods, microbatches and virtual stages);
- **where that step goes**: the seconds each term adds to the estimate (matmuls, element-wise
  traffic, kernel launches, the pipeline's bubble, tensor collectives, pipeline sends, the
  data-parallel sync that is not hidden), each the step less the step without it;
- **atorch's pick** on the same GPUs, and its estimate.

TeraFLOP/s count model FLOPs as Megatron does: 6 x (the parameters less the input embedding) + 12
x layers x hidden x sequence a token (attention, the causal mask's half not taken off), no
recomputation. Megatron overlaps its data-parallel, tensor and pipeline communication, fuses the
element-wise operators, keeps bf16 weights beside fp32 master copies and runs sequence parallelism;
atorch's runtime does some of that and not the rest, and the estimate is of atorch's runtime. So
the ratio is not a calibration: it says how far atorch's own runtime at that layout stands from
the best published one, and the terms say where. Writes benchmarks/results/published_layouts.
"""

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.published_tables import MEGATRON_H100  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TERMS = ("matmuls", "element-wise", "kernels", "bubble", "tensor comm", "pipeline comm", "data sync")


def gpt_as_llama(hidden: int, layers: int, heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=MEGATRON_H100["vocab"], hidden_size=hidden,
                         intermediate_size=64 * round(8 * hidden / 3 / 64), num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=MEGATRON_H100["seq"], tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def model_flops_per_token(model, hidden: int, layers: int) -> float:
    """Megatron's convention: 6 x the parameters that do matmuls (all but the input embedding) +
    attention's 12 x layers x hidden x sequence."""
    params = sum(p.numel() for p in model.parameters())
    return 6 * (params - MEGATRON_H100["vocab"] * hidden) + 12 * layers * hidden * MEGATRON_H100["seq"]


@contextlib.contextmanager
def kept_steps():
    """The estimate (a StepCost) of every candidate the plan costs, by (strategy, accumulation)."""
    from atorch.auto.search import estimate

    kept: dict = {}
    original = estimate.cost_candidate

    def keep(model, strategy, dims, *args, **kwargs):
        step, reason = original(model, strategy, dims, *args, **kwargs)
        kept[(repr(strategy), kwargs.get("accumulation", 1))] = step
        return step, reason

    estimate.cost_candidate = keep
    try:
        yield kept
    finally:
        estimate.cost_candidate = original


def terms(step, profile) -> dict:
    """Seconds each term adds to ``step``'s estimate on ``profile``: the step less the step without
    it (so a term another one hides adds only what shows)."""
    def seconds(changes: dict | None = None, profile_changes: dict | None = None) -> float:
        copy = dataclasses.replace(step, **(changes or {}))
        copy.profile = dataclasses.replace(profile, **(profile_changes or {}))
        return copy.seconds()

    total = seconds()
    comms = lambda dim: {"comms": [c for c in step.comms if c.dim != dim]}  # noqa: E731
    out = {
        "element-wise": total - seconds(profile_changes={"memory_bandwidth": 0.0}),
        "kernels": total - seconds(profile_changes={"kernel_seconds": 0.0}),
        "bubble": total - seconds({"bubble": 0.0}),
        "tensor comm": total - seconds(comms("tensor")),
        "pipeline comm": total - seconds(comms("pipeline")),
        "data sync": total - seconds({"data_sync": {}}),
    }
    out["matmuls"] = total - sum(out.values())  # the rest: matmuls, attention, the optimizer's step
    return {"step": total, **{name: out[name] for name in TERMS}}


def costed(run: tuple) -> dict:
    """``run`` planned on its GPUs: its published layout's fastest fitting candidate, with terms,
    and the plan's pick."""
    from atorch.auto.search.profiles import load_profile
    from atorch.cli.plan_search import plan_search
    from atorch.utils.log import quiet

    name, heads, hidden, layers, tensor, pipeline, data, gpus, batch, published = run
    model = gpt_as_llama(hidden, layers, heads)
    profile = load_profile("h100_80gb")
    with quiet(), kept_steps() as steps:
        result = plan_search(model, gpus, batch, MEGATRON_H100["seq"], profile, 2.0, ["fp8", "module_replace"])
    fitting = sorted((r for r in result["rows"] if r.get("fits")), key=lambda r: r["seconds"])
    same = [r for r in fitting if (r["dims"]["tensor"], r["dims"]["pipeline"], r["dims"]["data"])
            == (tensor, pipeline, data)]
    flops = batch * MEGATRON_H100["seq"] * model_flops_per_token(model, hidden, layers)
    teraflops = lambda r: flops / r["seconds"] / gpus / 1e12  # noqa: E731
    out = {"model": name, "gpus": gpus, "global_batch": batch, "published_layout":
           f"tensor={tensor} x pipeline={pipeline} x data={data}", "published_tflops": published,
           "layout": None, "layout_tflops": None, "ratio": None, "terms": None,
           "pick": None, "pick_tflops": None}
    if same:
        best = same[0]
        step = steps[(repr(best["strategy"]), best["dims"]["accumulation"])]
        out.update(layout=f"{best['layout']}; {' + '.join(best['names'])}", layout_tflops=teraflops(best),
                   ratio=teraflops(best) / published, terms=terms(step, profile))
    if fitting:
        out.update(pick=f"{fitting[0]['layout']}; {' + '.join(fitting[0]['names'])}",
                   pick_tflops=teraflops(fitting[0]))
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the 70B run only (tensor 8 x pipeline 2)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "published_layouts"))
    args = parser.parse_args(argv)
    runs = [r for r in MEGATRON_H100["runs"] if not args.tiny or r[0] == "70B"]
    rows = [costed(run) for run in runs]
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    layouts = harness.table(
        ["run", "GPUs", "published layout", "published TFLOP/s", "atorch at that layout (fastest that fits)",
         "estimated TFLOP/s", "estimated / published", "atorch's pick", "pick's TFLOP/s"],
        [[r["model"], r["gpus"], r["published_layout"], r["published_tflops"], r["layout"] or "nothing fits",
          fmt(r["layout_tflops"]), "-" if r["ratio"] is None else f"{r['ratio']:.2f}", r["pick"] or "nothing fits",
          fmt(r["pick_tflops"])] for r in rows])
    where = harness.table(
        ["run", "published layout", "step s", *(f"{t} s" for t in TERMS)],
        [[r["model"], r["published_layout"], f"{r['terms']['step']:.2f}", *(f"{r['terms'][t]:.2f}" for t in TERMS)]
         for r in rows if r["terms"]])
    markdown = (f"Megatron-LM's H100 runs ({MEGATRON_H100['source']}) beside `atorch plan --search` (h100_80gb, "
                f"**estimated**), teraFLOP/s a GPU in Megatron's convention.\n\n{layouts}\n\n"
                f"Where the estimate of each published layout goes (seconds a step each term adds):\n\n{where}\n")
    harness.write(args.out, {"profile": "h100_80gb", "source": MEGATRON_H100["source"], "rows": rows}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
