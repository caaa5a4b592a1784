"""torch.compile of a pipeline: its stage modules (what native_dynamo compiles) against the whole
PipelineModel (what it compiled before: dynamo traced the schedule around the stages too).

    python benchmarks/pipeline_compile.py --sizes tiny,medium

A Llama of benchmarks/workload.py through auto_accelerate with pipeline_parallel (2 stages, 4
microbatches, 1F1B, 2 gloo ranks) and native_dynamo (inductor). Each way compiles in a process of
its own with an empty inductor cache (a compile already cached would look free), beside the eager
pipeline in the same process: its warm-up (2 steps, the compile) and its median step over eager's,
the two timed in alternated blocks.
"""

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.workload import MEDIUM, TINY, atorch_step, build_llama  # noqa: E402

SIZES = {"tiny": TINY, "medium": MEDIUM}
PIPELINE = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_microbatches": 4})]
COMPILE = ("native_dynamo", {"backend": "inductor"})


def run(size_name: str, way: str, repeats: int, steps: int) -> dict:
    """On every rank: eager and one compiled way, built and warmed, then timed side by side."""
    import atorch.methods.native_dynamo as native_dynamo

    if way == "whole":  # the way before: the PipelineModel itself
        native_dynamo.compiled_parts = lambda model: [model]
    size, variants, warm = SIZES[size_name], {}, {}
    for name, strategy in (("eager", PIPELINE), (way, [*PIPELINE, COMPILE])):
        variants[name] = atorch_step(build_llama(size), size, strategy)
        began = time.perf_counter()
        variants[name]()
        variants[name]()
        warm[name] = time.perf_counter() - began
    samples = harness.interleave(variants, repeats, steps)
    return {"size": size_name, "way": way, "warm_up_s": warm[way],
            "eager_ms": statistics.median(samples["eager"]) * 1e3,
            "compiled_ms": statistics.median(samples[way]) * 1e3, "over_eager": harness.ratio(samples, way, "eager")}


def _child(args) -> None:
    """One way in this process (``--child SIZE WAY``): its row as the last line of stdout."""
    import json

    from atorch.distributed.local import run_local

    size, way = args.child
    row = run_local(functools.partial(run, size, way, args.repeats, args.steps), 2, timeout_s=3600)[0]
    print(json.dumps(row))


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,medium")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(harness.RESULTS / "pipeline_compile"))
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return ""
    import json

    rows = []
    for size in [s for s in args.sizes.split(",") if s]:
        for way in ("whole", "stages"):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
            done = subprocess.run([sys.executable, __file__, "--child", size, way, "--repeats", str(args.repeats),
                                   "--steps", str(args.steps)], env=env, check=True, capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    body = [[r["size"], {"whole": "the PipelineModel (before)", "stages": "its stage modules"}[r["way"]],
             f"{r['warm_up_s']:.1f}", f"{r['eager_ms']:.1f}", f"{r['compiled_ms']:.1f}", f"{r['over_eager']:.3f}"]
            for r in rows]
    markdown = harness.table(["Llama", "compiled", "warm-up s (2 steps)", "eager ms", "compiled ms",
                              "compiled / eager"], body)
    harness.write(args.out, {"repeats": args.repeats, "steps_per_block": args.steps, "rows": rows}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
