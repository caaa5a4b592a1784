"""The GPU check's offload unit: fsdp's ``cpu_offload`` term (atorch/methods/fsdp.py,
``offload_terms``) against what FSDP2's CPUOffloadPolicy does on this device.

The term charges three things a step, none overlapped: the parameter shards copied in before each
all-gather and the gradient shards copied out after each reduce-scatter, at the profile's
``host_link_bandwidth``; and AdamW's step on the host, at ``host_optimizer_seconds_per_byte`` a
byte of parameter. The unit measures both rates here (pinned copies each way; torch's AdamW on
host tensors), then the benchmarked Llama sharded with ``fully_shard`` on a one-rank group,
with and without ``CPUOffloadPolicy``, timed in alternated blocks; the measured difference of the
two steps is set beside the cost model's (the same strategy costed with and without the option,
at the datasheet profile and at the rates measured here). On the CPU dry path only the host
optimizer's rate is measured: nothing moves between host and device there.
"""

import dataclasses
import os
import statistics
import time

import torch

from benchmarks.gpu import llama

# Bytes of the pinned buffer copied each way to time the host link, and copies timed.
LINK_BYTES, LINK_REPEATS = 512 << 20, 7
# fp32 parameters AdamW steps on the host to time its rate (the dry path: fewer).
HOST_PARAMS, DRY_HOST_PARAMS = 64 << 20, 1 << 20
# Blocks of steps alternated between the two shardings, and steps a block.
BLOCKS, BLOCK_STEPS = 5, 3


def measure(run) -> dict:
    """The unit's result: the measured rates, the profile's, and (on CUDA) the two steps."""
    cuda = run.device.type == "cuda"
    host = host_optimizer_seconds_per_byte(HOST_PARAMS if cuda else DRY_HOST_PARAMS)
    out = {"host_optimizer_seconds_per_byte": host}
    if not cuda:
        return {**out, "skipped": "the host link and CPU offload need a CUDA device (the CPU dry path: the host "
                                  "optimizer's rate only)"}
    out.update(link_bandwidth(run.device))
    steps = offload_steps(run.size, run.device)
    out.update(steps)
    out["estimated"] = estimated_extra(run, out)
    return out


def host_optimizer_seconds_per_byte(count: int) -> float:
    """torch's AdamW (its default, foreach) on ``count`` fp32 host parameters: the median step's
    seconds over the parameters' bytes."""
    param = torch.nn.Parameter(torch.randn(count))
    param.grad = torch.randn(count)
    optimizer = torch.optim.AdamW([param], lr=llama.LR)
    optimizer.step()  # the states are created here
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (count * 4)


def link_bandwidth(device: torch.device) -> dict:
    """Pinned host memory to the device and back: bytes a second, the median copy each way."""
    host = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(LINK_BYTES, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("host_to_device", on_device, host), ("device_to_host", host, on_device)):
        times = []
        for _ in range(LINK_REPEATS):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[f"{name}_bandwidth"] = LINK_BYTES / statistics.median(times[1:])
    return out


def offload_steps(size: llama.LlamaSize, device: torch.device) -> dict:
    """The Llama under fully_shard (bf16 compute, fp32 reduce) on a one-rank group, with and
    without CPUOffloadPolicy: the median step of each over alternated blocks, and the peaks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    variants = {}
    for offload in (False, True):
        model = llama.build(size, device)
        placement = CPUOffloadPolicy() if offload else OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy, offload_policy=placement)
        fully_shard(model, mp_policy=policy, offload_policy=placement)
        optimizer = torch.optim.AdamW(model.parameters(), lr=llama.LR)
        batches = llama.forever(torch.utils.data.DataLoader(llama.Tokens(size), batch_size=size.batch))

        def step(model=model, optimizer=optimizer, batches=batches):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up: the optimizer's states, the allocator's pools
        variants["offload" if offload else "on_device"] = step
    times: dict = {name: [] for name in variants}
    torch.cuda.reset_peak_memory_stats(device)
    for block in range(BLOCKS):
        for name in (list(variants) if block % 2 == 0 else list(variants)[::-1]):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(BLOCK_STEPS):
                variants[name]()
            torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - t0) / BLOCK_STEPS)
    on_device, offload = statistics.median(times["on_device"]), statistics.median(times["offload"])
    return {"step_s": {"on_device": on_device, "offload": offload}, "measured_extra_s": offload - on_device,
            "block_seconds": times}


def estimated_extra(run, measured: dict) -> dict:
    """The cost model's extra seconds a step for the offload (the same fsdp strategy costed with
    and without ``cpu_offload``), at the datasheet profile and at the rates measured here."""
    from benchmarks.gpu import estimate

    profile, _ = estimate.datasheet_profile(run.config["device_name"])
    if profile is None:
        return {"skipped": "no datasheet profile for this GPU"}
    here = dataclasses.replace(profile, host_link_bandwidth=min(measured["host_to_device_bandwidth"],
                                                                measured["device_to_host_bandwidth"]),
                               host_optimizer_seconds_per_byte=measured["host_optimizer_seconds_per_byte"])
    out = {}
    for name, rates in (("datasheet", profile), ("measured rates", here)):
        seconds = {}
        for offload in (False, True):
            strategy = [("amp_native", "bf16"), ("fsdp", {"cpu_offload": offload})]
            step = estimate.costed(run.size, "bf16", rates, "cuda", strategy=strategy)
            step.profile = rates
            seconds[offload] = step.seconds()
        out[name] = {"extra_s": seconds[True] - seconds[False], "step_s": seconds[True],
                     "ratio": (seconds[True] - seconds[False]) / measured["measured_extra_s"]
                     if measured["measured_extra_s"] > 0 else None}
    return out
