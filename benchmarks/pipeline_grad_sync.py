"""The data ranks' gradient sum of a pipeline: started inside the schedule a bucket at a time
(atorch/pipeline/grad_sync.py) against one blocking all-reduce a parameter after the schedule
(what PipelineModel did before), timed side by side in the same processes.

    python benchmarks/pipeline_grad_sync.py --pipeline 2 --data 2 --widths 128,1024

A chain of Linear + Tanh blocks of each width, split over ``--pipeline`` stages (1F1B) and
replicated over ``--data`` ranks (gloo). At width 128 every gradient is under the bucket size
(1 MiB): each stage's are packed into one bucket, one collective where the old path made one a
parameter; at 1024 each weight (4 MiB) is summed alone, so the collectives are as many and only
when they start differs. Writes JSON and a markdown table to benchmarks/results/.
"""

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.pipeline_bubble import _loss, chain, sgd_step  # noqa: E402


def _step(width: int, layers: int, micro: int, m: int, pipeline: int, data: int, old: bool):
    from atorch.distributed.topology import Topology
    from atorch.pipeline import PipelineModel

    topology = Topology.build([("pipeline", pipeline), ("data", data)])
    model = PipelineModel(chain(width, layers), num_microbatches=m, auto_partition=True, loss_fn=_loss,
                          topology=topology)
    if old:  # the sum after the schedule, one blocking all-reduce a parameter
        model._sync_for_step = lambda: None
    return sgd_step(model, {"input": torch.randn(micro * m, width)})


def run(widths: list[int], layers: int, micro: int, m: int, pipeline: int, data: int, repeats: int,
        steps: int) -> list[dict]:
    """On every rank: per width, both paths side by side."""
    rows = []
    for width in widths:
        variants = {name: _step(width, layers, micro, m, pipeline, data, old=name == "after")
                    for name in ("after", "inside")}
        samples = harness.interleave(variants, repeats, steps)
        params = layers * 2  # a weight and a bias a block
        rows.append({"width": width, "tensors": params, **{name: harness.summary(samples[name]) for name in variants},
                     "inside_over_after": harness.ratio(samples, "inside", "after")})
    return rows


def report(rows: list[dict], args) -> str:
    body = [[r["width"], r["tensors"], harness.fmt_ms(r["after"]["median"]), harness.fmt_ms(r["inside"]["median"]),
             f"{r['inside_over_after']:.3f}"] for r in rows]
    load = args.load
    markdown = harness.load_note(load) + harness.table(["width", "parameter tensors", "after the schedule ms", "inside the schedule ms",
                                     "inside / after"], body)
    harness.write(args.out, {"pipeline": args.pipeline, "data": args.data, "layers": args.layers,
                             "microbatches": args.microbatches, "microbatch_size": args.micro,
                             "repeats": args.repeats, "steps_per_block": args.steps, "load_average": load,
                             "rows": rows}, markdown)
    return markdown


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", type=int, default=2)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--widths", default="128,1024", help="comma-separated block widths")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8, help="rows per microbatch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--tiny", action="store_true", help="toy sizes that only show the benchmark runs")
    parser.add_argument("--out", default=str(harness.RESULTS / "pipeline_grad_sync"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.widths, args.layers, args.microbatches, args.micro, args.repeats, args.steps = "8", 4, 2, 2, 1, 1
    widths = [int(w) for w in args.widths.split(",") if w]
    job = functools.partial(run, widths, args.layers, args.micro, args.microbatches, args.pipeline, args.data,
                            args.repeats, args.steps)
    rows, args.load = harness.run_loaded(job, args.pipeline * args.data)
    markdown = report(rows, args)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
