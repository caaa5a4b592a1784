"""The cost types the methods' cost terms fill in: one candidate's memory and step time per rank
(:class:`StepCost`), its peak's terms (:class:`MemoryEstimate`) and the collectives it makes
(:class:`Comm`). Nothing of the search is imported here, so a method's file imports these at its
top without closing an import circle through the registry; :mod:`atorch.auto.search.cost` builds
them (``build_cost``) and probes what they need.
"""

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from atorch.distributed.topology import DATA_PARALLEL_DIMS, data_parallel_size
from atorch.utils.memo import once

# Rough rates, used when this machine has no calibration (atorch/auto/search/calibrate.py) and
# no profile is given, only to order candidates (dry runs measure the real thing): sustained
# matmul FLOP/s by device and compute dtype, collective bandwidth in bytes/s and the latency of
# one collective or send in seconds, by device.
_FLOPS = {"cuda": {"fp32": 4e13, "half": 3e14}, "cpu": {"fp32": 5e10, "half": 2.5e10}}
_BANDWIDTH = {"cuda": 5e10, "cpu": 1e9}
_LATENCY = {"cuda": 2e-5, "cpu": 1e-4}
# A fused optimizer step (fused_optimizer) the cost model could not time on the device (planning
# with no hardware, an optimizer it cannot step alone), as a share of the default step's time:
# on this project's CPU (AMD EPYC, torch 2.13, 2026-11-28) fused AdamW took 0.18-0.34 of foreach's
# and 0.29-0.41 of the for-loop's (torch's CPU default) time over 50 K - 20 M parameters.
NOMINAL_FUSED_SHARE = 0.4



@dataclass
class MemoryEstimate:
    params: int
    grads: int
    optim_state: int
    gathered: int
    activations: int
    step_temp: int = 0
    forward_flops: float = 0.0
    # gradients alive together with the activations at their peak (checkpointing moves that peak
    # late into backward, where most gradients exist; without it the peak is at the end of forward)
    backward_grads: int = 0
    buckets: int = 0  # DDP's gradient buckets, alive all the time
    # alive with the gradients while a sharded unit's gradients are reduced at the end of its
    # backward, most activations freed (FSDP2 under amp: the unit's gradients in the compute
    # dtype and their copy in the reduce dtype)
    reduce_temp: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.optim_state + self.buckets
                + max(self.gathered + self.activations + self.backward_grads, self.grads + self.step_temp,
                      self.grads + self.reduce_temp))

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass
class Comm:
    """Bytes one rank moves in a collective or point-to-point pattern, counted per step."""

    dim: str  # the parallel dim whose group it runs over
    elements: float  # activation elements moved (their bytes follow the compute dtype)
    messages: int  # separate collectives or sends (each pays the latency)
    factor: float = 1.0  # bytes on the wire per byte of payload (a ring all-reduce: 2(n-1)/n)
    kind: str = "all_reduce"  # the collective, for its measured rate: all_reduce, all_gather, reduce_scatter, send_recv
    # the method that launches them: each message carries that method's calibrated host overhead
    # per launch (the profile's method_seconds; see StepCost.overheads)
    method: str = ""
    # ``elements`` are one micro-batch's, moved again for each micro-batch of gradient accumulation
    # (a weight gathered for each forward); otherwise the step's (activations: the step's tokens)
    each_micro_batch: bool = False
    # bytes an element, where they do not follow the compute dtype (fp32 weights and gradients
    # gathered or reduced under amp); None: the compute dtype's
    element_bytes: int | None = None
    # the elements are a decoder's residual stream (a pipeline stage's hidden states): in the
    # weights' dtype, which autocast leaves it in (a Hugging Face Llama's stages hand each other
    # fp32 under bf16 autocast), whatever the compute dtype
    stream: bool = False
    # launched once a step whatever the accumulation (a sync the loop holds until the last
    # micro-batch); otherwise ``messages`` are one micro-batch's
    per_step: bool = False


