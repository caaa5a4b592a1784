"""Cost model accuracy: estimated vs measured peak memory per rank, per strategy.

    python benchmarks/cost_model.py --nproc 2 --out benchmarks/results/cost_model

Spawns gloo processes on the CPU, builds small transformers of two sizes, and for each strategy
estimates the peak (atorch's cost model) and measures it (one training step under torch's
MemTracker, maximum over ranks). Writes JSON and a markdown table; the ratio estimated/measured
is the figure of merit (goal: within 10%).
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
                     model_input_format="unpack_dict", timed_steps=1)
    return [{"size": size, "strategy": " + ".join(c.names) or "(plain)", "estimated": c.estimated_peak_bytes,
             "measured": c.measured_peak_bytes, "status": c.status, "reason": c.reason} for c in report.candidates]


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
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [f"| model | strategy ({args.nproc} ranks) | estimated | measured | est/meas |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['estimated'] / r['measured']:.2f}" if r["estimated"] and r["measured"] else "-"
        kib = lambda v: f"{v / 1024:.0f} KiB" if v else "-"  # noqa: E731
        lines.append(f"| {r['size']} | {r['strategy']} | {kib(r['estimated'])} | {kib(r['measured'])} | {ratio} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
