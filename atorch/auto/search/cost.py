"""The cost model: peak memory per rank of a candidate, estimated before anything runs.

peak = parameters + optimizer state + DDP's buckets
       + max(gathered weights + activations, gradients + step temporaries)

Parameters, gradients and optimizer state are divided by the shards a method splits them over;
gathered weights are the largest FSDP unit twice (the current one and the prefetched one), or
autocast's low-precision weight copies: both live during forward and backward only, not at the
optimizer step (an amp + checkpoint estimate was 1.20 of measured while they were counted at it).
DDP copies the gradients into buckets it allocates once (as large as the gradients).
Activations and gradients share the last term because
``zero_grad(set_to_none=True)`` frees gradients before forward, and backward frees activations
about as fast as it creates gradients; at the optimizer step the gradients are joined by the
step's temporaries (on an accelerator the foreach implementations build one intermediate per
parameter shard; on a CPU the step goes parameter by parameter). Activations are measured, not guessed: one forward of a copy
of the model, with the candidate's module rewrites and checkpointing applied, on one per-rank
micro-batch, counting the bytes autograd saves (on the meta device when no real memory may be
used). The formula's terms are kept apart so the report can show where the memory goes.
"""

import contextlib
import copy
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from atorch.auto.context import run_model
from atorch.auto.registry import Stage, absorbed_methods, get_method
from atorch.auto.step_cost import _BANDWIDTH, _FLOPS, _LATENCY, Comm, MemoryEstimate, StepCost  # noqa: F401
from atorch.auto.strategy import Strategy
from atorch.utils.log import logger
from atorch.utils.sizes import parse_bytes  # noqa: F401 - its old home

# How far the memory estimate may be from the measured peak, as estimated / measured: the bounds
# tests/auto/search/test_cost.py holds it to. Measured: 0.90-1.16 on the transformers of
# docs/benchmarks.md, up to 1.21 on the sharded residual MLP of tests/auto/search/test_boundary.py.
# The search prunes a candidate only when its estimate is over the budget by more than the upper
# bound, and trusts an estimate that it fits (with no measured peak) only under the lower one.
ESTIMATE_RATIO = (0.8, 1.25)


# The lowest estimated / measured peak seen on any workload, with a margin: 0.35 on checkpointed
# candidates of benchmarks/search_quality.py's deep-narrow and 0.65 on its bf16 tensor x pipeline
# ones (2026-11-24), far under ESTIMATE_RATIO's 0.8. The probe now measures the backward, which
# brought the data-parallel candidates to 0.90-1.13, but layouts still scale its activations by
# formula. A candidate whose peak was not measured (a dry run the time limit cut short, a tracker
# that failed) is taken to fit a budget only under this bound: an estimate never returns a
# strategy over the budget.
ESTIMATE_FLOOR = 0.3


def fits_unmeasured(estimate: int | None, budget: int) -> bool:
    """Within ``budget`` even if the estimate is as low as any ever measured (ESTIMATE_FLOOR)."""
    return estimate is not None and estimate / ESTIMATE_FLOOR <= budget


def candidate_ratio(ratio: tuple[float, float], estimate: "StepCost | None") -> tuple[float, float]:
    """The search's estimate error bounds for one candidate: lower where one of its methods says
    its estimates run lower (``StepCost.estimate_low``, set by the method's cost term) and the
    probe did not measure the step's backward (``StepCost.activation_profile``), which is what
    such a method's guess stands in for."""
    low = None if estimate is None or estimate.activation_profile else estimate.estimate_low
    return (ratio[0] if low is None else min(ratio[0], low), ratio[1])


def surely_over(estimate: int | None, budget: int, ratio: tuple[float, float] = ESTIMATE_RATIO) -> bool:
    """Over ``budget`` even if the estimate is as high as it is ever measured to be."""
    return estimate is not None and estimate / ratio[1] > budget