@dataclass
class StepCost:
    """One candidate's memory and step time per rank, built term by term.

    The job's facts come first (whole-model sizes, the layout's dims, one forward's FLOPs and
    saved activations on a per-data-rank batch); then each method's ``cost_term`` (its registry
    row) updates the fields below, in applied order: a layout method (tensor, pipeline) splits
    the model before a sharding method (zero, fsdp) divides what is left. No method is named here.
    """

    model: torch.nn.Module
    dims: dict[str, int]
    state_factor: float
    device_type: str = "cpu"
    forward_flops: float = 0.0  # one forward of the whole model on this rank's per-data-rank batch
    tokens: int = 0  # samples x positions in that batch
    absorbed: frozenset = frozenset()  # methods whose work another method in the strategy does
    methods: tuple = ()  # the names of the strategy's methods
    forward_ops: float = 0.0  # operators that forward dispatches (each costs the profile's op_seconds)
    # the optimizer's step, timed on this device (optimizer_seconds_per_byte; 0: not charged), and
    # the trainable bytes this rank's optimizer steps (a sharding method divides them)
    optim_seconds_per_byte: float = 0.0
    stepped: float = 0.0
    # the optimizer's step as a method chose it ("fused": fused_optimizer), and the fused step's
    # seconds per byte timed on this device (0: not timed; then NOMINAL_FUSED_SHARE of the default's)
    optim_impl: str = ""
    fused_optim_seconds_per_byte: float = 0.0
    # bytes a step copies between the device and its host (fsdp's CPU offload: shards in before
    # each gather, gradient shards out after each reduce-scatter), at the profile's host link
    host_transfer: float = 0.0
    # of forward_flops, those in attention kernels (they run at the profile's attention rate)
    attention_flops: float = 0.0
    # FLOPs a checkpoint runs again in backward beyond ``passes``, on the same batch as
    # forward_flops, and of them attention's: counted by the probe (the matmuls selective
    # checkpointing with keep_matmuls="every_other" recomputes; on meta tensors, what full
    # checkpointing recomputes: its forward up to the last saved tensor)
    recomputed_flops: float = 0.0
    recomputed_attention: float = 0.0
    # bytes one forward's operators without FLOPs read and write (ops.traffic), on the same batch
    # as forward_flops: at the profile's memory_bandwidth
    forward_traffic: float = 0.0
    # of it, the bytes that run whole on every tensor rank (norms, residual adds, the loss: outside
    # the regions tensor parallelism splits; ops.OpCounter.watch_regions), and how many times the
    # compute share those bytes are (tensor parallelism divides the rest only; sequence
    # parallelism splits them too)
    whole_traffic: float = 0.0
    whole_traffic_factor: float = 1.0
    # elements one forward's tensor-parallel layers copy around their collectives on this rank,
    # which the serial probe never saw: (a matmul's outputs, in the compute dtype; the residual
    # stream's, in the weights' dtype): run whole on every tensor rank
    tensor_copies: tuple = (0.0, 0.0)
    # memory, bytes per rank (see the module docstring's formula)
    params: float = 0.0
    grads: float = 0.0
    optim_state: float = 0.0
    step_temp: float = 0.0
    gathered: float = 0.0
    # weights gathered for forward only, freed as it ends (zero2 on FSDP2: the all-gather's output
    # buffer, beside the unsharded parameters it kept): alive at the moments without gradients
    forward_gathered: float = 0.0
    reduce_temp: float = 0.0  # see MemoryEstimate.reduce_temp
    # the lowest estimated / measured peak seen for such candidates, when below ESTIMATE_RATIO's
    # (a method whose memory the model under-counts lowers it: see candidate_ratio)
    estimate_low: float | None = None
    # share of the gradients alive at the activation peak (see MemoryEstimate.backward_grads)
    backward_grad_share: float = 0.0
    # gradients alive whole at every moment of backward (a moment whose gradient share is above
    # 0) instead of the rank's shard of them: FSDP2's unsharded gradients of the unit whose
    # backward runs and of the one being reduced, never more than the share of ``whole_grads``
    # (the rank's model piece's gradients, unsharded, in the dtype backward makes them) backward
    # has made by then; counted in MemoryEstimate.backward_grads
    unit_grads: float = 0.0
    whole_grads: float = 0.0
    activations: float = 0.0
    grad_buckets: bool = False  # DDP keeps a copy of the rank's gradients in its buckets
    buffers: float = 0.0  # allocated once by a backend and kept (DeepSpeed's gradient bucket)
    # autocast's low-precision copies of the weights a rank computes with, alive in forward and
    # backward (all of them at the forward's end)
    copies: float = 0.0
    # measured by the probe over forward and backward (atorch/auto/search/timeline.py): the step's
    # worst moments as (share of `activations`, share of `grads`, share of `copies`) alive; it
    # replaces backward_grad_share, a method's guess, when present
    activation_profile: tuple = ()
    # measured by the same probe: the spans of the units the methods' ``probe_units`` name, in the
    # order they ran (atorch.auto.search.timeline.UnitSpan); a pipeline's term builds its stages'
    # activations from them
    unit_spans: tuple = ()
    # what the methods did to the model, as shares and scales of the whole
    weight_scale: float = 1.0  # bytes per parameter relative to the model's own (half: 0.5)
    split: float = 1.0  # share of the parameters left on a rank by splitting layers (tensor)
    stage_share: float = 1.0  # share of the parameters on a rank's pipeline stages
    # a pipeline's busiest rank: (the units of each of its stages, microbatches);
    # a sharding beside the pipeline counts its collectives from it (fsdp.pipeline_sync)
    pipeline_stage: tuple | None = None
    # time
    compute_dtype: str = "fp32"  # "fp32" or "half": which matmul rate applies
    # bf16 step rate / fp32 step rate measured on this machine (speedup.py), used with the nominal
    # rates only (a profile has its own); None: the nominal half rate
    half_speedup: float | None = None
    # forward + backward in forwards' FLOPs (full checkpointing adds one where no probe counted its recompute)
    passes: float = 3.0
    # operators run again in backward beyond ``passes``, as a share of the forward's, without their
    # FLOPs: selective checkpointing recomputes the element-wise ones, not the matmuls
    recomputed_op_share: float = 0.0
    compute_share: float = 1.0  # share of the model's FLOPs a rank runs
    # operators a rank dispatches per pass, as a multiple of one forward's: a pipeline stage runs
    # its share of the layers once per microbatch
    op_share: float = 1.0
    # tensors the checkpointed blocks save per forward, each through the checkpoint's hooks (the
    # profile's checkpoint_save_seconds); the probe counts them, like forward_ops, per pass
    checkpointed_saves: float = 0.0
    # the data-parallel sync's collectives (sync_calls) come from a sharding wrapper's hooks (FSDP2:
    # each unit's gathers and reduce-scatter), each with the profile's wrapped_call_seconds of host
    # work around it
    sync_in_hooks: bool = False
    bubble: float = 0.0  # idle time of a pipeline schedule, as a fraction of the compute
    microbatches: int = 1  # a pipeline's microbatches a step (each runs the rank's layers once)
    # expert_parallel's load imbalance, ``(the experts' forward FLOPs a step, (token, choice) pairs
    # a step, expert group size)``: the busiest rank's excess is worked out per micro-batch, once
    # accumulation and microbatches are known (:meth:`imbalance_flops`)
    expert_imbalance: tuple | None = None
    # gradient accumulation: micro-batches per optimizer step (``auto_accelerate``'s
    # gradient_accumulation_steps). ``activations`` are one micro-batch's, ``forward_flops`` and
    # ``tokens`` the whole step's; each micro-batch dispatches the forward's operators and the
    # activation collectives (``comms``' messages) again, while the gradients are reduced once (a
    # method whose sync runs per micro-batch says so in its term)
    accumulation: int = 1
    # under accumulation, gradients kept apart from the ones backward makes (FSDP2's unsharded
    # accumulated gradients), alive at every moment; 0: they accumulate in place (DDP's .grad),
    # so every moment holds the rank's whole gradient term
    accumulated_grads: float = 0.0
    # how often a step's data-parallel sync moves the rank's model piece: "params", gathers (or
    # broadcasts) of its parameters; "grads", reductions of its gradients, each a ``grad_reduce``.
    # (Until 2026-11-29 "grads" 2 meant an all-reduce and 1 a reduce-scatter, so fsdp's reduce-
    # scatter every micro-batch, "grads" = the micro-batches, was costed as one all-reduce a step.)
    data_sync: dict = field(default_factory=dict)
    # the collective that reduces the gradients: DDP and zero1 all-reduce them, zero2 and fsdp
    # reduce-scatter them
    grad_reduce: str = "all_reduce"
    # share of the rank's model piece it holds apart from the data-parallel ranks: slices each rank
    # holds its own of (expert_parallel's experts), neither sharded by a sharding method nor synced
    # by the data-parallel sync (their method charges its own communication)
    held_apart: float = 0.0
    # ranks over which a sharding method still shards those slices (fsdp over the ranks that hold
    # the same experts: EP x FSDP); 1: kept whole
    apart_copies: int = 1
    # how many collectives of each kind that sync takes per step, each paying the link's latency:
    # a count (FSDP gathers and reduces unit by unit), or under "bucket_bytes" the bytes per
    # collective (DDP's gradient buckets); one per kind when neither is given
    sync_calls: dict = field(default_factory=dict)
    # the passes whose compute a data-sync collective can run behind, by kind: ("backward",) for
    # gradients reduced as backward makes them (DDP's buckets, FSDP2's reduce-scatters), ("forward",
    # "backward") for parameters gathered a unit ahead (FSDP2's prefetch); a kind not named waits
    # (zero1's broadcast after the step). The profile's ``overlap`` says how much of it does hide.
    sync_overlap: dict = field(default_factory=dict)
    # by kind, the share of those passes' compute such a collective can hide behind where not all
    # of it: a pipeline's sums start at its stages' last microbatch, so only the backward after
    # that is a window (a DDP bucket starts as backward fills it, in any micro-batch)
    sync_window: dict = field(default_factory=dict)
    # bytes of a data-sync collective's tensors per byte of the rank's model piece, by kind, when
    # not the model's own dtype (FSDP2 under amp gathers the parameters in amp's 2-byte dtype)
    sync_share: dict = field(default_factory=dict)
    comms: list = field(default_factory=list)  # other communication not overlapped with compute
    # a hardware profile (atorch/auto/search/profiles), named or calibrated on this machine
    # (atorch/auto/search/calibrate.py): its rates replace the nominal ones, a group that spans
    # nodes uses its inter-node link, and each collective its own measured rate when it has one
    profile: Any = None
    # host overhead units per step by method (the profile's ``method_seconds`` each, calibrated on
    # this machine: atorch/auto/search/calibrate.py): what a method's wrapping, hooks and Python
    # cost beyond the operators, FLOPs and collectives counted above. A method's cost term charges
    # them (``charge``): once a step, or per unit of what drives them (a tensor saved through a
    # checkpoint's hooks, a collective its hooks issue); a Comm with ``method`` charges one per
    # message. "step" is the training step's own (the loader, the optimizer's loop over
    # parameters, zero_grad), charged to every candidate.
    overheads: dict = field(default_factory=dict)

    def charge(self, method: str, units: float = 1.0, per_micro_batch: bool = False) -> None:
        """Charge ``units`` of ``method``'s calibrated host overhead to the step (replacing what it
        charged before), or with ``per_micro_batch`` to each micro-batch of gradient accumulation
        (whose term may run after this one)."""
        self.overheads[method] = (float(units), per_micro_batch)

    def overhead_units(self) -> dict:
        """Units of each method's host overhead per step: what the terms charged, plus one per
        message of each collective a method launches (over a group of more than one rank, per
        micro-batch)."""
        units = {name: n * (self.accumulation if each else 1) for name, (n, each) in self.overheads.items()}
        for c in self.comms:
            if c.method and self.size(c.dim) > 1:
                units[c.method] = units.get(c.method, 0.0) + self.comm_per_step(c)[0]
        return units

    def comm_per_step(self, comm: Comm) -> tuple[float, float]:
        """(collectives or sends, payload bytes) ``comm`` makes in a step of ``accumulation``
        micro-batches, its elements at :meth:`comm_element_bytes`."""
        calls = comm.messages * (1 if comm.per_step else self.accumulation)
        elements = comm.elements * (self.accumulation if comm.each_micro_batch else 1)
        return calls, elements * self.comm_element_bytes(comm)

    def host_overhead(self) -> float:
        """Seconds of the methods' calibrated host overheads per step (0 without a profile, or with
        one that has no ``method_seconds``)."""
        rates = getattr(self.profile, "method_seconds", None) or {}
        return sum(units * rates.get(name, 0.0) for name, units in self.overhead_units().items())

    @property
    def dp_size(self) -> int:
        return data_parallel_size(self.dims)

    def size(self, dim: str) -> int:
        return self.dims.get(dim, 1)

    def param_bytes(self, trainable_only: bool = False) -> int:
        return once(("param_bytes", id(self.model), trainable_only), lambda: sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad or not trainable_only))

    def param_numel(self) -> int:
        """Elements of the model's parameters (at least 1)."""
        return once(("param_numel", id(self.model)), lambda: max(sum(p.numel() for p in self.model.parameters()), 1))

    def comm_element_bytes(self, comm: Comm) -> float:
        """Bytes an element of ``comm`` moves, once every term has run (amp_native and half come
        after the layout methods that add the comms): its own width, the weights' dtype for a
        residual stream, else the compute dtype's."""
        if comm.element_bytes:
            return comm.element_bytes
        if comm.stream:
            return self.element_bytes()
        return self.compute_element_bytes()

    def compute_element_bytes(self) -> int:
        """Bytes an element of a matmul's output takes in the compute dtype."""
        return 2 if self.compute_dtype == "half" else 4

    def element_bytes(self) -> float:
        """Bytes per parameter element as the methods so far leave the weights (half: 2)."""
        return self.param_bytes() * self.weight_scale / self.param_numel()

    def shard_over_data(self, params: bool, grads: bool, optim: bool) -> None:
        """Divide what a sharding method splits over the data-parallel ranks (its step's
        temporaries follow the optimizer state)."""
        kept = self.held_apart / self.apart_copies + (1 - self.held_apart) / self.dp_size
        if params:
            self.params *= kept
        if grads:
            self.grads *= kept
        if optim:
            self.optim_state *= kept
            self.step_temp *= kept
            self.stepped *= kept

    def split_model(self, share: float) -> None:
        """Keep ``share`` of the parameters, gradients and optimizer state on this rank."""
        self.params *= share
        self.grads *= share
        self.optim_state *= share
        self.step_temp *= share
        self.stepped *= share

    def split_layers(self, removed: float) -> None:
        """A layout splits some weights: ``removed`` (a share of the whole model's parameters)
        leaves the rank's piece, from the weights no earlier split held apart (expert_parallel's
        slices stay whole on every tensor rank: their bytes stay, so ``held_apart``, a share of
        the piece, grows). Terms that split this way compose in either order."""
        share = 1 - removed / self.split
        self.split_model(share)
        self.split *= share
        self.held_apart /= share

    def grads_at(self, share: float) -> float:
        """Gradient bytes alive when backward has made ``share`` of them: the rank's shard of
        them, less what of it is still whole in the units ``unit_grads`` counts."""
        if share <= 0:
            return 0.0
        own = self.grads * share
        if not self.unit_grads:
            return own
        whole = min(self.unit_grads, share * self.whole_grads) if self.whole_grads else self.unit_grads
        return max(0.0, own - whole / self.dp_size) + whole

    def memory(self) -> "MemoryEstimate":
        moments = self.activation_profile or ((1.0, self.backward_grad_share, 1.0),)
        if self.accumulation > 1 and not self.accumulated_grads:  # the earlier micro-batches'
            moments = tuple((a, 1.0, c) for a, _, c in moments)  # gradients, alive at every moment
        # without a measured profile the one moment may be forward's end or late backward
        forward_only = lambda g: self.forward_gathered if g <= 0 or not self.activation_profile else 0.0  # noqa: E731
        acts, grads, copies, forward = max(((self.activations * a, self.grads_at(g), self.copies * c, forward_only(g))
                                            for a, g, c in moments), key=sum)
        bucketed = self.grads * (1 - self.held_apart)  # DDP leaves the slices held apart alone
        buckets = (bucketed if self.grad_buckets and self.dp_size > 1 else 0) + self.buffers
        if self.accumulation > 1:
            buckets += self.accumulated_grads
        return MemoryEstimate(math.ceil(self.params), math.ceil(self.grads), math.ceil(self.optim_state),
                              math.ceil(self.gathered + copies + forward), int(acts), math.ceil(self.step_temp),
                              self.forward_flops, math.ceil(grads), math.ceil(buckets), math.ceil(self.reduce_temp))

    def seconds(self) -> float:
        """compute (x the pipeline bubble) + communication not overlapped with it + the optimizer's
        step over what this rank steps, at nominal rates, or at the rates of ``profile`` when one
        is set (each collective at its own rate, and one latency per collective of the
        data-parallel sync: ``sync_calls``). Of a data-sync collective the method issues early
        (``sync_overlap``), the profile's ``overlap`` share hides behind the compute of its passes,
        up to that compute; nominal rates hide none."""
        if self.profile is None:
            rate = attention_rate = self.nominal_rate()
        else:
            rate, attention_rate = self.profile.rate(self.compute_dtype), self.profile.attention_rate(self.compute_dtype)
        attention = min(self.attention_flops, self.forward_flops)
        flops = self.forward_flops + self.imbalance_flops()
        compute = ((flops - attention) / rate + attention / attention_rate) * self.passes * self.compute_share
        again = self.recomputed_attention
        compute += ((self.recomputed_flops - again) / rate + again / attention_rate) * self.compute_share
        compute += self.traffic_seconds()
        # each operator's kernel costs the device a fixed time beyond its FLOPs (profile's kernel_seconds)
        op_passes = self.passes + self.recomputed_op_share
        launches = self.forward_ops * op_passes * self.op_share * self.accumulation
        compute += launches * (self.profile.kernel_seconds if self.profile is not None else 0.0)
        # framework overhead per operator: calibrated on this machine, none in a datasheet profile;
        # on a GPU the host issues operators while earlier kernels run: the slower of the two counts
        op_seconds = 0.0 if self.profile is None else self.profile.op_seconds
        hooks = wrapped = 0.0
        if self.profile is not None:
            hooks = self.checkpointed_saves * self.profile.checkpoint_save_seconds
            if self.sync_in_hooks:
                wrapped = sum(self.sync_calls.values()) * self.profile.wrapped_call_seconds
        overhead = (self.forward_ops * op_passes * op_seconds + hooks) * self.op_share * self.accumulation + wrapped
        # the methods' calibrated host overheads: fit to whole steps (a pipeline's bubble included),
        # so on a CPU they are added to the step after the bubble, not scaled by it
        host = self.host_overhead()
        on_device = self.device_type == "cuda"
        compute = max(compute, overhead + host) if on_device else compute + overhead
        # what a collective can hide behind: each pass's compute, shared by the collectives in it
        hides = 0.0 if self.profile is None else self.profile.overlap
        windows = {"forward": compute / self.passes, "backward": compute * (self.passes - 1) / self.passes}
        dp = self.dp_size
        comm = 0.0
        for kind, payload, calls in self.data_sync_collectives():
            wire = payload * (2 if kind == "all_reduce" else 1) * (dp - 1) / dp
            bandwidth, latency = self._link(DATA_PARALLEL_DIMS, kind)
            seconds = wire / bandwidth + latency * calls
            hidden = 0.0
            for phase in self.sync_overlap.get(kind, ()):
                behind = min(seconds * hides - hidden, windows[phase] * self.sync_window.get(kind, 1.0))
                windows[phase] -= behind
                hidden += behind
            comm += seconds - hidden
        for kind, payload, calls in self.loss_count_collectives():  # blocking, before the backward: not hidden
            bandwidth, latency = self._link(DATA_PARALLEL_DIMS, kind)
            comm += payload * 2 * (dp - 1) / dp / bandwidth + latency * calls
        for c in self.comms:
            if self.size(c.dim) > 1:
                bandwidth, latency = self._link((c.dim,), c.kind)
                calls, payload = self.comm_per_step(c)
                comm += payload * c.factor / bandwidth + calls * latency
        if self.host_transfer and self.profile is not None and self.profile.host_link_bandwidth:
            comm += self.host_transfer / self.profile.host_link_bandwidth  # not overlapped: a bound from above
        return compute * self.bubble_factor() + comm + self.stepped * self.optimizer_rate() + (0.0 if on_device
                                                                                                 else host)

    def optimizer_rate(self) -> float:
        """Seconds the optimizer's step takes per byte it updates, as the methods chose the step."""
        if self.optim_impl == "host" and self.profile is not None and self.profile.host_optimizer_seconds_per_byte:
            return self.profile.host_optimizer_seconds_per_byte  # fsdp's CPU offload: the step runs on the host
        if self.optim_impl != "fused":
            return self.optim_seconds_per_byte
        return self.fused_optim_seconds_per_byte or self.optim_seconds_per_byte * NOMINAL_FUSED_SHARE

    def nominal_rate(self) -> float:
        """FLOP/s of the compute dtype without a profile: the nominal rate, or under ``half`` the
        nominal fp32 rate x the bf16 speedup measured on this machine, where it was (speedup.py)."""
        rates = _FLOPS.get(self.device_type, _FLOPS["cpu"])
        if self.compute_dtype == "half" and self.half_speedup is not None:
            return rates["fp32"] * self.half_speedup
        return rates[self.compute_dtype]

    def imbalance_flops(self) -> float:
        """The FLOPs expert_parallel's busiest rank adds to a step's forward: the experts' FLOPs x
        its expected excess over the mean for one micro-batch's (token, choice) pairs (under
        gradient accumulation and in pipeline microbatches each layer waits per micro-batch)."""
        if self.expert_imbalance is None:
            return 0.0
        from atorch.auto.load_imbalance import busiest_excess

        experts_flops, pairs, size = self.expert_imbalance
        return experts_flops * busiest_excess(pairs / max(self.accumulation * self.microbatches, 1), size)

    def traffic_seconds(self) -> float:
        """Seconds the operators without FLOPs take at the profile's ``memory_bandwidth`` (0 without
        one: a CPU's calibration fits them into its per-operator overhead instead): one forward's
        bytes read and written, over each pass like the FLOPs, and again for the operators run
        again in backward (``recomputed_op_share``: selective checkpointing recomputes the
        element-wise operators, whose bytes these are; measured on CPU, its backward moves as many
        more bytes as full checkpointing's: tests/auto/search/test_traffic.py)."""
        bandwidth = getattr(self.profile, "memory_bandwidth", 0.0)
        if not bandwidth:
            return 0.0
        return self.rank_traffic() * (self.passes + self.recomputed_op_share) / bandwidth

    def rank_traffic(self) -> float:
        """Bytes one forward's operators without FLOPs move on this rank: the probe's, split as the
        compute is, except those that run whole on every tensor rank (``whole_traffic``), and the
        copies the tensor layers make (``tensor_copies``, already the rank's)."""
        computed, stream = self.tensor_copies
        copies = computed * self.compute_element_bytes() + stream * self.element_bytes()
        whole = self.whole_traffic * (self.whole_traffic_factor - 1)
        return (self.forward_traffic + whole) * self.compute_share + copies

    def bubble_factor(self) -> float:
        """What a pipeline's bubble makes of a rank's compute: 1 + the bubble, or, on a CPU whose
        cores the ranks share (the profile's ``ranks_per_core``, r), the larger of the rank's own
        compute at the shared rate and the schedule's critical path at the rate of a core of its
        own, (1 + bubble) / r: while a rank waits in the bubble, the others run on its share. On
        search_quality's BERT and GPT-2 (4 ranks on 2 cores, r = 2), pipeline=4 with 4
        microbatches (bubble 0.75) measured 0.5-0.8 of an estimate with the whole bubble, and as
        fast as data=4."""
        shared = 1.0 if self.profile is None or self.device_type == "cuda" else self.profile.ranks_per_core
        return max(1.0, (1 + self.bubble) / shared)

    def data_sync_collectives(self) -> list[tuple[str, float, float]]:
        """The data-parallel sync per step as ``(kind, payload bytes, collectives)``: the tensors
        handed to the collectives (an all-gather's whole output), summed over the step. Parameters
        are gathered (or broadcast) ``data_sync["params"]`` times, gradients reduced
        ``data_sync["grads"]`` times by a ``grad_reduce``."""
        if self.dp_size <= 1:
            return []
        synced = self.weight_scale * self.split * self.stage_share * (1 - self.held_apart)
        piece, trainable = self.param_bytes() * synced, self.param_bytes(True) * synced
        grads, params = self.data_sync.get("grads", 0), self.data_sync.get("params", 0)
        out = []
        for kind, payload, times in (("all_gather", piece, params), (self.grad_reduce, trainable, grads)):
            if times:
                payload *= self.sync_share.get(kind, 1.0)
                out.append((kind, payload * times, self._calls(kind, payload)))
        return out

    def loss_count_collectives(self) -> list[tuple[str, float, float]]:
        """The step's loss normalization (atorch/loss/step.py) as ``(kind, payload bytes,
        collectives)``: one all-reduce of ``[count, sum, samples]`` (3 float64) over the data
        ranks a step, whatever the accumulation."""
        return [("all_reduce", 24.0, 1.0)] if self.dp_size > 1 else []

    def _calls(self, kind: str, payload: float) -> float:
        """Collectives of ``kind`` in the data-parallel sync of ``payload`` bytes (the gradients
        or parameters synced, not the ring's traffic) per step."""
        if kind in self.sync_calls:
            return max(1.0, self.sync_calls[kind])
        bucket = self.sync_calls.get("bucket_bytes")
        return max(1.0, math.ceil(payload / bucket)) if bucket else 1.0

    def _link(self, dims, kind: str | None = None) -> tuple[float, float]:
        """(bandwidth, latency) of collective ``kind`` over a group of ``dims``: nominal by device,
        or the profile's link for the ranks the group spans (``self.dims`` run innermost first,
        ranks node by node)."""
        if self.profile is None:
            return (_BANDWIDTH.get(self.device_type, _BANDWIDTH["cpu"]), _LATENCY.get(self.device_type, _LATENCY["cpu"]))
        span, reached, members = 1, 1, 1
        for name, size in self.dims.items():
            span *= size
            if name in dims:
                reached, members = span, members * size
        if reached <= self.profile.gpus_per_node:
            # inside one node a group runs at its own size's measured rate: the data group of
            # pipeline=2 x data=2 is 2 ranks 2 apart, not the 4 its ranks span (its 20 all-reduces
            # were costed at 4 ranks' latency, 7x the 2 ranks')
            reached = members
        link = self.profile.link(reached, kind, members)
        return link.bandwidth, link.latency
