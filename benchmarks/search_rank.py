"""Does the step-time estimate rank the candidates as the dry runs measured them? Estimates only.

    .venv/bin/python benchmarks/search_rank.py --nproc 4 --against benchmarks/results/search_quality.json

For each scenario of benchmarks/search_quality.py found in a results file of it (``--against``),
the search's space is estimated again with today's cost model at this machine's calibrated rates
(``measure`` with ``max_dryruns=0``: no dry run) and set against the exhaustive run's measured
throughputs stored there. Spearman's rank correlation of estimated with measured throughput over
the candidates both have, beside the same figure for the estimates the stored run made. A minute
or so a scenario on 4 ranks on 2 cores, against the 1-5 minutes of an exhaustive run.
"""

import functools
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.search_jobs import JOBS  # noqa: E402
from benchmarks.search_quality import SCENARIOS  # noqa: E402


def estimates(names: list[str]) -> dict:
    """{scenario: [(candidate strategy as JSON, estimated step seconds)]} (on every rank)."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import measure
    from atorch.auto.search.calibrate import calibrate
    from atorch.auto.search.space import candidate_space, layout_space
    from atorch.utils.log import quiet

    warnings.filterwarnings("ignore", category=FutureWarning)
    calibrate()
    out = {}
    for name in names:
        spec = SCENARIOS[name]
        work, size = JOBS[spec.job], spec.size
        job = {"optim_args": {"lr": 1e-3}, "dataloader_args": {"batch_size": size.global_batch, "shuffle": True},
               "model_input_format": work.model_input_format}
        device_ctx = DeviceContext.detect()
        model = work.build(size)
        excluded = list(spec.excluded) or None
        layouts, _ = layout_space(model, device_ctx, size.global_batch, work.model_input_format, excluded, None)
        candidates = candidate_space(device_ctx, excluded, None, None, layouts, model=model,
                                     global_batch=size.global_batch)
        with quiet():
            report = measure(model, candidates, torch.optim.AdamW, work.dataset(size), work.loss_func, max_dryruns=0,
                             **job)
        out[name] = [(_key(c.strategy), c.estimated_step_seconds) for c in report.candidates if c.estimated_step_seconds]
    return out


def _key(strategy: dict) -> str:
    return json.dumps(strategy, sort_keys=True)


def _matched(stored: list[dict], now: list) -> list[tuple[float, float]]:
    """(estimated again, measured) of each stored candidate with a throughput, matched by its
    strategy (``config``): a label alone can name two candidates of one space."""
    if not all("config" in c for c in stored):
        raise SystemExit("the results file has no candidate configs (search_quality.py before 2026-11-26): run "
                         "search_quality.py again to rank against it")
    estimates = dict(now)
    return [(estimates[_key(c["config"])], c["throughput"]) for c in stored
            if c.get("throughput") and _key(c["config"]) in estimates]


def _rho(pairs: list[tuple[float, float]]) -> str:
    """Spearman of estimated throughput (1 / step seconds) with measured throughput."""
    return f"{harness.spearman([1 / e for e, _ in pairs], [m for _, m in pairs]):.2f}" if len(pairs) > 1 else "-"


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "search_rank", "scenarios", SCENARIOS, repeats=0, steps=0,
                            tiny="(unused)")
    parser.set_defaults(nproc=4)
    parser.add_argument("--against", required=True, help="a results JSON of benchmarks/search_quality.py")
    args = parser.parse_args(argv)
    stored = json.loads(Path(args.against).read_text())["scenarios"]
    names = [n for n in harness.choices(parser, args.scenarios, SCENARIOS, "scenarios") if n in stored]
    from atorch.distributed.local import run_local

    now = run_local(functools.partial(estimates, names), args.nproc, timeout_s=3600)[0]
    body = []
    for name in names:
        measured = [c for c in stored[name]["exhaustive"] if c.get("throughput")]
        then = [(c["estimated_step_seconds"], c["throughput"]) for c in measured if c.get("estimated_step_seconds")]
        again = _matched(stored[name]["exhaustive"], now[name])
        body.append([name, len(again), _rho(then), _rho(again)])
    markdown = harness.table(["scenario", "candidates", "Spearman, the stored run's estimates",
                              "Spearman, estimated again"], body)
    harness.write(args.out, {"against": args.against, "estimates": now}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
