"""Where one ZeRO step's time goes: atorch's zero2 against DeepSpeed ZeRO-2, under torch.profiler.

    flock /tmp/atorch-mp.lock .venv/bin/python benchmarks/profile_zero.py --nproc 2 --steps 3 --repeats 7

The same Llama, data and global batch as benchmarks/peers.py (wider by default, so a step takes
over 100 ms on a 2-core CPU), in the same 2 gloo processes. After warm-up each variant runs
``--steps`` steps under ``torch.profiler`` on every rank (variants alternate, so drift hits both).
Every profiled operator's *self* time on the main thread is put in one bucket:

- communication: c10d / gloo collectives (the name says which: all_gather, reduce_scatter, ...)
  and the main thread's waits on them (the time a rank blocks until its peer arrives shows here);
- copies: moving data into and out of flat buffers (copy_, cat, split/chunk copies, narrow, fill);
- optimizer: everything else under the optimizer step;
- compute: everything else under forward and backward;
- python: the step's wall time on the main thread not inside any profiled operator (Python,
  hooks, DTensor dispatch in Python, the framework's bookkeeping).

The profiler's own overhead inflates the small-op buckets of both sides alike; compare the
buckets side by side, not with peers.py's step times. The collective names also say which
transport ran: ``gloo:*`` events are ProcessGroupGloo's.
"""

import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.workload import MEDIUM, TINY, Size, atorch_step, build_llama  # noqa: E402

VARIANTS = {
    "atorch": ["parallel_mode", "zero2"],
    "atorch-per-block": ["parallel_mode", ("zero2", {"bucket_params": 0})],  # one FSDP unit per block (before)
    # The optimizer stepping over FSDP2's DTensors, as before atorch/sharding/local_step.py.
    "atorch-dtensor-step": ["parallel_mode", "zero2"],
    "deepspeed": 2,
}
PROFILE_SIZE = MEDIUM
BUCKETS = ("compute", "communication", "copies", "optimizer", "python")
COMM = ("c10d::", "gloo:", "all_gather", "allgather", "reduce_scatter", "reducescatter", "all_reduce", "allreduce",
        "broadcast", "record_param_comms", "wait", "barrier", "inference_all_reduce", "shm")
COPIES = ("aten::copy_", "aten::cat", "aten::_foreach_copy_", "aten::split_with_sizes_copy", "aten::narrow_copy",
          "aten::chunk_cat", "aten::_chunk_cat", "aten::fill_", "aten::zero_", "aten::zeros", "aten::clone",
          "aten::contiguous", "aten::flatten_dense_tensors", "aten::unflatten_dense_tensors", "aten::index_copy_")
STEP_SCOPE = ("Optimizer.step", "optimizer_step", "zero2.step", "engine.step")


def _bucket(event, in_step: bool) -> str:
    name = event.name
    lower = name.lower()
    if any(key in lower for key in COMM):
        return "communication"
    if any(name.startswith(key) for key in COPIES):
        return "copies"
    return "optimizer" if in_step else "compute"


def _comm_kind(name: str) -> str:
    lower = name.lower().replace("_", "")
    for kind in ("allgather", "reducescatter", "allreduce", "broadcast", "barrier"):
        if kind in lower:
            return kind
    return "wait/other"


