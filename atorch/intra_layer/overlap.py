"""AxoNN's ``optimize_communication``: the 3D layer's collectives overlapped with computation.

Outside the context :class:`atorch.intra_layer.Linear` runs every collective synchronously.
Inside it (one forward + backward, or several micro batches, before the optimizer step):

- ``overlap_all_reduce``: the backward all-reduce of the input gradient over the output-feature
  group is started asynchronously and the weight gradient is computed while it runs.
- ``overlap_reduce_scatter``: the depth reduce-scatter of a weight gradient is started
  asynchronously and the backward goes on; the shards are added to ``.grad`` when the context
  exits (call :func:`atorch.intra_layer.sync_gradients` and the optimizer after it).
- ``cache_weights``: a weight gathered over the depth group is kept until the context exits, so
  a second forward (another micro batch, an activation-checkpointing recompute) does not gather
  it again. The weights must not change inside the context (no optimizer step).
- ``overlap_all_gather`` (with ``model_object_for_overlapping_allgathers=model``): the depth
  all-gather of the next layer's weight is started when a layer takes its own (one ahead, in
  ``model.modules()`` order), so it runs during that layer's matmul. Implies ``cache_weights``.

Collectives are asynchronous where torch.distributed allows (gloo and NCCL both do); the numbers
are the same as without the context (the same sums, in the same order per element).
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from atorch.intra_layer import comm
from atorch.intra_layer.grid import Axis

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _State:
    active = False
    overlap_all_reduce = overlap_reduce_scatter = cache_weights = False
    cache: dict[int, tuple[torch.Tensor, object]] = {}  # id(weight) -> (gathered, pending handle or None)
    prefetch: Iterator | None = None
    pending: list[tuple[torch.Tensor, torch.Tensor, object]] = []  # (param, grad shard, handle)
    events: list[str] | None = None  # order of issue/compute/wait, kept when a test asks (see record_events)


def _event(name: str) -> None:
    if _State.events is not None:
        _State.events.append(name)


@contextlib.contextmanager
def optimize_communication(overlap_all_reduce: bool = True, overlap_reduce_scatter: bool = False,
                           cache_weights: bool = False, overlap_all_gather: bool = False,
                           model_object_for_overlapping_allgathers: torch.nn.Module | None = None, *args, **kwargs):
    """AxoNN's context (see the module docstring). Example::

        with atorch.intra_layer.optimize_communication(overlap_all_reduce=True, overlap_reduce_scatter=True,
                                                       cache_weights=True, overlap_all_gather=True,
                                                       model_object_for_overlapping_allgathers=model):
            loss = loss_fn(model(x), y)
            loss.backward()
        atorch.intra_layer.sync_gradients(model)
        optimizer.step()
    """
    if args or kwargs:
        from atorch.errors import NotSupportedError

        raise NotSupportedError(f"optimize_communication got options it does not know: {sorted(kwargs) or args}; "
                                "atorch implements overlap_all_reduce, overlap_reduce_scatter, cache_weights and "
                                "overlap_all_gather")
    if overlap_all_gather and model_object_for_overlapping_allgathers is None:
        raise ValueError("optimize_communication(overlap_all_gather=True) needs "
                         "model_object_for_overlapping_allgathers=model (the model whose weights to prefetch)")
    if _State.active:
        raise RuntimeError("optimize_communication is already active; do not nest it")
    _State.active = True
    _State.overlap_all_reduce, _State.overlap_reduce_scatter = bool(overlap_all_reduce), bool(overlap_reduce_scatter)
    _State.cache_weights = bool(cache_weights or overlap_all_gather)
    _State.cache, _State.pending = {}, []
    if overlap_all_gather:
        _State.prefetch = _prefetcher(model_object_for_overlapping_allgathers)
        next(_State.prefetch, None)  # the first layer's gather starts now
    try:
        yield None
    finally:
        try:
            flush()
        finally:
            _State.active = False
            _State.overlap_all_reduce = _State.overlap_reduce_scatter = _State.cache_weights = False
            _State.cache, _State.prefetch = {}, None


@torch.no_grad()
def flush() -> None:
    """Wait for the reduce-scatters still in flight and add their shards to ``.grad``."""
    pending, _State.pending = _State.pending, []
    for param, shard, handle in pending:
        if handle is not None:
            handle.wait()
        _event("reduce_scatter_wait")
        if param.grad is None:
            param.grad = shard
        else:
            param.grad.add_(shard)


def _start_gather(shard: torch.Tensor, axis: Axis) -> tuple[torch.Tensor, object]:
    if axis.size == 1:
        return shard, None
    out = torch.empty((axis.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    handle = _ALL_GATHER(out, shard.detach().contiguous(), group=axis.group, async_op=True)
    _event("all_gather_issue")
    return out, handle


def _prefetcher(model: torch.nn.Module) -> Iterator[None]:
    from atorch.intra_layer.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear) and module._depth.size > 1 and id(module.weight) not in _State.cache:
            _State.cache[id(module.weight)] = _start_gather(module.weight, module._depth)
            yield  # one gather started per step: each layer starts the next one's


class _GatherCached(torch.autograd.Function):
    """The gathered weight from the cache; backward reduce-scatters (asynchronously if asked)."""

    @staticmethod
    def forward(ctx, shard, gathered, axis):
        ctx.axis, ctx.param = axis, shard
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.axis, ctx.param), None, None


def _reduce_scatter(grad: torch.Tensor, axis: Axis, param: torch.Tensor):
    if not _State.overlap_reduce_scatter or axis.size == 1:
        return comm.reduce_scatter_dim0(grad, axis)
    chunks = grad.contiguous()
    out = torch.empty((grad.shape[0] // axis.size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    handle = _REDUCE_SCATTER(out, chunks, group=axis.group, async_op=True)
    _event("reduce_scatter_issue")
    _State.pending.append((param, out, handle))
    return None  # added to .grad by flush() when the context exits


class _GatherShardsAsync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, axis):
        ctx.axis, ctx.param = axis, shard
        return comm.all_gather_dim(shard, 0, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.axis, ctx.param), None


def gathered_weight(weight: torch.nn.Parameter, axis: Axis) -> torch.Tensor:
    """The layer's whole weight for this forward: gathered over depth, from the cache when allowed."""
    if not _State.active or axis.size == 1:
        return comm.gather_shards(weight, axis)
    if not _State.cache_weights:
        return _GatherShardsAsync.apply(weight, axis) if _State.overlap_reduce_scatter else comm.gather_shards(weight, axis)
    entry = _State.cache.get(id(weight))
    if entry is None:
        entry = _State.cache[id(weight)] = (comm.all_gather_dim(weight.detach(), 0, axis), None)
    gathered, handle = entry
    if handle is not None:
        handle.wait()
        _event("all_gather_wait")
        _State.cache[id(weight)] = (gathered, None)
    if _State.prefetch is not None:
        next(_State.prefetch, None)  # the next layer's gather runs during this layer's matmul
    return _GatherCached.apply(weight, gathered, axis)