def surely_fits(estimate: int | None, budget: int, ratio: tuple[float, float] = ESTIMATE_RATIO) -> bool:
    """Within ``budget`` even if the estimate is as low as it is ever measured to be."""
    return estimate is not None and estimate / ratio[0] <= budget


def optimizer_state_factor(optim_func, optim_args: dict) -> float:
    """Bytes of optimizer state per byte of trainable fp32 parameter (Adam: 2, SGD: 0 or 1)."""
    if optim_func is None:
        return 0.0
    param = torch.nn.Parameter(torch.zeros(64))
    optim = optim_func([param], **optim_args)
    param.grad = torch.ones_like(param)
    optim.step()
    state = sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values()
                if torch.is_tensor(v) and v.ndim > 0)
    return state / (param.numel() * param.element_size())


# fp32 elements of the two parameters whose steps are timed. A GPU's are larger: at 1 and 8 MiB an
# H200's AdamW step is its launches, and the slope read 2.6e-11 s a byte, 15x what the memory's
# bandwidth takes (a 1.1B Llama's step estimated 114 ms of optimizer in a 195 ms step).
OPTIMIZER_PROBE_ELEMENTS = {"cpu": (2**18, 2**21), "cuda": (2**22, 2**25)}
# Timed steps of each, after the step that creates the state (which warms it up): every search
# pays for them, 0.21-0.30 s of search_quality's tensor-best search with 5 and a warm-up step more.
OPTIMIZER_REPEATS = 5


def optimizer_seconds_per_byte(optim_func, optim_args: dict, device: torch.device) -> float:
    """Seconds the optimizer's step takes per byte of fp32 parameter it updates, timed on this
    device: the slope between the steps of two parameters (OPTIMIZER_PROBE_ELEMENTS: 1 and 8 MiB on
    a CPU, 16 and 128 MiB on a GPU; each the fastest of OPTIMIZER_REPEATS, every rank stepping at
    once, the slowest rank's, after the step that creates the state), so a fixed cost per step (a
    GPU's launches) is not scaled up with the model. 0 when it cannot be timed (no optimizer, or
    one that needs more than parameters and a gradient)."""
    if optim_func is None:
        return 0.0
    try:
        sizes = OPTIMIZER_PROBE_ELEMENTS.get(device.type, OPTIMIZER_PROBE_ELEMENTS["cpu"])
        seconds = [_optimizer_step_seconds(optim_func, optim_args, device, n) for n in sizes]
    except Exception as error:  # noqa: BLE001 - an optimizer this cannot step is simply not timed
        logger.debug("optimizer step not timed: %s", error)
        return 0.0
    small, large = (4 * n for n in sizes)
    slope = (seconds[1] - seconds[0]) / (large - small)
    return slope if slope > 0 else seconds[1] / large  # noisy timings: the large step's mean


def _optimizer_step_seconds(optim_func, optim_args: dict, device: torch.device, elements: int) -> float:
    from atorch.auto.search.timing import median_seconds

    param = torch.nn.Parameter(torch.zeros(elements, device=device))
    param.grad = torch.full_like(param, 1e-3)
    optim = optim_func([param], **optim_args)
    optim.step()  # creates the state, and warms up
    # every rank steps at once, as in training: ranks that drifted apart timed their steps with
    # the cores to themselves or shared, and three searches of search_quality's MLP read 71, 111
    # and 136 ms for one step of its 34 MB under Adam (plain DDP's and zero1's order turned on it).
    # The fastest repetition: with the median, one search of its residual MLP still put that step
    # at 283 ms and a re-estimate minutes later at 108, where every rank stepping 34 MB in 8
    # tensors at once took 66 ms (median of 5, all ranks in step).
    together = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return median_seconds(device, optim.step, group=together, repeats=OPTIMIZER_REPEATS, warmup=False,
                          fastest=True)


