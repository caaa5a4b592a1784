"""Named hardware profiles: the rates of a machine we do not have, each number with its source.

A profile is a JSON file in this folder (``h100_80gb.json``): peak dense matmul FLOP/s per compute
dtype, the share of that peak a training matmul sustains, memory per device, GPUs per node, and
the bandwidth (bytes/s, each way) and latency (s) of one collective step inside a node and between
nodes. ``sources`` says where every number comes from (a datasheet, or "assumption").
Optionally, ``collectives`` gives a link per collective kind (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``send_recv``) and group size, as ``atorch calibrate`` measures them on this
machine (:mod:`atorch.auto.search.calibrate` writes its cache in this schema), and ``op_seconds``
the framework overhead per dispatched operator (calibrated; 0 when absent); ``overlap`` the
share of an early-issued data-parallel collective that runs behind compute (0 when absent);
``checkpoint_save_seconds`` what checkpointing adds per tensor a checkpointed block saves, beyond
its recompute, and ``wrapped_call_seconds`` the host time FSDP2 spends per collective its hooks
issue (both calibrated; 0 when absent); ``method_seconds`` each method's host overhead per unit
its cost term charges (calibrated; none when absent).
The cost model (:meth:`atorch.auto.search.cost.StepCost.seconds`) uses a profile's rates in place
of its nominal ones, and ``atorch plan --search --profile NAME`` plans with it::

    >>> from atorch.auto.search.profiles import load_profile
    >>> h100 = load_profile("h100_80gb")
    >>> h100.peak("half") / 1e12
    989.4
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from atorch.errors import AtorchConfigError

FOLDER = Path(__file__).resolve().parent
_REQUIRED = ("matmul_flops", "sustained_fraction", "memory", "gpus_per_node", "intra_node", "inter_node", "sources")


class UnknownProfileError(AtorchConfigError):
    """A hardware profile name (or file) that does not exist or does not read as a profile."""


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s each way, per GPU
    latency: float  # seconds per collective or send


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    matmul_flops: dict  # peak dense FLOP/s by dtype: {"bf16": ..., "fp32": ...}
    sustained_fraction: float
    memory: int  # bytes per device
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    sources: dict = field(default_factory=dict)
    description: str = ""
    attention: str = "math"  # "flash": activations of attention as a flash kernel saves them
    # {kind: {group size: Link}}: measured per collective (see the module docstring); empty in a
    # datasheet profile, whose two links then serve every kind
    collectives: dict = field(default_factory=dict)
    # seconds of framework overhead per operator a step dispatches (the Python call, dispatch,
    # autograd's record): measured by calibration; 0 in a datasheet profile (a GPU's launches
    # overlap the kernels of a model big enough to plan)
    op_seconds: float = 0.0
    # the share of a data-parallel collective that runs while the compute goes on, when the method
    # issues it early (DDP's buckets in backward, FSDP2's prefetched gathers): 0 hides nothing
    # (absent from calibrated profiles: calibration does not measure it)
    overlap: float = 0.0
    # seconds checkpointing costs per tensor a checkpointed block saves, beyond its recompute (its
    # hooks pack and unpack each): measured by calibration; 0 in a datasheet profile (host time)
    checkpoint_save_seconds: float = 0.0
    # host seconds a sharding wrapper (FSDP2) spends per collective it issues from its hooks, beyond
    # the collective: measured by calibration; 0 in a datasheet profile (host time)
    wrapped_call_seconds: float = 0.0
    # FLOP/s of attention kernels (scaled_dot_product_attention's forward + backward) by dtype, as
    # the probe counts their FLOPs: measured by calibration on a CPU, where bf16 attention ran 5x
    # slower than fp32 while bf16 matmuls ran faster; empty: attention runs at the matmul rate
    attention_flops: dict = field(default_factory=dict)
    # InfiniBand NICs a node has, one a GPU (DGX H100: 8); a group spanning nodes uses as many of
    # them as it has members a node (see link)
    nics_per_node: int = 1
    # device seconds each dispatched operator costs beyond its FLOPs (a kernel's launch and tail):
    # what makes small micro-batches and narrow models fill the GPU less; 0 when absent
    kernel_seconds: float = 0.0
    # bytes/s the device's memory moves (read + written) for the operators without FLOPs
    # (element-wise, normalizations, softmax; StepCost.traffic_seconds): a datasheet's HBM rate, or
    # measured by calibration on a GPU; 0 (absent) charges them nothing, as on a CPU, whose
    # calibrated per-operator overhead takes them in
    memory_bandwidth: float = 0.0
    # host seconds of each method's overhead per unit it charges (StepCost.overheads; "step": the
    # training step's own, charged once a step to every candidate): measured by calibration as what
    # dry runs of a small model take beyond the rest of the estimate; empty in a datasheet profile
    method_seconds: dict = field(default_factory=dict)
    # ranks that share one CPU core (a node's ranks x each one's threads / its cores), at least 1:
    # the matmul rates are measured with every rank computing, so they are a shared core's; a rank
    # idle in a pipeline's bubble gives its share to the others (see StepCost.bubble_factor).
    # Calibration on a CPU measures it; 1 in a datasheet profile (a device a rank)
    ranks_per_core: float = 1.0
    # bytes per device training cannot use (CUDA context, communication buffers, the allocator's
    # fragmentation): a plan fits within memory - reserve
    reserve: int = 0
    # bytes/s one device copies to or from its host, each way (PCIe): what fsdp's CPU offload moves
    # its shards over; 0 (absent): offload is not planned on this profile
    host_link_bandwidth: float = 0.0
    # host seconds per byte of parameters the optimizer steps on the CPU (fsdp's CPU offload runs
    # torch's AdamW there); 0 (absent): offload is not planned on this profile
    host_optimizer_seconds_per_byte: float = 0.0

    def offloads(self) -> bool:
        """Whether the profile has what CPU offload's cost needs (the host link and optimizer)."""
        return self.host_link_bandwidth > 0 and self.host_optimizer_seconds_per_byte > 0

    def peak(self, compute_dtype: str) -> float:
        """Peak dense FLOP/s for the cost model's compute dtype ("half" or "fp32")."""
        return self.matmul_flops["bf16" if compute_dtype == "half" else "fp32"]

    def rate(self, compute_dtype: str) -> float:
        """Sustained FLOP/s: the peak times ``sustained_fraction``."""
        return self.peak(compute_dtype) * self.sustained_fraction

    def attention_rate(self, compute_dtype: str) -> float:
        """FLOP/s of attention kernels: measured when the profile has them, else :meth:`rate`."""
        measured = self.attention_flops.get("bf16" if compute_dtype == "half" else "fp32")
        return measured if measured else self.rate(compute_dtype)

    def link(self, span: int, kind: str | None = None, members: int | None = None) -> Link:
        """The link a group uses whose ``members`` ranks lie within ``span`` consecutive ranks
        (ranks are placed node by node): NVLink when they share a node, InfiniBand otherwise,
        where a node's members each drive their own NIC: a ring collective crosses each node
        boundary with its data split over them (NCCL runs one ring a NIC), so a group with k
        members a node moves k x one NIC's bandwidth between nodes, up to ``nics_per_node`` NICs
        and NVLink's rate. With ``kind`` (a collective) measured in ``collectives``, the rate of
        the smallest group measured that covers ``span`` (the largest measured when none does)."""
        measured = self.collectives.get(kind) if kind else None
        if measured:
            sizes = sorted(measured)
            return measured[next((s for s in sizes if s >= span), sizes[-1])]
        if span <= self.gpus_per_node:
            return self.intra_node
        per_node = max(1, (members or 1) * self.gpus_per_node // span)
        nics = min(per_node, self.nics_per_node)
        return Link(min(self.inter_node.bandwidth * nics, self.intra_node.bandwidth), self.inter_node.latency)


def profile_names() -> list[str]:
    """The profiles in the repository, by name."""
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """The profile named ``name_or_path`` (a file stem in this folder) or read from that path;
    :class:`UnknownProfileError` lists the known names when there is none."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.is_file()):
        path = FOLDER / f"{name_or_path}.json"
    if not path.is_file():
        raise UnknownProfileError(f"no hardware profile {name_or_path!r}; known profiles: {', '.join(profile_names())} "
                                  f"(or give the path of a profile JSON file like those in {FOLDER})")
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError) as error:
        raise UnknownProfileError(f"hardware profile {path} is not JSON ({type(error).__name__}: "
                                  f"{str(error)[:200]})") from None
    return profile_from_data(data, path)


def _link(data: dict) -> Link:
    return Link(float(data["bandwidth"]), float(data["latency"]))


def _ranks_per_core(data: dict, path: Path) -> float:
    value = float(data.get("ranks_per_core", 1.0))
    if not (math.isfinite(value) and value >= 1):
        raise UnknownProfileError(f"hardware profile {path}: ranks_per_core is ranks sharing a core, at least 1, "
                                  f"not {value:g}")
    return value


def _reserve(data: dict, path: Path) -> int:
    """The profile's ``reserve`` (a size, 0 when absent), which needs a source like the memory."""
    from atorch.utils.sizes import parse_bytes

    if "reserve" not in data:
        return 0
    try:
        value = parse_bytes(data["reserve"])
    except ValueError:
        value = -1
    if value is None or value < 0 or value >= parse_bytes(data["memory"]):
        raise UnknownProfileError(f"hardware profile {path}: reserve is bytes per device that training cannot use, "
                                  f"from 0 to below the memory, not {data['reserve']!r}")
    if value and "reserve" not in data["sources"]:
        raise UnknownProfileError(f"hardware profile {path} gives no source for ['reserve'] (write it in 'sources')")
    return value


def _memory_bandwidth(data: dict, path: Path) -> float:
    value = float(data.get("memory_bandwidth", 0.0))
    if not (math.isfinite(value) and value >= 0):
        raise UnknownProfileError(f"hardware profile {path}: memory_bandwidth is bytes/s, not negative (0: none)")
    return value


def _host(data: dict, path: Path) -> dict:
    """The host link and host optimizer rate (0 when absent), each with a source when given."""
    out = {}
    for key in ("host_link_bandwidth", "host_optimizer_seconds_per_byte"):
        value = float(data.get(key, 0.0))
        if not (math.isfinite(value) and value >= 0):
            raise UnknownProfileError(f"hardware profile {path}: {key} must not be negative (0: none)")
        if value and key not in data["sources"]:
            raise UnknownProfileError(f"hardware profile {path} gives no source for ['{key}'] (write it in 'sources')")
        out[key] = value
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**20


def _link_shape(value) -> bool:
    return isinstance(value, dict) and all(_number(value.get(key)) for key in ("bandwidth", "latency"))


def _table(check):
    return lambda value: isinstance(value, dict) and all(check(item) for item in value.values())


# What each field of a profile holds, by the field's name: a check, and what it should be.
_SHAPES = {
    "matmul_flops": (_table(_number), "an object of FLOP/s by dtype ({'fp32': ..., 'bf16': ...})"),
    "sustained_fraction": (_number, "a number in (0, 1]"),
    "memory": (lambda v: isinstance(v, str) or (_number(v) and v > 0), "a size ('80GiB') or bytes"),
    "reserve": (lambda v: isinstance(v, str) or (_number(v) and v >= 0), "a size ('6GiB') or bytes"),
    "gpus_per_node": (_whole, "a whole number from 1 to 2**20"),
    "nics_per_node": (_whole, "a whole number from 1 to 2**20"),
    "intra_node": (_link_shape, "an object with a 'bandwidth' (bytes/s) and a 'latency' (s)"),
    "inter_node": (_link_shape, "an object with a 'bandwidth' (bytes/s) and a 'latency' (s)"),
    "sources": (_table(lambda v: isinstance(v, str)), "an object of texts: each number's source"),
    "collectives": (_table(lambda by_size: isinstance(by_size, dict) and all(
        isinstance(size, str) and size.isdigit() and _link_shape(link) for size, link in by_size.items())),
        "an object of {group size: {'bandwidth', 'latency'}} by collective kind"),
    "method_seconds": (_table(_number), "an object of seconds by method"),
    "attention_flops": (_table(_number), "an object of FLOP/s by attention kind"),
    "name": (lambda v: isinstance(v, str), "a text"),
    "description": (lambda v: isinstance(v, str), "a text"),
    "attention": (lambda v: isinstance(v, str), "a text"),
    **{key: (_number, "a number") for key in ("overlap", "op_seconds", "checkpoint_save_seconds",
                                                 "wrapped_call_seconds", "kernel_seconds", "memory_bandwidth",
                                                 "ranks_per_core", "host_link_bandwidth",
                                                 "host_optimizer_seconds_per_byte")},
}


def _check_shape(data, path: Path) -> None:
    """Each field the profile gives holds what it should (a wrong type, or a number that is not
    finite, is refused by the field's name before any is read)."""
    if not isinstance(data, dict):
        raise UnknownProfileError(f"hardware profile {path} must be a JSON object, not {type(data).__name__}")
    wrong = [f"{key} must be {what}" for key, (check, what) in _SHAPES.items() if key in data and not check(data[key])]
    if wrong:
        raise UnknownProfileError(f"hardware profile {path}: {'; '.join(wrong)}")


def profile_from_data(data: dict, origin: str | Path = "profile") -> HardwareProfile:
    """A :class:`HardwareProfile` from a profile's JSON data, checked (``origin`` names it in errors)."""
    from atorch.utils.sizes import parse_bytes

    path = Path(origin)
    _check_shape(data, path)
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise UnknownProfileError(f"hardware profile {path} lacks {missing}")
    unsourced = [key for key in ("matmul_flops", "memory", "intra_node.bandwidth", "inter_node.bandwidth")
                 if not any(s == key or s.startswith(key + ".") for s in data["sources"])]
    if unsourced:
        raise UnknownProfileError(f"hardware profile {path} gives no source for {unsourced} (write it in 'sources')")
    fraction = float(data["sustained_fraction"])
    collectives = {kind: {int(size): _link(link) for size, link in by_size.items()}
                   for kind, by_size in data.get("collectives", {}).items()}
    links = [_link(data["intra_node"]), _link(data["inter_node"])] + [
        link for by_size in collectives.values() for link in by_size.values()]
    overlap = float(data.get("overlap", 0.0))
    # the host's overheads (calibrated; 0 when absent)
    host = {key: float(data.get(key, 0.0)) for key in ("op_seconds", "checkpoint_save_seconds", "wrapped_call_seconds")}
    for key, value in host.items():
        if not (math.isfinite(value) and value >= 0):
            raise UnknownProfileError(f"hardware profile {path}: {key} must not be negative")
    methods = {str(k): float(v) for k, v in data.get("method_seconds", {}).items()}
    if not all(math.isfinite(v) and v >= 0 for v in methods.values()):
        raise UnknownProfileError(f"hardware profile {path}: method_seconds must be seconds, not negative")
    attention = {k: float(v) for k, v in data.get("attention_flops", {}).items()}
    if not all(math.isfinite(v) and v > 0 for v in attention.values()):
        raise UnknownProfileError(f"hardware profile {path}: attention_flops must be positive")
    if not 0 <= overlap <= 1:
        raise UnknownProfileError(f"hardware profile {path}: overlap is a share of the communication, in [0, 1], "
                                  f"not {overlap:g}")
    if not isinstance(data["matmul_flops"], dict) or not {"fp32", "bf16"} <= set(data["matmul_flops"]):
        raise UnknownProfileError(f"hardware profile {path}: matmul_flops needs both 'fp32' and 'bf16' rates (the "
                                  "cost model reads one or the other for every candidate)")
    if (not 0 < fraction <= 1
            or not all(math.isfinite(v) and v > 0 for v in data["matmul_flops"].values())
            or not all(math.isfinite(v) and v > 0 for link in links for v in (link.bandwidth, link.latency))):
        raise UnknownProfileError(f"hardware profile {path}: rates must be positive and sustained_fraction in (0, 1]")
    return HardwareProfile(
        name=data.get("name", path.stem),
        matmul_flops={k: float(v) for k, v in data["matmul_flops"].items()},
        sustained_fraction=fraction,
        memory=parse_bytes(data["memory"]),
        gpus_per_node=int(data["gpus_per_node"]),
        intra_node=links[0],
        inter_node=links[1],
        sources=dict(data["sources"]),
        description=data.get("description", ""),
        attention=data.get("attention", "math"),
        collectives=collectives,
        overlap=overlap,
        attention_flops=attention,
        nics_per_node=int(data.get("nics_per_node", 1)),
        kernel_seconds=float(data.get("kernel_seconds", 0.0)),
        memory_bandwidth=_memory_bandwidth(data, path),
        method_seconds=methods,
        ranks_per_core=_ranks_per_core(data, path),
        reserve=_reserve(data, path),
        **_host(data, path),
        **host,
    )
