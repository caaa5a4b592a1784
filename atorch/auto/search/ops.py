"""Counting what a piece of code dispatches: its aten operators, which the cost model charges a
calibrated overhead each (the Python call, the dispatcher, autograd's record; most of a small
model's step on a CPU, where FLOPs alone rank candidates poorly, docs/search.md), and its FLOPs by
torch's formulas (``torch.utils.flop_counter``), attention's apart.

One dispatch mode counts both. torch's ``FlopCounterMode`` also attributes every FLOP to the
modules that run it, which hooks every module's forward and backward: 13.5 of a probe's 54 ms on
a 4-block Llama (a search probes every method combination). The totals are the same
(tests/auto/search/test_ops.py)."""

import functools
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


@functools.cache
def _cpu_flash_formula():
    from torch.utils.flop_counter import shape_wrapper

    return shape_wrapper(_cpu_flash_attention_flops)


def _formulas() -> tuple[dict, frozenset]:
    """torch's FLOP formulas by operator as they stand now (``register_flop_formula`` may add
    some), plus those torch's table leaves out: the CPU's fused attention kernel (without it a
    probe on a CPU counted none of a Llama's attention FLOPs) and the operators of
    :mod:`atorch.auto.search.flop_formulas` (a MoE's grouped matmuls, fused fast paths, recurrent
    kernels); and the operators among them that are attention's."""
    import torch
    from torch.utils.flop_counter import flop_registry

    from atorch.auto.search.flop_formulas import extra_formulas

    formulas = {**flop_registry, **extra_formulas(),
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_formula()}
    attention = frozenset(op for op in formulas if "scaled_dot_product" in str(op))
    return formulas, attention


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: model(x)``; then ``ops.count``: the aten operators dispatched,
    ``ops.flops``: their FLOPs, ``ops.attention_flops``: those of attention kernels
    (scaled_dot_product_attention's), ``ops.traffic``: the bytes the operators without a FLOP
    formula read and write (see :func:`traffic`; ``weights``: storage keys of the tensors that are
    not the batch's, as :class:`atorch.auto.search.cost._SavedBytes` keeps them). With
    ``count_traffic=False`` traffic stays 0: a CPU's probes, whose profiles charge none, save the
    14% of a probe it costs (a 2-layer Llama's, 27 ms against 24)."""

    def __init__(self, weights: set | None = None, count_traffic: bool = True):
        super().__init__()
        self.count_traffic = count_traffic
        self.count = 0
        self.flops = 0
        self.attention_flops = 0
        self.traffic = 0
        # of ``traffic``, the bytes a tensor-parallel rank moves whole (see :meth:`watch_regions`)
        self.whole_traffic = 0
        self.weights = set() if weights is None else weights
        self._formulas, self._attention = _formulas()
        self._watching, self._inside, self._region_inputs = False, 0, set()

    def watch_regions(self, model: torch.nn.Module, names: Iterable[str]) -> list:
        """Tell apart the traffic tensor parallelism splits from the traffic it leaves whole:
        ``names`` are the modules whose Linears it splits (attention, the MLP). What runs inside
        them works on split heads or features, except the casts of their input, which every rank
        makes of its whole copy; what runs outside (norms, residual adds, the embedding's output,
        the loss over gathered logits) runs whole on every tensor rank. Returns the hooks' handles."""
        self._watching = True
        handles = []
        for name in names:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave, with_kwargs=True))
        return handles

    def _enter(self, _module, args, kwargs) -> None:
        self._inside += 1
        self._region_inputs |= {_key(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}

    def _leave(self, _module, _args, _kwargs, _out) -> None:
        self._inside -= 1
        if not self._inside:
            self._region_inputs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += 1
        out = func(*args, **kwargs)
        op = func._overloadpacket
        formula = self._formulas.get(op)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.flops += flops
            if op in self._attention:
                self.attention_flops += flops
        elif self.count_traffic:
            moved = traffic(func, (args, kwargs), out, self.weights)
            self.traffic += moved
            if self._watching and (not self._inside or (op is torch.ops.aten._to_copy and args
                                                         and _key(args[0]) in self._region_inputs)):
                self.whole_traffic += moved
        return out


_ALLOCATIONS = {torch.ops.aten.empty_like, torch.ops.aten.empty, torch.ops.aten.new_empty,
                torch.ops.aten.empty_strided, torch.ops.aten.new_empty_strided}


_WRITES = {torch.ops.aten.zeros_like, torch.ops.aten.ones_like, torch.ops.aten.full_like, torch.ops.aten.rand_like,
           torch.ops.aten.randn_like, torch.ops.aten.new_zeros, torch.ops.aten.new_ones, torch.ops.aten.new_full,
           torch.ops.aten.zero_, torch.ops.aten.fill_, torch.ops.aten.bernoulli_, torch.ops.aten.uniform_,
           torch.ops.aten.normal_, torch.ops.aten.random_, torch.ops.aten.exponential_}
_GATHERS = {torch.ops.aten.index, torch.ops.aten.index_select, torch.ops.aten.gather}
_SCATTERS = {torch.ops.aten.index_add_, torch.ops.aten.index_put_, torch.ops.aten.scatter_add_,
             torch.ops.aten.scatter_, torch.ops.aten.index_copy_}


def traffic(func, inputs, out, weights: set) -> int:
    """Bytes an operator without FLOPs (element-wise, a normalization, a reduction, a softmax, a
    gather) reads and writes: its tensor inputs' and outputs', in their dtypes. On a GPU such
    kernels run at the memory's bandwidth, not the matmul rate (StepCost.traffic_seconds). On meta
    tensors autocast does nothing and every tensor is the model's dtype: right for a Hugging Face
    Llama's residual stream and norms, which stay fp32 under amp, twice the bytes of its bf16 MLP
    activations. Not counted: a view or alias of an input (no data moves; an in-place operator
    does count), a weight's elements (a gather reads the rows it returns, counted as its output),
    an operator on weights alone (autocast's cast of a weight: once a step, not once a sample),
    and an allocation (``empty_like``: atorch's tensor layers make the buffers an all-gather
    fills; it reads and writes nothing). An operator that reads no tensor (``zeros``,
    ``arange``), or only another's shape (``zeros_like``, ``fill_``), writes its output; ``copy_``
    reads its source and writes its destination. A gather from activations (``x[index]``: a MoE block's
    tokens for one expert) reads only the rows it returns, and a scatter into them
    (``index_add_``) reads and writes only the rows it adds to: not the whole tensor.

    >>> import torch
    >>> x, w = torch.ones(4, 8), torch.ones(8)
    >>> keys = {w.untyped_storage()._cdata}
    >>> traffic(torch.ops.aten.mul.Tensor, ((x, w), {}), x * w, keys)  # reads x, writes x's shape, fp32
    256
    >>> traffic(torch.ops.aten.view.default, ((x, [32]), {}), x.view(32), keys)
    0
    >>> traffic(torch.ops.aten._to_copy.default, ((w,), {}), w.half(), keys)
    0
    >>> traffic(torch.ops.aten.empty_like.default, ((x,), {}), torch.empty_like(x), keys)
    0
    >>> traffic(torch.ops.aten.zeros_like.default, ((x,), {}), torch.zeros_like(x), keys)
    128
    >>> traffic(torch.ops.aten.copy_.default, ((x, x.half()), {}), x, keys)  # 64 read, 128 written
    192
    >>> rows = torch.tensor([1, 3])  # 2 of x's 4 rows: 64 bytes read and written, 16 of index
    >>> traffic(torch.ops.aten.index.Tensor, ((x, [rows]), {}), x[rows], keys)
    144
    >>> traffic(torch.ops.aten.index_add_.default, ((x, 0, rows, x[rows]), {}), x, keys)
    208
    """
    from torch.utils._pytree import tree_leaves

    if func._overloadpacket in _ALLOCATIONS:
        return 0

    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not tensors:  # made from nothing it reads: written only
        return _bytes(outputs)
    keys = [_key(t) for t in tensors]
    read = [t for t, key in zip(tensors, keys, strict=True) if key not in weights]
    if not read:
        return 0
    if func._overloadpacket in _WRITES:
        return _bytes(outputs)
    if func._overloadpacket is torch.ops.aten.copy_:  # the source read, the destination written
        return _bytes(tensors[1:2]) + _bytes(outputs)
    if not func._schema.is_mutable and any(_key(t) in keys for t in outputs):
        return 0
    sparse = _sparse_traffic(func._overloadpacket, tensors, outputs, keys[0] in weights)
    if sparse is not None:
        return sparse
    return sum(t.numel() * t.element_size() for t in (*read, *outputs))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sparse_traffic(op, tensors: list, outputs: list, from_weights: bool) -> int | None:
    """A gather's bytes from activations (the rows it returns, read and written, and its index)
    or a scatter's into them (the rows it adds to, read and written, its source and index); None
    for any other operator, or a gather from weights (its rows counted as its output alone)."""
    if op in _GATHERS and not from_weights:
        return 2 * _bytes(outputs) + _bytes(tensors[1:])
    if op in _SCATTERS:
        target = tensors[0]
        if len(tensors) == 2:  # scatter_.value: a number written where the index says
            return tensors[1].numel() * target.element_size() + _bytes(tensors[1:])
        source = tensors[-1]
        if source.numel() <= 1:  # one value broadcast (x[mask] = 0): how many rows is data; all of them
            return None
        rows = source.numel() * target.element_size()  # the target's rows it adds to, read and written
        return 2 * rows + _bytes(tensors[1:])
    return None


def _key(tensor) -> int:
    return tensor.untyped_storage()._cdata