class _SavedBytes:
    """Counts the bytes autograd saves for backward (each storage once), by dtype.

    A saved tensor that shares a parameter's storage is a weight, not an activation: ``F.linear``
    saves ``weight.t()``, a view that is no ``nn.Parameter``. Counted, every sequence of a plan
    carried a copy of the linear weights (12.3 GiB per 7B sequence under amp). Nor is autocast's
    low-precision copy of a weight (``_to_copy`` of a parameter, recorded by :meth:`casts`): the
    cost model counts those apart (``StepCost.copies``). Storages are told apart by their C++
    object, which views share on every device, meta included."""

    def __init__(self, weights: Iterable[torch.Tensor] = ()):
        self.by_dtype: dict[torch.dtype, int] = {}
        self.weights: set = {_storage_key(w) for w in weights}
        self._seen: set = set()
        self.packed = 0  # tensors saved (parameters and repeats included): what a checkpoint's hooks would see
        self._kept: list[torch.Tensor] = []  # what selective checkpointing keeps (see kept)
        self._casts: list[torch.Tensor] = []  # weight casts reported by meta_autocast (see weight_cast)
        self.recomputed_flops = 0  # what a checkpoint's backward runs again (see recomputed)
        self.recompute_uncounted = False
        self.recomputed_attention = 0  # of them, attention's

    def pack(self, tensor: torch.Tensor):
        self.packed += 1
        key = _storage_key(tensor)
        if key not in self._seen and key not in self.weights and not isinstance(tensor, torch.nn.Parameter):
            self._seen.add(key)
            self.by_dtype[tensor.dtype] = self.by_dtype.get(tensor.dtype, 0) + tensor.untyped_storage().nbytes()
        # Detached: the same storage stays alive with the graph (so no later tensor reuses its
        # address while counting), but without its grad_fn. Returning the tensor itself would tie
        # an op's saved output to the node that saves it, a cycle through C++ that the garbage
        # collector cannot see: every probe kept its model copy's parameters and activations.
        return tensor.detach()

    def kept(self, output) -> None:
        """Count what selective checkpointing keeps of an op (its outputs, in torch's own cache,
        out of the hooks' sight: ``atorch.methods.checkpoint.selective_policy`` reports them)."""
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                packed = self.packed
                # kept alive with the counter, as pack's are with the graph: a freed storage's
                # address could come back for a later output, which would then count as seen
                self._kept.append(self.pack(tensor))
                self.packed = packed  # not a tensor through the hooks

    def recomputed(self, flops: int | None, attention: int | None) -> None:
        """Count FLOPs a checkpoint will run again in backward, and of them attention's (the
        matmuls ``atorch.methods.checkpoint.every_other_matmul_policy`` recomputes; full
        checkpointing's, ``checkpoint.full_recompute_flops``). None: a block's could not be
        counted, and none are reported (the cost then charges the whole forward again)."""
        if flops is None:
            self.recompute_uncounted = True
            return
        self.recomputed_flops += flops
        self.recomputed_attention += attention

    def weight_cast(self, _weight: torch.Tensor, cast: torch.Tensor) -> None:
        """Count ``cast`` (amp_native's emulated autocast's copy of a weight, on meta tensors) as
        a weight, and hold it while counting: freed, its storage address could come back for an
        activation, which would then go uncounted (as :class:`_WeightCasts` holds autocast's)."""
        self.weights.add(_storage_key(cast))
        self._casts.append(cast)

    def casts(self) -> "_WeightCasts":
        """A dispatch mode that adds each cast of a weight to the weights."""
        return _WeightCasts(self.weights)


class _WeightCasts(TorchDispatchMode):
    """Each cast is held until the mode exits: autocast drops its cache of casts when the model's
    forward leaves autocast, and a later tensor (the loss's 4-byte total weight) could then get a
    freed cast's storage address and go uncounted in one run and counted in the next."""

    def __init__(self, weights: set):
        super().__init__()
        self.weights = weights
        self._held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket is torch.ops.aten._to_copy and _storage_key(args[0]) in self.weights:
            self.weights.add(_storage_key(out))
            self._held.append(out)
        return out

    def __exit__(self, *exc):
        self._held.clear()
        return super().__exit__(*exc)


