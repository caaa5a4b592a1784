"""The variants a user tries to get closer to the hardware, against eager, on this machine.

    .venv/bin/python benchmarks/compiled_variants.py --nproc 1 --repeats 7 --steps 5

Each variant is the same job through auto_accelerate (a Llama, workload.MEDIUM, AdamW) with one
strategy: eager fp32 (torch's CPU default optimizer step, one parameter at a time), the fused
AdamW step (``fused_optimizer``), torch.compile with inductor's C++ backend (``native_dynamo``),
bf16 autocast (``amp_native``, avx512_bf16 / AMX where the CPU has them), and their combinations.
All live in the same processes at once and take turns in interleaved blocks of steps; the figure
of merit is the ratio of median step times, variant / eager (lower is faster). A compile's own
seconds are not in the steps (they are warm-up): the search charges them over the job's
``planned_steps`` (docs/search.md); the table lists each variant's warm-up.
"""

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.workload import MEDIUM, TINY, Size, atorch_step, build_llama  # noqa: E402

COMPILE = ("native_dynamo", {"backend": "inductor"})
VARIANTS = {
    "eager": [],
    "fused_optimizer": ["fused_optimizer"],
    "compile": [COMPILE],
    "compile+fused": [COMPILE, "fused_optimizer"],
    "bf16": [("amp_native", "bf16")],
    "bf16+fused": [("amp_native", "bf16"), "fused_optimizer"],
    "bf16+compile+fused": [("amp_native", "bf16"), COMPILE, "fused_optimizer"],
}


def _warmed(name: str, size: Size):
    """The variant's step function, built and stepped twice (a compile happens here); and those seconds."""
    step = atorch_step(build_llama(size), size, ["parallel_mode", *VARIANTS[name]])
    start = time.perf_counter()
    for _ in range(2):
        step()
    return step, time.perf_counter() - start


def run(names: list[str], size: Size, repeats: int, steps: int) -> dict:
    """On every rank: every variant built and warmed, then timed in interleaved blocks."""
    built = {name: _warmed(name, size) for name in names}
    samples = harness.interleave({name: step for name, (step, _) in built.items()}, repeats, steps, warmup=0)
    return {"warmup_seconds": {name: seconds for name, (_, seconds) in built.items()}, "samples": samples}


def report(result: dict, size: Size, nproc: int, repeats: int, steps: int, out: str, plot: str | None) -> str:
    samples = result["samples"]
    rows = []
    for name in samples:
        s = harness.summary(samples[name])
        rows.append([name, harness.fmt_ms(s["median"]), f"{harness.fmt_ms(s['min'])}–{harness.fmt_ms(s['max'])}",
                     f"{harness.ratio(samples, name, 'eager'):.3f}", f"{result['warmup_seconds'][name]:.1f}"])
    markdown = harness.table(["variant", "ms/step", "min–max", "/ eager", "warm-up s (2 steps)"], rows)
    harness.write(out, {"size": size.as_dict(), "nproc": nproc, "repeats": repeats, "steps_per_block": steps,
                        **result}, markdown)
    if plot:
        harness.ratio_plot(plot, list(samples), {"variant / eager": [harness.ratio(samples, n, "eager") for n in samples]},
                           f"compiled and fused variants, {nproc} CPU rank(s), median of {repeats}")
    return markdown


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "compiled_variants", "variants", VARIANTS, repeats=7, steps=5,
                            tiny="a toy size that only shows the benchmark runs")
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.variants, VARIANTS, "variants")
    if "eager" not in names:
        names.insert(0, "eager")
    size = TINY if args.tiny else MEDIUM
    from atorch.distributed.local import run_local

    result = run_local(functools.partial(run, names, size, args.repeats, args.steps), args.nproc, timeout_s=3600)[0]
    markdown = report(result, size, args.nproc, args.repeats, args.steps, args.out, args.plot or None)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
