"""Rates measured on this machine, for the search's step-time estimate.

Every rank of an initialised process group calls :func:`calibrate`. It measures, in a few
seconds: the matmul rate per dtype (fp32, bf16), the overhead per dispatched operator, and, for
each group size (powers of two that divide the world, a node's ranks, and the world), the
bandwidth and latency of all-reduce, all-gather, reduce-scatter and send/recv; then each method's
host overhead per step, from dry runs of a small model (:mod:`atorch.auto.search.overheads`). Each collective is
timed at two message sizes (median
of a few repetitions, the slowest rank's), and the line ``time = latency + bytes / bandwidth`` is
drawn through the two points, with bytes counted the way the cost model counts them (an all-reduce of
P bytes over n ranks moves 2(n-1)/n x P per rank). The rates are written as a hardware profile
(the schema of ``atorch/auto/search/profiles``) to a cache file per device type and world size,
and the search uses them in place of its nominal rates (the report says which it used)::

    # every rank, after init_distributed(); or from a shell: atorch calibrate --nproc 2
    from atorch.auto.search.calibrate import calibrate
    rates = calibrate()              # measured once, then read from the cache
    rates = calibrate(refresh=True)  # measured again
"""

import json
import os
import platform
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from atorch.auto.search.agree import from_rank0
from atorch.auto.search.calibration_file import (  # noqa: F401 - reading the cache: its old home
    _setting,
    cache_path,
    cached_rates,
    default_dir,
    device_name,
    read_cached,
)
from atorch.auto.search.compute_rates import AMP_BLOCK, MATMUL_SECONDS, MATMUL_SIDE, _autocast_speedup, _matmul_rate  # noqa: F401 - their old home
from atorch.auto.search.overheads import measure_method_seconds
from atorch.auto.search.profiles import HardwareProfile, profile_from_data
from atorch.auto.search.timing import REPEATS, _sync, median_seconds  # noqa: F401
from atorch.utils.files import write_text_atomic

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
# The small message's time is the latency, the noisiest figure on a shared machine: each of its
# repetitions times this many messages back to back (one rank starting late shows once, not in each).
SMALL_BATCH = 10
# Payload bytes per message of the two-point fit: one small (latency), one large (bandwidth).
MESSAGE_BYTES = {"cpu": (16 * 2**10, 4 * 2**20), "cuda": (64 * 2**10, 64 * 2**20)}
# Batch, heads, sequence and head size of the causal attention timed per dtype: a GPU's at a
# training size (at the CPU's, an H200 would time the kernels' launches, not their work).
ATTENTION_SHAPE = {"cpu": (4, 4, 128, 32), "cuda": (4, 16, 2048, 128)}
# Bytes of the tensor copied, device to device, to time a GPU memory's bandwidth.
COPY_BYTES = 2**30
# Layers of the tiny model whose step measures the overhead per operator.
OP_LAYERS = 16
CHECKPOINT_BLOCK = 4  # layers per checkpointed block when timing checkpointing's overhead
WRAPPED_UNITS = 8  # FSDP2 units when timing its hooks' overhead


def calibrate(refresh: bool = False, directory: str | os.PathLike | None = None,
              device: torch.device | None = None) -> HardwareProfile:
    """This machine's rates, the same on every rank: from the cache, or measured (and cached)
    when there is none or ``refresh`` is set. A collective call: every rank calls it."""
    from atorch.distributed import env

    device = device or env.device()
    world = dist.get_world_size() if dist.is_initialized() else 1
    path = cache_path(device, world, directory)
    data = None if refresh else read_cached(path, device)[0]
    if from_rank0(data is None):
        data = measure(device)
        if not dist.is_initialized() or dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(data, indent=2) + "\n")
    data = from_rank0(data)
    return profile_from_data(data, path)