@contextlib.contextmanager
def _counting_selective(counter: "_SavedBytes", on_meta: bool):
    """On meta tensors, what selective checkpointing keeps is counted as saved (see ``kept``);
    on real tensors the probe's timeline sees those allocations itself. On both, the FLOPs a
    checkpoint's backward will run again are counted (see ``recomputed``)."""
    from atorch.methods.checkpoint import _SelectiveCount

    before = _SelectiveCount.active, _SelectiveCount.recomputed
    _SelectiveCount.active = counter.kept if on_meta else None
    _SelectiveCount.recomputed = counter.recomputed
    try:
        yield
    finally:
        _SelectiveCount.active, _SelectiveCount.recomputed = before


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage, shared by its views (meta tensors included)."""
    return tensor.untyped_storage()._cdata


def free_copy(model: torch.nn.Module, extra: Iterable = ()) -> None:
    """Give back the memory of a model copy the search is done with: its parameters, buffers and
    their gradients, and the tensors in ``extra`` (its optimizer state).

    Something may keep the tensor objects alive after the copy is dropped: torch's MemTracker
    (once the dry runs' tracker) leaves a reference to each parameter it saw, from C++, and a
    checkpointed block's autograd
    node holds its forward (the module) in a cycle through C++ that the garbage collector cannot
    see. A layout search over a big model probes and dry-runs dozens of copies in one process,
    so their storage is released here, whoever keeps the objects.
    """
    from torch.distributed.tensor import DTensor

    tensors = list(extra)
    for t in itertools.chain(model.parameters(), model.buffers()):
        tensors += [t, t.grad]
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if torch.is_tensor(local) and local.device.type != "meta":
            try:
                local.untyped_storage().resize_(0)
            except RuntimeError:  # a storage that cannot be resized (borrowed from elsewhere): left to gc
                pass


def _saved_bytes(model, strategy, batch, model_input_format, loss_func, device_ctx, stages,
                 counts: list | None = None) -> tuple[int, int]:
    """(bytes saved for backward, number of checkpointed modules) of one forward of a copy; the
    forward's FLOPs, its operator count, then (on real tensors, with a loss) the step's
    activations at the end of forward and their profile over backward
    (:mod:`atorch.auto.search.timeline`), then the tensors saved outside checkpoints and the
    spans of the units the methods name (``probe_units``) are appended to ``counts`` when given."""
    from atorch.auto.context import ModelContext, move_to_device
    from atorch.auto.search import ops
    from atorch.auto.search.timeline import StepTimeline
    from atorch.methods.checkpoint import CheckpointedForward

    probe = copy.deepcopy(model)
    op_counter = ops.OpCounter()
    try:
        ctx = ModelContext(model=probe, device_ctx=device_ctx, loss_func=loss_func, prepare_input=move_to_device)
        _apply_probed(ctx, strategy, stages)
        checkpointed = sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in probe.modules())
        # the weights as the rewrites left them: what autograd saves of them is not an activation
        counter = _SavedBytes(itertools.chain(ctx.model.parameters(), ctx.model.buffers()))
        # the parameters and buffers alone, alive through the probe: a cast of one (which joins
        # counter.weights) may be freed and its address reused by an activation, which would then
        # go uncounted in one run and counted in the next (two ranks' probes disagreed)
        op_counter.weights = set(counter.weights)
        on_meta = any(p.is_meta for p in probe.parameters())
        _count_weight_casts_as_weights(probe, counter)
        # a CPU's profiles have no memory bandwidth to charge it at (StepCost.traffic_seconds)
        op_counter.count_traffic = on_meta or device_ctx.device.type != "cpu"
        if not on_meta:  # a plan on the meta device keeps its meta inputs
            batch = ctx.prepare_input(batch, device_ctx.device)
        timeline, forward_end, loss = StepTimeline(probe), 0, None
        watched = [] if on_meta else timeline.watch(probe, _probe_units(probe))
        if op_counter.count_traffic:  # what of the traffic a tensor-parallel rank moves whole
            from atorch.parallel_layers.auto_shard import split_regions

            watched += op_counter.watch_regions(ctx.model, split_regions(ctx.model))
        # on meta tensors nothing is allocated and no backward runs: no timeline to keep (its
        # dispatch mode was two thirds of a 70B plan's probe)
        with timeline if not on_meta else contextlib.nullcontext():
            casts = counter.casts() if not on_meta else contextlib.nullcontext()  # autocast does nothing on meta
            selective = _counting_selective(counter, on_meta)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), op_counter, casts, selective:
                output = run_model(ctx.model, batch, model_input_format)
                if loss_func is not None:
                    loss = loss_func(batch, output)
                    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
            held = len(timeline.events)
            del output  # as a training step drops it once the loss is computed
            forward_end = len(timeline.events)
            # what that freed (a pipeline's last stage holds it until the microbatch's backward)
            output_bytes = -sum(size for _, size, _ in timeline.events[held:forward_end] if size < 0)
            if not on_meta and torch.is_tensor(loss) and loss.requires_grad:
                loss.backward()
            else:
                loss = None
        for handle in watched:
            handle.remove()
        profile, spans = (0, ()), ()
        if loss is not None and forward_end:
            profile, spans = _step_profile(timeline, probe, forward_end, output_bytes)
        del loss
    finally:  # a probe that raised is given back too
        free_copy(probe)
    if counts is not None:
        counts.extend([op_counter.flops, op_counter.count, profile, counter.packed, spans,
                       op_counter.attention_flops, op_counter.traffic, op_counter.whole_traffic,
                       *((0, 0) if counter.recompute_uncounted else (counter.recomputed_flops,
                                                                      counter.recomputed_attention))])
    saved = _with_activation_terms(strategy, stages, counter.by_dtype) if on_meta else counter.by_dtype
    return sum(saved.values()), checkpointed


def _count_weight_casts_as_weights(probe: torch.nn.Module, counter: "_SavedBytes") -> None:
    """amp_native's emulated autocast on meta tensors (atorch/amp/meta_autocast.py) reports each
    cast of a weight, as :meth:`_SavedBytes.casts` does of autocast's on a real device."""
    from atorch.amp.meta_autocast import MetaAutocastForward

    for module in probe.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, MetaAutocastForward):
            forward.on_weight_cast = counter.weight_cast


