"""Counting the operators a piece of code dispatches: the cost model charges each a calibrated
overhead (the Python call, the dispatcher, autograd's record), which is most of a small model's
step on a CPU, where FLOPs alone rank candidates poorly (docs/search.md)."""

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: model(x)``; then ``ops.count``: the aten operators dispatched."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter():
    """A FlopCounterMode that also counts the CPU's fused attention kernel, which torch's table
    leaves out: without it a probe on a CPU counted none of a Llama's attention FLOPs."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return FlopCounterMode(display=False, custom_mapping={cpu_flash: _cpu_flash_attention_flops})


def attention_flops(counter) -> float:
    """The FLOPs a :func:`flop_counter` counted in attention kernels (scaled_dot_product_attention's)."""
    by_op = counter.get_flop_counts().get("Global", {})
    return float(sum(flops for op, flops in by_op.items() if "scaled_dot_product" in str(op)))