def measure(device: torch.device) -> dict:
    """Measure the rates on every rank; the result (a profile's data) is rank 0's, agreed."""
    began = time.perf_counter()
    world = dist.get_world_size() if dist.is_initialized() else 1
    setting = _setting(device)
    local = setting["local_world_size"]
    matmul = {"fp32": _matmul_rate(device, torch.float32), "bf16": _matmul_rate(device, torch.bfloat16)}
    cpu_rates = {}
    if device.type == "cpu":
        # On a CPU autocast's casts and its bf16 elementwise operators can eat what the faster
        # matmuls save: on an EPYC with bf16 instructions a square bf16 matmul ran 4.3x the fp32
        # rate while the cost-model benchmark's Llamas stepped no faster under amp (the estimate
        # had put them 38% faster, and ranked them first). A model's step decides instead.
        cpu_rates["autocast_step_speedup"] = _autocast_speedup(device)
        matmul["bf16"] = min(matmul["bf16"], matmul["fp32"] * cpu_rates["autocast_step_speedup"])
    # Attention kernels run at rates of their own: bf16 flash attention's backward ran 5x slower
    # than fp32's on an EPYC, and made a small Llama's amp step slower than fp32's; a GPU's flash
    # kernels run below its matmul rate too.
    attention = {"fp32": _attention_rate(device, torch.float32), "bf16": _attention_rate(device, torch.bfloat16)}
    # the element-wise operators' rate on a GPU (a CPU's calibrated op_seconds takes them in)
    bandwidth = {"memory_bandwidth": _memory_bandwidth(device)} if device.type == "cuda" else {}
    op_seconds = _op_seconds(device)
    checkpoint_save_seconds = _checkpoint_save_seconds(device, op_seconds)
    collectives: dict = {kind: {} for kind in KINDS}
    for size in _group_sizes(world, local):
        group, own = _group_of(size)
        for kind in KINDS:
            collectives[kind][str(size)] = _fit(device, kind, group, size)
        if own:
            dist.destroy_process_group(group)
    wrapped_call_seconds = _wrapped_call_seconds(device, collectives, world)
    inside = max((s for s in map(int, collectives["all_reduce"]) if s <= local), default=None)
    intra = collectives["all_reduce"][str(inside)] if inside else {"bandwidth": 1e9, "latency": 1e-4}
    inter = collectives["all_reduce"][str(world)] if world > local else intra
    seconds = time.perf_counter() - began
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    how = (f"measured by atorch calibrate ({when}, {world} x "
           f"{device_name(device)}, torch {torch.__version__}, {seconds:.1f}s)")
    sources = _sources(device, how, world, local, inside)
    data = from_rank0({
        "name": f"calibrated-{device_name(device)}-world{world}",
        "description": f"{world} x {device_name(device)} on {platform.node()}, {local} per node",
        "matmul_flops": matmul,
        "sustained_fraction": 1.0,
        "memory": _memory(device, local),
        "gpus_per_node": local,
        "intra_node": intra,
        "inter_node": inter,
        "collectives": {k: v for k, v in collectives.items() if v},
        "op_seconds": op_seconds,
        "checkpoint_save_seconds": checkpoint_save_seconds,
        "wrapped_call_seconds": wrapped_call_seconds,
        "attention_flops": attention,
        **bandwidth,
        **({"ranks_per_core": _ranks_per_core(setting)} if device.type == "cpu" else {}),
        "attention": "flash" if device.type == "cuda" else "math",
        "calibration": {"device": device_name(device), "world_size": world, **setting, "when": when,
                        "seconds": seconds, "torch": torch.__version__, **cpu_rates},
        "sources": sources,
    })
    # then the methods' host overheads, against estimates at the rates just measured
    data["method_seconds"], method_how = measure_method_seconds(data)
    data["sources"]["method_seconds"] = f"{how}: {method_how}"
    data["calibration"]["seconds"] = time.perf_counter() - began
    return data