def _apply_probed(ctx, strategy: Strategy, stages) -> None:
    """The probed methods' hooks of ``stages`` run on the probe's copy (an absorbed method's by
    its ``absorbed_probe``)."""
    absorbed = absorbed_methods(strategy)
    for name, config in strategy.items():
        spec = get_method(name)
        if name in absorbed and spec.absorbed_probe is not None and any(s in stages for s in spec.hooks):
            spec.absorbed_probe(ctx, config)
        for stage, hook in spec.hooks.items():
            if stage in stages and spec.probed and not (name in absorbed and stage in spec.skipped_when_absorbed):
                hook(ctx, config)


def _step_profile(timeline, probe: torch.nn.Module, forward_end: int, output_bytes: int) -> tuple:
    """The step's activation profile (at the end of forward, and its envelope over backward) and
    the units' spans, from the probe's timeline once backward has run."""
    from atorch.auto.search.timeline import envelope

    grads = [p.grad for p in probe.parameters() if p.grad is not None]
    moments = timeline.moments(grads)
    forward = [m for m in moments if m[3] < forward_end]
    reference = max((m[0] for m in forward), default=0)
    copies = max((m[2] for m in forward), default=0)
    grad_bytes = sum(g.untyped_storage().nbytes() for g in grads)
    profile = (reference, envelope([m[:3] for m in moments], grad_bytes, copies, reference))
    return profile, timeline.unit_spans(grads, forward_end, reference, output_bytes)