class _LinearAllReduceOverlap(torch.autograd.Function):
    """``h @ W^T`` whose input-gradient all-reduce (over ``axis``) runs while the weight gradient
    is computed (what ``copy_to_region`` + ``F.linear`` do one after the other)."""

    @staticmethod
    def forward(ctx, h, weight, axis):
        ctx.save_for_backward(h, weight)
        ctx.axis = axis
        return F.linear(h, weight)

    @staticmethod
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        grad_h = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        handle = None
        if grad_h is not None:
            handle = dist.all_reduce(grad_h, group=ctx.axis.group, async_op=True)
            _event("all_reduce_issue")
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(h.reshape(-1, h.shape[-1]))
            _event("weight_grad")
        if handle is not None:
            handle.wait()
            _event("all_reduce_wait")
        return grad_h, grad_w, None


def linear(h: torch.Tensor, weight: torch.Tensor, out_axis: Axis) -> torch.Tensor:
    """``F.linear(copy(h), weight)``: with ``overlap_all_reduce`` active, the backward all-reduce of
    ``h``'s gradient over ``out_axis`` overlaps the weight-gradient matmul."""
    if _State.active and _State.overlap_all_reduce and out_axis.size > 1:
        return _LinearAllReduceOverlap.apply(h, weight, out_axis)
    return F.linear(comm.copy(h, out_axis), weight)


@contextlib.contextmanager
def record_events() -> Iterator[list[str]]:
    """The order in which collectives were issued, computed around and waited for (for tests)."""
    _State.events = []
    try:
        yield _State.events
    finally:
        _State.events = None