def _sources(device: torch.device, how: str, world: int, local: int, inside: int | None) -> dict:
    """Where each calibrated rate comes from, as the profile's ``sources`` say it."""
    bf16 = (f"; bf16 at most the fp32 rate x how much faster forward + backward of 2 MLP blocks "
            f"({AMP_BLOCK[0]} tokens x {AMP_BLOCK[1]}) runs under bf16 autocast than in fp32"
            if device.type == "cpu" else "")
    return {"matmul_flops": f"{how}: square matmuls of side {MATMUL_SIDE.get(device.type, 512)} (halved while "
                               f"one takes over {MATMUL_SECONDS}s), median of {REPEATS}, the slowest rank's{bf16}",
               "sustained_fraction": "1: the matmul rates are measured, already sustained",
               "attention_flops": f"{how}: forward + backward of causal scaled_dot_product_attention on "
                                  f"{_attention_shape(device)} (batch, heads, sequence, head size), its forward's "
                                  f"FLOPs as the probe counts them x 3 over the time, median of {REPEATS}, the "
                                  "slowest rank's",
               **({"memory_bandwidth": f"{how}: a {COPY_BYTES} byte tensor copied on the device, bytes read + "
                                       f"written over the time, median of {REPEATS}, the slowest rank's"}
                  if device.type == "cuda" else {}),
               "op_seconds": f"{how}: forward + backward of {OP_LAYERS} tiny Linear + ReLU layers on one sample, "
                             f"over 3 x the operators its forward dispatches, median of {REPEATS}, the slowest rank's",
               "checkpoint_save_seconds": f"{how}: the same layers in blocks of {CHECKPOINT_BLOCK}, each "
                                          "checkpointed as atorch's checkpoint does, minus the same without and the "
                                          "recompute's operators at op_seconds, over the tensors the blocks save, "
                                          f"median of {REPEATS}, the slowest rank's",
               "wrapped_call_seconds": f"{how}: forward + backward of {WRAPPED_UNITS} tiny Linear layers, each its "
                                       "own FSDP2 unit over every rank, minus the same unsharded and the "
                                       "collectives' calibrated latencies, over its all-gathers and "
                                       f"reduce-scatters, median of {REPEATS}, the slowest rank's"
               if world > 1 else "one rank: nothing to measure",
               "ranks_per_core": f"{how}: this node's ranks x each one's threads / the cores this process may "
                                 "run on (os.sched_getaffinity), at least 1",
               "memory": "this device's memory (the node's RAM shared by its ranks on CPU)",
               "intra_node.bandwidth": f"{how}: all-reduce over the largest group inside a node"
               if inside else "nominal: one rank, nothing to measure",
               "inter_node.bandwidth": f"{how}: all-reduce over every rank" if world > local else
               "the intra-node link (every rank is on one node)",
               "collectives": f"{how}: latency + bytes / bandwidth through two message sizes "
                              f"{MESSAGE_BYTES.get(device.type, MESSAGE_BYTES['cpu'])} bytes (the small {SMALL_BATCH} at a time), median "
                              f"of {REPEATS}, "
                              "the slowest rank's; bytes as the cost model counts them per rank"}


def _ranks_per_core(setting: dict) -> float:
    """How many ranks share one core: a node's ranks x each one's threads over its cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, setting["local_world_size"] * setting.get("threads", 1) / max(cores, 1))


def _memory(device: torch.device, local: int) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    from atorch.auto.environment import _host_memory

    return _host_memory() // max(local, 1)


def _attention_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of causal attention's forward + backward in ``dtype``, counted as the cost model
    counts a step's: 3 x the forward's FLOPs (ops.OpCounter's) over the time."""
    from atorch.auto.search.ops import OpCounter

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*_attention_shape(device), generator=generator).to(device, dtype).requires_grad_()
               for _ in range(3))

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with OpCounter() as counter:
        forward()
    return 3 * counter.flops / median_seconds(device, lambda: forward().sum().backward())


def _attention_shape(device: torch.device) -> tuple:
    return ATTENTION_SHAPE.get(device.type, ATTENTION_SHAPE["cpu"])