def _with_activation_terms(strategy: Strategy, stages, saved: dict) -> dict:
    """Meta tensors show what a method does to shapes, not to dtypes (autocast does nothing on
    them): each method the probe applied that has an activation term adds it here."""
    for name, config in strategy.items():
        spec = get_method(name)
        if spec.activation_term is not None and any(stage in stages for stage in spec.hooks):
            saved = spec.activation_term(config, saved)
    return saved


def _probe_units(model: torch.nn.Module) -> list[str]:
    """The modules whose spans a probe records: what the methods' ``probe_units`` name (a method
    that cannot split this model names none)."""
    from atorch.auto.registry import all_methods

    names: list[str] = []
    for spec in all_methods():
        if spec.probe_units is not None:
            try:
                names += [n for n in spec.probe_units(model) if n not in names]
            except Exception as error:  # noqa: BLE001 - a model the method cannot split
                logger.debug("%s records no unit spans: %s", spec.name, error)
    return names


def batch_tokens(batch: Any) -> int:
    """Samples x positions in a batch, read from its first tensor: all its elements when it holds
    token ids, all but the last (feature) dim when it holds floats."""
    first = batch
    while not torch.is_tensor(first):
        if isinstance(first, dict) and first:
            first = next(iter(first.values()))
        elif isinstance(first, (list, tuple)) and first:
            first = first[0]
        else:
            return 0
    if first.is_floating_point() and first.ndim > 1:
        return first.numel() // first.shape[-1]
    return first.numel()


PROBED_STAGES = (Stage.REWRITE, Stage.MEMORY)  # the stages whose hooks a probe applies to its copy


def _probe_applies(spec) -> bool:
    """Whether a probe applies the method's hooks, or (on meta tensors) its activation term."""
    return spec.probed or spec.activation_term is not None


def _applied(strategy: Strategy, stages) -> tuple:
    """What a probe at ``stages`` applies to its copy: each method's name, config and hooks (or,
    absorbed by another method, what that one does in its place)."""
    applied = []
    absorbed = absorbed_methods(strategy)
    for name, config in strategy.items():
        hooks = tuple(str(stage) for stage in get_method(name).hooks if stage in stages)
        if name in absorbed:
            hooks = ("absorbed", *hooks)
        if _probe_applies(get_method(name)) and hooks:
            applied.append((name, config.model_dump_json(), hooks))
    return tuple(applied)


@dataclass(frozen=True)
class ProbeFailed:
    """A probe that raised, kept in the memo in its place (it ran on another rank)."""

    error: str


def probe_key(strategy: Strategy, batch: Any, stages) -> tuple:
    """What a probe depends on besides the model: the batch (by id: keep it alive) and what the
    probe applies, so candidates that differ only in what a probe does not apply (sharding,
    layouts) share one, and a checkpointed candidate's forward without checkpointing is its plain
    twin's."""
    return (id(batch), _applied(strategy, stages))


def probe_stages(strategy: Strategy) -> list[tuple]:
    """The stages of the probes :func:`activation_bytes` may run for ``strategy``: every probed
    stage, and the rewrites alone when a memory hook applies (a checkpointed forward's operators
    are the plain forward's)."""
    stages = [PROBED_STAGES]
    if _applied(strategy, (Stage.REWRITE,)) != _applied(strategy, PROBED_STAGES):
        stages.append((Stage.REWRITE,))
    return stages


def probe_once(model, strategy, batch, model_input_format, loss_func, device_ctx, stages) -> tuple:
    """One probe (:func:`_saved_bytes`): its value and its counts, as the memo keeps them. On meta
    tensors, a model of n identical blocks is probed with one and with two of them and the counts
    extrapolated (:mod:`atorch.auto.search.shallow`)."""
    from atorch.auto.search import shallow
    from atorch.parallel_layers.experts import expected_load

    meta = any(p.is_meta for p in model.parameters())
    blocks = shallow.repeated_blocks(model) if meta else None
    # on meta, routed experts cannot route (the choice is data): they run at their expected load
    with expected_load(model) if meta else contextlib.nullcontext():
        if blocks is None:
            counted: list = []
            return _saved_bytes(model, strategy, batch, model_input_format, loss_func, device_ctx, stages,
                                counted), counted
        probes = []
        for keep in (1, 2):
            with shallow.truncated(blocks, keep):
                counted = []
                probes.append((_saved_bytes(model, strategy, batch, model_input_format, loss_func, device_ctx,
                                            stages, counted), counted))
    return shallow.extrapolate(probes[0], probes[1], len(blocks))


