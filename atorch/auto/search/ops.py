"""Counting what a piece of code dispatches: its aten operators, which the cost model charges a
calibrated overhead each (the Python call, the dispatcher, autograd's record; most of a small
model's step on a CPU, where FLOPs alone rank candidates poorly, docs/search.md), and its FLOPs by
torch's formulas (``torch.utils.flop_counter``), attention's apart.

One dispatch mode counts both. torch's ``FlopCounterMode`` also attributes every FLOP to the
modules that run it, which hooks every module's forward and backward: 13.5 of a probe's 54 ms on
a 4-block Llama (a search probes every method combination). The totals are the same
(tests/auto/search/test_ops.py)."""

import functools

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
    some), plus the CPU's fused attention kernel, which torch's table leaves out (without it a
    probe on a CPU counted none of a Llama's attention FLOPs); and the operators among them that
    are attention's."""
    import torch
    from torch.utils.flop_counter import flop_registry

    formulas = {**flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_formula()}
    attention = frozenset(op for op in formulas if "scaled_dot_product" in str(op))
    return formulas, attention


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: model(x)``; then ``ops.count``: the aten operators dispatched,
    ``ops.flops``: their FLOPs, ``ops.attention_flops``: those of attention kernels
    (scaled_dot_product_attention's)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.flops = 0
        self.attention_flops = 0
        self._formulas, self._attention = _formulas()

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
        return out