def _memory_bandwidth(device: torch.device) -> float:
    """Bytes/s the device's memory moves, read + written, copying a COPY_BYTES tensor."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(device, lambda: target.copy_(source))
    return 2 * COPY_BYTES / seconds


def _op_seconds(device: torch.device) -> float:
    """Seconds of overhead per operator: a forward + backward whose FLOPs are negligible, over the
    operators it dispatches, counted as the cost model counts them (3 x forward's: backward
    dispatches about two per forward operator)."""
    from atorch.auto.search.ops import OpCounter

    layers = [layer for _ in range(OP_LAYERS) for layer in (torch.nn.Linear(8, 8), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(1, 8, device=device)
    with OpCounter() as ops:
        model(x)

    def step():
        model(x).sum().backward()

    return median_seconds(device, step, batch=10) / (3 * max(ops.count, 1))


def _checkpoint_save_seconds(device: torch.device, op_seconds: float) -> float:
    """Seconds checkpointing costs per tensor a checkpointed block saves for backward, beyond
    running the block's forward again (``op_seconds`` per operator): the checkpoint's hooks pack
    and unpack every such tensor, and the recompute's bookkeeping. On a CPU a small block's
    checkpoint costs more than its recompute."""
    from atorch.auto.search.ops import OpCounter
    from atorch.methods.checkpoint import CheckpointedForward

    def blocks():
        return torch.nn.Sequential(*(
            torch.nn.Sequential(*(layer for _ in range(CHECKPOINT_BLOCK) for layer in (torch.nn.Linear(8, 8),
                                                                                      torch.nn.ReLU())))
            for _ in range(OP_LAYERS // CHECKPOINT_BLOCK))).to(device)

    plain, checkpointed = blocks(), blocks()
    for block in checkpointed:
        block.forward = CheckpointedForward(block.forward, use_reentrant=False)
    x = torch.randn(1, 8, device=device)
    saved = []
    with OpCounter() as ops, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        plain(x)
    plain_s = median_seconds(device, lambda: plain(x).sum().backward(), batch=10)
    checkpointed_s = median_seconds(device, lambda: checkpointed(x).sum().backward(), batch=10)
    return max(0.0, (checkpointed_s - plain_s - ops.count * op_seconds) / max(len(saved), 1))


def _wrapped_call_seconds(device: torch.device, collectives: dict, world: int) -> float:
    """Host seconds FSDP2 spends per collective it issues from its hooks, beyond the collective's
    own latency: copying parameters and gradients in and out of its flat buffers, its DTensor
    bookkeeping. On a small model it is most of what sharding costs."""
    if world < 2:
        return 0.0
    import copy

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(WRAPPED_UNITS))).to(device)
    sharded = copy.deepcopy(plain)
    for layer in sharded:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(sharded)  # holds no parameters of its own: no collective
    x = torch.randn(1, 16, device=device)
    plain_s = median_seconds(device, lambda: plain(x).sum().backward(), dist.group.WORLD, batch=10)
    sharded_s = median_seconds(device, lambda: sharded(x).sum().backward(), dist.group.WORLD, batch=10)
    gathers, scatters = 2 * WRAPPED_UNITS, WRAPPED_UNITS  # gathered in forward and again in backward
    latency = (gathers * collectives["all_gather"][str(world)]["latency"]
               + scatters * collectives["reduce_scatter"][str(world)]["latency"])
    return max(0.0, (sharded_s - plain_s - latency) / (gathers + scatters))


def _group_sizes(world: int, local: int) -> list[int]:
    """Powers of two that divide ``world``, the ranks of a node, and ``world`` itself (no group of one)."""
    sizes = {s for s in (world, local) if s > 1 and world % s == 0}
    size = 2
    while size < world:
        if world % size == 0:
            sizes.add(size)
        size *= 2
    return sorted(sizes)


def _group_of(size: int):
    """This rank's group of ``size`` consecutive ranks, and whether it was made here (to destroy)."""
    if size == dist.get_world_size():
        return dist.group.WORLD, False
    group, _ = dist.new_subgroups(group_size=size, group_desc=f"atorch_calibrate_{size}")
    return group, True


def _wire_bytes(kind: str, payload: int, n: int) -> float:
    """Bytes one rank sends in ``kind`` over ``n`` ranks, as the cost model counts them."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * payload
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * payload
    return float(payload)  # send_recv


def _fit(device: torch.device, kind: str, group, n: int) -> dict:
    """{bandwidth, latency} of ``kind`` over ``group`` (``n`` ranks): two sizes, one line."""
    points = []
    for payload, batch in zip(MESSAGE_BYTES.get(device.type, MESSAGE_BYTES["cpu"]), (SMALL_BATCH, 1)):
        run = _operation(device, kind, group, n, payload // 4)
        seconds = median_seconds(device, run, group, batch)
        points.append((_wire_bytes(kind, payload // 4 * 4, n), seconds / 2 if kind == "send_recv" else seconds))
    (small, t_small), (large, t_large) = points
    if t_large > t_small:
        bandwidth = (large - small) / (t_large - t_small)
        latency = max(t_small - small / bandwidth, 1e-7)
    else:  # noise swamped the difference: all of the large message's time is transfer
        bandwidth, latency = large / t_large, t_small
    return {"bandwidth": bandwidth, "latency": latency}


def _operation(device: torch.device, kind: str, group, n: int, elements: int):
    """A callable that runs ``kind`` once on ``elements`` fp32 elements (the whole payload)."""
    elements -= elements % n
    if kind == "all_reduce":
        data = torch.zeros(elements, device=device)
        return lambda: dist.all_reduce(data, group=group)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out, part = torch.empty(elements, device=device), torch.zeros(elements // n, device=device)
        return lambda: gather(out, part, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        full, out = torch.zeros(elements, device=device), torch.empty(elements // n, device=device)
        return lambda: scatter(out, full, group=group)
    # send_recv: the first half of the group sends to the second half and hears back; one way
    # is half the round trip.
    ranks = dist.get_process_group_ranks(group)
    position, half = ranks.index(dist.get_rank()), n // 2
    data = torch.zeros(elements, device=device)
    if position < half:
        peer = ranks[position + half]

        def ping():
            dist.send(data, peer)
            dist.recv(data, peer)
    elif position < 2 * half:
        peer = ranks[position - half]

        def ping():
            dist.recv(data, peer)
            dist.send(data, peer)
    else:
        def ping():  # the odd one out of an odd-sized group
            pass
    return ping