def _probe(memo: dict | None, model, strategy, batch, model_input_format, loss_func, device_ctx, stages,
           counts: list | None = None) -> tuple[int, int]:
    """:func:`_saved_bytes`, run once per :func:`probe_key` when ``memo`` is a dict (which a search
    may have filled beforehand, its probes shared out over the ranks)."""
    memo = {} if memo is None else memo
    key = probe_key(strategy, batch, stages)
    if key not in memo:
        memo[key] = probe_once(model, strategy, batch, model_input_format, loss_func, device_ctx, stages)
    if isinstance(memo[key], ProbeFailed):
        raise RuntimeError(f"the probe failed: {memo[key].error}")
    value, counted = memo[key]
    if counts is not None:
        counts.extend(counted)
    return value


def activation_bytes(model: torch.nn.Module, strategy: Strategy, batch: Any, model_input_format, loss_func,
                     device_ctx, counts: list | None = None, memo: dict | None = None) -> int:
    """Bytes of activations at the forward's peak, under the candidate's module rewrites and
    checkpointing (parameters excluded). On real tensors with a loss, the probe also runs backward
    and measures them (:mod:`atorch.auto.search.timeline`); otherwise they are the bytes one
    forward of a copy saves, plus, with checkpointing, one checkpointed block's activations
    recomputed during backward. The forward's FLOPs, its operator count, the profile of the
    activations and gradients over backward (``StepCost.activation_profile``; empty when not
    measured), the tensors saved through a checkpoint's hooks, then the units' spans
    (``StepCost.unit_spans``; empty when not measured) are appended to ``counts`` when given; with
    a ``memo`` dict, probes the same as one already run are not run again (:func:`_probe`)."""
    counted: list = []
    saved, checkpointed = _probe(memo, model, strategy, batch, model_input_format, loss_func, device_ctx,
                                 PROBED_STAGES, counted)
    flops, ops, (reference, profile), packed, spans, attention, traffic, whole, recomputed, again = counted
    hooked = 0
    if checkpointed:
        plain: list = []
        full, _ = _probe(memo, model, strategy, batch, model_input_format, loss_func, device_ctx, (Stage.REWRITE,),
                         plain)
        if not profile:
            saved += max(full - saved, 0) // checkpointed
        # A checkpointed block's operators and saved tensors are out of the counters' sight, inside
        # the checkpoint (193 of 267 operators on a small Llama): the forward's operators are the
        # plain forward's, and the tensors it saves that this one did not went through the hooks.
        ops, hooked = plain[1], max(plain[3] - packed, 0)
        # Checkpointing never changes the forward's work (its recompute is the cost term's): on
        # meta tensors the counter saw a selective checkpoint's matmuls twice (a 7B step's 124.8
        # TFLOP where the plain forward does 62.9), so the forward's FLOPs and traffic are the
        # plain forward's too.
        flops, attention, traffic, whole = plain[0], plain[5], plain[6], plain[7]
    if profile:
        saved = reference
    if counts is not None:
        counts.extend([flops, ops, profile, hooked, spans, attention, traffic, whole, recomputed, again])
    return saved


def scaled_counts(counts: list, scale: float) -> list:
    """A probe's counts (as :func:`activation_bytes` appends them) for ``scale`` times the sequences
    it probed: FLOPs, attention's FLOPs and the bytes the operators without FLOPs move grow with
    them; the operators a step dispatches and the tensors through checkpoints' hooks do not (one
    kernel takes the whole batch), and the activation profile and the units' spans are shares.

    >>> scaled_counts([10.0, 5, (), 2, (), 4.0, 8.0, 2.0, 1.0, 0.5], 3)
    [30.0, 5, (), 2, (), 12.0, 24.0, 6.0, 3.0, 1.5]
    """
    flops, ops, profile, hooked, spans, attention, traffic, whole, recomputed, again = counts
    return [flops * scale, ops, profile, hooked, spans, attention * scale, traffic * scale, whole * scale,
            recomputed * scale, again * scale]


