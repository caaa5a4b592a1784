"""Cost model accuracy: estimated vs measured peak memory per rank, and step-time ranking.

    python benchmarks/cost_model.py --nproc 2 --out benchmarks/results/cost_model

Spawns gloo processes on the CPU, builds small transformers of two sizes, and for each strategy
estimates the peak (atorch's cost model) and measures it (one training step under torch's
MemTracker, maximum over ranks). Writes JSON and a markdown table; the ratio estimated/measured
is the figure of merit (goal: within 10%). The step time the cost model estimates is only meant to
rank candidates, so its figure is the Spearman rank correlation with the measured step time.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = [
    [],
    [("amp_native", "bf16")],
    ["checkpoint"],
    ["zero1"],
    ["zero2"],
    ["fsdp"],
    [("amp_native", "bf16"), "fsdp", "checkpoint"],
]
SIZES = {"small": {"layers": 2, "batch": 8}, "deeper": {"layers": 6, "batch": 16}}


def measure_all(size: str) -> list[dict]:
    from atorch.auto.search import measure
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    spec = SIZES[size]
    report = measure(TinyTransformer(layers=spec["layers"]), STRATEGIES, torch.optim.AdamW, TokenDataset(n=256), lm_loss,
                     optim_args={"lr": 1e-3}, dataloader_args={"batch_size": spec["batch"]},
                     model_input_format="unpack_dict", timed_steps=3)
    batch = spec["batch"]
    return [{"size": size, "strategy": " + ".join(c.names) or "(plain)", "estimated": c.estimated_peak_bytes,
             "measured": c.measured_peak_bytes, "estimated_step_s": c.estimated_step_seconds,
             "measured_step_s": batch / c.throughput if c.throughput else None, "status": c.status,
             "reason": c.reason} for c in report.candidates]


def run(nproc: int) -> list[dict]:
    from tests.helpers.dist import run_distributed

    rows = []
    for size in SIZES:
        rows += run_distributed(measure_all, nproc, size)[0] if nproc > 1 else measure_all(size)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/cost_model")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run(args.nproc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.harness import spearman

    correlation = {}
    for size in SIZES:
        timed = [r for r in rows if r["size"] == size and r["estimated_step_s"] and r["measured_step_s"]]
        correlation[size] = spearman([r["estimated_step_s"] for r in timed], [r["measured_step_s"] for r in timed])
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "step_time_spearman": correlation}, indent=2) + "\n")
    lines = [f"| model | strategy ({args.nproc} ranks) | estimated | measured | est/meas | est. step ms | measured step ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['estimated'] / r['measured']:.2f}" if r["estimated"] and r["measured"] else "-"
        kib = lambda v: f"{v / 1024:.0f} KiB" if v else "-"  # noqa: E731
        ms = lambda v: f"{v * 1e3:.1f}" if v else "-"  # noqa: E731
        lines.append(f"| {r['size']} | {r['strategy']} | {kib(r['estimated'])} | {kib(r['measured'])} | {ratio} | "
                     f"{ms(r['estimated_step_s'])} | {ms(r['measured_step_s'])} |")
    lines.append("")
    lines += [f"Spearman rank correlation of estimated vs measured step time, {size}: {rho:.2f}"
              for size, rho in correlation.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
