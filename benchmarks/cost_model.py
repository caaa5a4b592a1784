"""Cost model accuracy: estimated vs measured peak memory per rank, and step-time ranking.

    python benchmarks/cost_model.py --nproc 2 --out benchmarks/results/cost_model
    python benchmarks/cost_model.py --workloads small,deeper --timed-steps 10 --repeats 5 --out /tmp/toys

Spawns gloo processes on the CPU and, for each workload, estimates each strategy's peak (atorch's
cost model) and measures it (a dry run's training steps, the peak by the dry runs' tracker
``atorch.auto.search.peak``, maximum over ranks; the committed results predate that tracker and
were taken with torch's MemTracker, which it matches where both work):

- ``llama`` and ``llama-deep``: the Llama workloads of benchmarks/search_quality.py (hidden 128,
  4 blocks, seq 64; 8 blocks, seq 128), AdamW, over every candidate of the search's own space
  (checkpoint, amp, zero1/zero2/fsdp and their combinations; duplicates on this model run once);
- ``small`` and ``deeper``: tiny transformers (dim 32; 2 and 6 blocks) over a fixed list.

Writes JSON and a markdown table; the ratio estimated/measured is the figure of merit (goal:
within 10%). The step time the cost model estimates is meant to rank candidates, so its figure
is the Spearman rank correlation with the measured step time, per workload. With ``--repeats R``
every candidate is dry-run once per round, R rounds, and its measured step time is the median of
its rounds (the toys' steps of tens of ms rank differently from one run to the next otherwise).
"""

import argparse
import os
import statistics
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
LLAMAS = {"llama": {}, "llama-deep": {"layers": 8, "seq": 128}}  # benchmarks/search_quality.py's sizes
WORKLOADS = [*LLAMAS, *SIZES]


def measure_all(workload: str, timed_steps: int = 3, repeats: int = 1) -> list[dict]:
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import measure
    from atorch.auto.search.space import candidate_space
    from atorch.utils.log import quiet
    from benchmarks.workload import Size, Tokens, build_llama, loss_func
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    if workload in LLAMAS:
        size = Size(**LLAMAS[workload])
        candidates = candidate_space(DeviceContext.detect())
        model, data, loss, batch = build_llama(size), Tokens(size), loss_func, size.global_batch
    else:
        spec = SIZES[workload]
        candidates, batch = STRATEGIES, spec["batch"]
        model, data, loss = TinyTransformer(layers=spec["layers"]), TokenDataset(n=256), lm_loss
    rounds = []
    for _ in range(repeats):  # every candidate once per round: slow drift of the machine hits all alike
        with quiet():
            report = measure(model, candidates, torch.optim.AdamW, data, loss, optim_args={"lr": 1e-3},
                             dataloader_args={"batch_size": batch}, model_input_format="unpack_dict",
                             timed_steps=timed_steps, max_dryruns=len(candidates))
        rounds.append(report.candidates)
    rows = []
    for index, c in enumerate(rounds[0]):
        if c.status == "pruned" and not c.measured_peak_bytes:
            continue
        steps = sorted(batch / r[index].throughput for r in rounds if r[index].throughput)
        peaks = [r[index].measured_peak_bytes for r in rounds if r[index].measured_peak_bytes]
        rows.append({"size": workload, "strategy": " + ".join(c.names) or "(plain)", "estimated": c.estimated_peak_bytes,
                     "measured": max(peaks) if peaks else None, "estimated_step_s": c.estimated_step_seconds,
                     "measured_step_s": statistics.median(steps) if steps else None, "measured_steps_s": steps,
                     "status": c.status, "reason": c.reason})
    return rows


def run(nproc: int, workloads: list[str], timed_steps: int = 3, repeats: int = 1) -> list[dict]:
    from atorch.distributed.local import run_local

    rows = []
    for workload in workloads:
        args = (workload, timed_steps, repeats)
        rows += run_local(measure_all, nproc, args, timeout_s=1800)[0] if nproc > 1 else measure_all(*args)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/cost_model")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument("--timed-steps", type=int, default=3,
                        help="timed steps per candidate: the toys' steps (tens of ms) need more for a stable order")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over every candidate; the measured step time is the median of its rounds")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workloads = args.workloads.split(",")
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {WORKLOADS}")
    rows = run(args.nproc, workloads, args.timed_steps, args.repeats)
    from benchmarks.harness import spearman, write

    correlation, spans = {}, {}
    for size in workloads:
        timed = [r for r in rows if r["size"] == size and r["estimated_step_s"] and r["measured_step_s"]]
        correlation[size] = spearman([r["estimated_step_s"] for r in timed], [r["measured_step_s"] for r in timed])
        ratios = [r["estimated"] / r["measured"] for r in rows if r["size"] == size and r["estimated"] and r["measured"]]
        spans[size] = {"low": min(ratios), "high": max(ratios), "within_10pct": sum(0.9 <= x <= 1.1 for x in ratios),
                       "count": len(ratios)} if ratios else None
    lines = [f"| model | strategy ({args.nproc} ranks) | estimated | measured | est/meas | est. step ms | measured step ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['estimated'] / r['measured']:.2f}" if r["estimated"] and r["measured"] else "-"
        kib = lambda v: f"{v / 1024:.0f} KiB" if v else "-"  # noqa: E731
        ms = lambda v: f"{v * 1e3:.1f}" if v else "-"  # noqa: E731
        lines.append(f"| {r['size']} | {r['strategy']} | {kib(r['estimated'])} | {kib(r['measured'])} | {ratio} | "
                     f"{ms(r['estimated_step_s'])} | {ms(r['measured_step_s'])} |")
    lines.append("")
    for size in workloads:
        span = spans[size]
        memory = (f"est/meas {span['low']:.2f}-{span['high']:.2f}, {span['within_10pct']} of {span['count']} within 10%"
                  if span else "no candidate measured")
        lines.append(f"- {size}: {memory}; Spearman rank correlation of estimated vs measured step time "
                     f"{correlation[size]:.2f}")
    markdown = "\n".join(lines)
    write(args.out, {"rows": rows, "memory_ratio": spans, "step_time_spearman": correlation}, markdown)
    print(markdown)

if __name__ == "__main__":
    main()