def build_cost(model: torch.nn.Module, strategy: Strategy, dims: dict[str, int], state_factor: float,
               activations: int, forward_flops: float = 0.0, tokens: int = 0, device_type: str = "cpu",
               forward_ops: float = 0.0, optim_seconds_per_byte: float = 0.0,
               activation_profile: tuple = (), checkpointed_saves: float = 0.0, unit_spans: tuple = (),
               attention_flops: float = 0.0, accumulation: int = 1, forward_traffic: float = 0.0,
               whole_traffic: float = 0.0, recomputed_flops: float = 0.0,
               recomputed_attention: float = 0.0) -> StepCost:
    """The candidate's :class:`StepCost`: the whole model's terms, then each method's ``cost_term``
    (``accumulation``: see StepCost.accumulation), in the order the methods are applied whatever
    the list's order: a term reads what the earlier ones set (expert_parallel's ``held_apart``
    before a sharding method divides the rest)."""
    from atorch.auto.order import applied_order

    cost = StepCost(model, dict(dims), state_factor, device_type, forward_flops, tokens,
                    frozenset(absorbed_methods(strategy)),
                    tuple(strategy.opt_names), forward_ops, optim_seconds_per_byte)
    cost.accumulation = accumulation
    cost.params = cost.param_bytes()
    trainable = cost.param_bytes(trainable_only=True)
    cost.grads = cost.stepped = trainable
    # The optimizer step's temporaries: torch's default implementation on an accelerator (foreach)
    # builds one per parameter at once; on a CPU it steps one parameter at a time, so the largest
    # counts (AdamW on a CPU: 33 KB for a 321 KB model; a user's foreach=True there is not seen).
    cost.step_temp = trainable if device_type != "cpu" else max(
        (p.numel() * p.element_size() for p in model.parameters() if p.requires_grad), default=0)
    cost.optim_state = trainable * state_factor
    cost.activations = activations
    cost.activation_profile = tuple(activation_profile)
    cost.checkpointed_saves = checkpointed_saves
    cost.unit_spans = tuple(unit_spans)
    cost.attention_flops = attention_flops
    cost.forward_traffic = forward_traffic
    cost.recomputed_flops = recomputed_flops
    cost.recomputed_attention = min(recomputed_attention, recomputed_flops)
    cost.whole_traffic = min(whole_traffic, forward_traffic)
    cost.charge("step")  # the training step's own host overhead (StepCost.overheads)
    configs = dict(strategy.items())
    for name in applied_order(configs):
        term = get_method(name).cost_term
        if term is not None:
            term(configs[name], cost)
    return cost


def estimate_memory(model: torch.nn.Module, strategy: Strategy, dp_size: int, optim_state_factor: float,
                    activations: int, dims: dict[str, int] | None = None) -> MemoryEstimate:
    """Peak bytes per rank of ``strategy`` for ``model`` (see the module docstring); ``dims``
    (parallel dim sizes) default to data parallel over ``dp_size`` ranks."""
    cost = build_cost(model, strategy, dims or {"data": dp_size}, optim_state_factor, activations)
    return cost.memory()


def estimate_step_seconds(model: torch.nn.Module, strategy: Strategy, dp_size: int, forward_flops: float,
                          device_type: str, dims: dict[str, int] | None = None, tokens: int = 0) -> float:
    """A rough step time (:meth:`StepCost.seconds`): good enough to rank candidates and to order
    dry runs, not to predict seconds."""
    cost = build_cost(model, strategy, dims or {"data": dp_size}, 0.0, 0, forward_flops, tokens, device_type)
    return cost.seconds()