def breakdown(prof, wall_s: float, steps: int) -> dict:
    """Seconds per step in each bucket, on the main thread, and which collectives ran."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    main = max({e.thread for e in events}, key=lambda t: sum(e.cpu_time_total for e in events
                                                            if e.thread == t and e.cpu_parent is None))
    totals = defaultdict(float)
    comm = defaultdict(float)
    transports = defaultdict(int)
    covered = 0.0

    def visit(event, in_step: bool, in_comm: bool) -> None:
        nonlocal covered
        in_step = in_step or any(event.name.startswith(s) for s in STEP_SCOPE)
        bucket = "communication" if in_comm else _bucket(event, in_step)
        self_us = event.cpu_time_total - sum(c.cpu_time_total for c in event.cpu_children)
        if not event.name.startswith("profile_zero."):  # our scopes are not operators
            totals[bucket] += self_us
            if bucket == "communication":
                comm[_comm_kind(event.name)] += self_us
        for child in event.cpu_children:
            visit(child, in_step, bucket == "communication")

    for event in events:
        if event.thread == main and event.cpu_parent is None:
            covered += event.cpu_time_total if not event.name.startswith("profile_zero.") else 0
            visit(event, False, False)
    for event in events:
        lower = event.name.lower()
        if lower.startswith("gloo:") or "shm" in lower or lower.startswith("nccl:") or lower.startswith("ccl"):
            transports[event.name.split(":")[0]] += 1
        if lower.startswith("deepspeed") or "inference_all_reduce" in lower:
            transports["deepspeed-op"] += 1
    op_s = {k: v / 1e6 for k, v in totals.items()}
    # The step scopes are not operators, so operator self time plus python equals the wall time.
    op_s["python"] = max(0.0, wall_s - sum(op_s.values()))
    per_step = {k: op_s.get(k, 0.0) / steps for k in BUCKETS}
    return {"wall_s": wall_s / steps, "buckets_s": per_step, "communication_s": {k: v / 1e6 / steps for k, v in comm.items()},
            "transport_events": dict(transports)}


def _deepspeed(size: Size):
    from benchmarks.peers import deepspeed_step

    return deepspeed_step(size, 2)


def _build(name: str, size: Size):
    if name == "deepspeed":
        return _deepspeed(size)
    if name == "atorch-dtensor-step":
        from unittest import mock

        with mock.patch("atorch.sharding.local_step.step_on_local_shards", lambda optim: False):
            return atorch_step(build_llama(size), size, VARIANTS[name])
    return atorch_step(build_llama(size), size, VARIANTS[name])


def run(size: Size, steps: int, warmup: int, names: list[str], repeats: int) -> dict:
    """On every rank: warm up, then profile ``steps`` steps of each variant; with ``repeats`` > 1,
    then time them unprofiled in interleaved blocks (harness.interleave, both orders)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from atorch.utils.log import quiet

    with quiet():
        fns = {name: _build(name, size) for name in names}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {}
    for name in names:
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                with record_function("profile_zero.step"):
                    fns[name]()
            wall = time.perf_counter() - start
        out[name] = breakdown(prof, wall, steps)
        out[name]["top_ops"] = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps)
                                for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
    out["backend"] = dist.get_backend()
    if repeats > 1:
        out["unprofiled_s"] = harness.interleave(fns, repeats, steps, warmup=0)
    return out


def report(results: list[dict], names: list[str], size: Size, nproc: int, steps: int, out: str) -> str:
    def mean(name, key, sub):
        return sum(r[name][key].get(sub, 0.0) for r in results) / len(results)

    header = ["bucket (ms/step, mean of ranks)", *names]
    rows = [[b] + [f"{mean(n, 'buckets_s', b) * 1e3:.1f}" for n in names] for b in BUCKETS]
    rows.append(["**wall**"] + [f"**{sum(r[n]['wall_s'] for r in results) / len(results) * 1e3:.1f}**" for n in names])
    kinds = sorted({k for r in results for n in names for k in r[n]["communication_s"]})
    rows += [[f"  comm: {k}"] + [f"{mean(n, 'communication_s', k) * 1e3:.1f}" for n in names] for k in kinds]
    rows.append(["transport events"] + [", ".join(f"{k} x{v}" for k, v in results[0][n]["transport_events"].items())
                                         or "none" for n in names])
    markdown = harness.table(header, rows)
    if "unprofiled_s" in results[0]:
        timed = results[0]["unprofiled_s"]  # interleave reports the slowest rank: the same on every rank
        base = "deepspeed" if "deepspeed" in timed else names[0]
        markdown += "\n\n" + harness.table(
            [f"unprofiled, median of {len(timed[names[0]])} blocks of {steps} steps", *names],
            [["ms/step"] + [harness.fmt_ms(harness.summary(timed[n])["median"]) for n in names],
             [f"/ {base}"] + [f"{harness.ratio(timed, n, base):.3f}" for n in names]])
    harness.write(out, {"size": size.as_dict(), "nproc": nproc, "steps": steps, "ranks": results}, markdown)
    return markdown


def main(argv=None) -> str:
    parser = harness.parser(__doc__, "profile_zero", "variants", VARIANTS, repeats=1, steps=3,
                            tiny="a toy size that only shows the script runs")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    names = harness.choices(parser, args.variants, VARIANTS, "variants")
    size = TINY if args.tiny else PROFILE_SIZE
    from atorch.distributed.local import run_local

    results = run_local(functools.partial(run, size, args.steps, args.warmup, names, args.repeats), args.nproc, timeout_s=600)
    markdown = report(results, names, size, args.nproc, args.steps, args.out)
    print(markdown)
    for name in names:
        print(f"\n{name} top ops (rank 0, ms/step, calls/step):")
        for key, ms, count in results[0][name]["top_ops"]:
            print(f"  {ms:8.2f}  {count:5d}  {key}")
    return markdown


if __name__ == "__main__":
    main()
