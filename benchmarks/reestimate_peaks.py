"""The peaks search_quality.py measured, against the current cost model's estimates of them.

    .venv/bin/python benchmarks/reestimate_peaks.py benchmarks/results/search_quality.json

A memory estimate is a function of the model, the candidate and the probe (one process, no
dry run), so a change to the cost model can be judged against the peaks a full run of
benchmarks/search_quality.py measured (40 minutes on 4 ranks), in a minute per scenario: for every
candidate of the results file that was measured, its estimate as recorded and as the cost model
now makes it, on the same fake 4-rank device as the run (``--nproc``). The candidates are found
again by their labels in the search's own space. Measured peaks are draws (see search_quality's
``BOUNDARY_READINGS``); the estimates are not.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.search_quality import SCENARIOS, _label  # noqa: E402
from benchmarks.workload import Tokens, build_llama, loss_func  # noqa: E402

BAND = (0.9, 1.1)


def _in_band(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    within = sum(BAND[0] <= r <= BAND[1] for r in ratios)
    return f"{min(ratios):.2f}-{max(ratios):.2f} ({within}/{len(ratios)} in {BAND[0]}-{BAND[1]})"


def reestimate(name: str, rows: list[dict], world: int) -> list[dict]:
    """Each measured candidate of ``rows`` (search_quality's exhaustive table) with its estimate now."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import plan_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.engine import cost_candidate, layout_dims
    from atorch.auto.search.space import candidate_space, layout_space
    from atorch.distributed.topology import data_parallel_size
    from atorch.utils.log import quiet

    spec = SCENARIOS[name]
    size, excluded = spec.size, list(spec.excluded) or None
    device_ctx = DeviceContext(world, world, torch.device("cpu"), None, 2**40)
    model, data = build_llama(size), Tokens(size)
    layouts, _ = layout_space(model, device_ctx, size.global_batch, "unpack_dict", excluded, None)
    by_label = {}
    for candidate in candidate_space(device_ctx, excluded, None, None, layouts):
        planned = plan_strategy(candidate, device_ctx)[0]
        by_label.setdefault(_label(planned.to_dict(), world), planned)
    # as the search probes: on the batch of the layout with the most data ranks, scaled
    probed_dp = max(data_parallel_size(layout_dims(s, world)) for s in by_label.values())
    state_factor = cost.optimizer_state_factor(torch.optim.AdamW, {"lr": 1e-3})
    memo: dict = {}

    def batch_of(dp: int):
        return torch.utils.data.default_collate([data[i] for i in range(size.global_batch // dp)])

    def probe(strategy, counts, dims):
        dp = data_parallel_size(dims)
        tokens, batch = cost.batch_tokens(batch_of(dp)), batch_of(max(probed_dp, dp))
        scale = tokens / cost.batch_tokens(batch)
        counted: list = []
        with quiet():
            saved = cost.activation_bytes(model, strategy, batch, "unpack_dict", loss_func, device_ctx, counted,
                                          memo=memo)
        counts.extend(cost.scaled_counts(counted, scale))
        return int(saved * scale), tokens

    out = []
    for row in rows:
        strategy = by_label.get(row["strategy"])
        if not row.get("measured_peak_bytes") or strategy is None:
            continue
        step, _ = cost_candidate(model, strategy, layout_dims(strategy, world), state_factor, probe)
        now = None if step is None else step.memory().total
        out.append({"strategy": row["strategy"], "measured_peak_bytes": row["measured_peak_bytes"],
                    "recorded_estimate": row.get("estimated_peak_bytes"), "estimate": now})
    return out


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a results file of benchmarks/search_quality.py (JSON)")
    parser.add_argument("--scenarios", default="", help="comma-separated (default: all in the file)")
    parser.add_argument("--out", default=str(harness.RESULTS / "reestimate_peaks"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    recorded = json.loads(Path(args.results).read_text())
    names = [n for n in (args.scenarios.split(",") if args.scenarios else recorded["scenarios"]) if n]
    unknown = sorted(set(names) - set(recorded["scenarios"]))
    if unknown:
        parser.error(f"scenarios {unknown} are not in {args.results}; it has {sorted(recorded['scenarios'])}")
    results, body = {}, []
    for name in names:
        rows = reestimate(name, recorded["scenarios"][name]["exhaustive"], recorded["nproc"])
        results[name] = rows
        before = [r["recorded_estimate"] / r["measured_peak_bytes"] for r in rows if r["recorded_estimate"]]
        now = [r["estimate"] / r["measured_peak_bytes"] for r in rows if r["estimate"]]
        outside = [f"{r['strategy']} {r['estimate'] / r['measured_peak_bytes']:.2f}" for r in rows
                   if r["estimate"] and not BAND[0] <= r["estimate"] / r["measured_peak_bytes"] <= BAND[1]]
        body.append([name, _in_band(before), _in_band(now), "; ".join(outside) or "-"])
    markdown = harness.table(["scenario", "estimated/measured as recorded", "now", "outside the band now"], body)
    harness.write(args.out, {"results_file": args.results, "scenarios": results}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
