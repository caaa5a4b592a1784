"""``atorch plan --search`` for mixture-of-experts models beside published, measured H100 runs
(estimated): the pick of each case, and the published run's own layout as atorch would run it.

    .venv/bin/python benchmarks/plan_moe.py

Runs (BF16, sequence 4096, H100 80GB):

- Mixtral 8x7B on 64 GPUs, global batch 256: Megatron-Core v0.9 reports 468 TFLOP/s a GPU
  (docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html, "Megatron Core
  MoE"). Its layout is not given beside the figure, so only the pick is set beside it (the
  search weighs pipeline x expert layouts too since 2026-11-28; the pick stayed data=64).
- Qwen3-30B-A3B (Qwen3 MoE 30B) on 8 GPUs, global batch 512: NeMo AutoModel's performance
  summary (docs.nvidia.com/nemo/automodel, "Pre-Training Performance", DGX-H100 BF16) reports
  12,040 tokens/s a GPU, 277 model TFLOP/s, with EP 8 x FSDP 8, micro-batch 4, 16 accumulation
  steps, TE and DeepEP kernels. The same layout as atorch runs it (amp_native + expert_parallel
  + fsdp + 16 micro-batches, no checkpointing) is costed too, fitting or not.

Writes benchmarks/results/plan_moe.{json,md}; the configs are docs/plans/mixtral8x7b.json and
docs/plans/qwen3_30b_a3b.json (the published models' shapes).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEQ = 4096
GIB = 2**30
# (config, GPUs, global batch, published tokens/s/GPU or None, published TFLOP/s/GPU, source, layout)
CASES = [
    ("mixtral8x7b", 64, 256, None, 468, "Megatron-Core v0.9 (MoE guide)", None),
    ("qwen3_30b_a3b", 8, 512, 12040, 277, "NeMo AutoModel (DGX-H100 BF16 pre-training)",
     {"data": 8, "accumulation": 16, "methods": ["amp_native", "expert_parallel", "fsdp", "gradient_accumulation x16"]}),
]


def plan(config: str, world: int, batch: int) -> dict:
    import argparse as _argparse

    import torch

    from atorch.auto.search.profiles import load_profile
    from atorch.cli import plan_report
    from atorch.cli.common import build_model
    from atorch.cli.plan_search import plan_search

    model = build_model(_argparse.Namespace(hf_config=str(ROOT / "docs" / "plans" / f"{config}.json"), model=None),
                        torch.float32)
    result = plan_search(model, world, batch, SEQ, load_profile("h100_80gb"), 2.0, ["fp8", "module_replace"])
    return {"records": plan_report.records(result, world), "flops_per_token": result["flops_per_token"]}


def _matches(record: dict, layout: dict) -> bool:
    dims = record["layout"]
    return (dims.get("data") == layout["data"] and dims.get("accumulation", 1) == layout["accumulation"]
            and record["methods"] == layout["methods"] and record["memory_bytes"] is not None)


def _cells(record: dict, flops_per_token: float) -> list:
    tokens = record["tokens_per_second_per_device"]
    memory = record["memory_bytes"]["total"] / GIB
    return [f"{record['layout_text']}; {' + '.join(record['methods'])}", f"{memory:.1f}" + ("" if record["fits"]
            else " (over)"), f"{tokens:,.0f}", f"{tokens * flops_per_token / 1e12:.0f}"]


def rows(case: tuple, planned: dict) -> list[list]:
    config, world, batch, tokens, tflops, source, layout = case
    per_token = planned["flops_per_token"]
    published = [f"{tokens:,}" if tokens else "-", str(tflops)]
    out = []
    best = next((r for r in planned["records"] if r["fits"]), None)
    if best is not None:
        cells = _cells(best, per_token)
        ratio = (best["tokens_per_second_per_device"] / tokens if tokens else float(cells[3]) / tflops)
        out.append([config, world, batch, "atorch's pick", *cells, *published, f"{ratio:.2f}", source])
    if layout is not None:
        same = next((r for r in planned["records"] if _matches(r, layout)), None)
        if same is not None:
            cells = _cells(same, per_token)
            out.append([config, world, batch, "the published layout", *cells, *published,
                        f"{same['tokens_per_second_per_device'] / tokens:.2f}", source])
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_moe"))
    parser.add_argument("--only", choices=[case[0] for case in CASES], help="one case (the test runs qwen3_30b_a3b)")
    args = parser.parse_args(argv)
    cases = [case for case in CASES if args.only in (None, case[0])]
    planned = {case[0]: plan(case[0], case[1], case[2]) for case in cases}
    body = [row for case in cases for row in rows(case, planned[case[0]])]
    table = harness.table(["model", "GPUs", "global batch", "what", "layout; methods", "GiB/rank (estimated)",
                           "tokens/s/GPU (estimated)", "TFLOP/s/GPU (estimated, atorch's count)",
                           "published tokens/s/GPU", "published TFLOP/s/GPU", "estimated / published", "source"],
                          body)
    counts = {name: f"{p['flops_per_token'] / 1e9:.1f} GFLOP/token" for name, p in planned.items()}
    markdown = ("Estimated on the h100_80gb profile (nothing measured), sequence 4096, BF16. The ratio is of "
                "tokens/s where the source gives them, else of TFLOP/s (atorch counts 3 x the forward's FLOPs "
                f"a token: {counts}; the sources' counts may differ).\n\n" + table)
    harness.write(args.out, {"cases": [list(case) for case in cases], "rows": body}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
