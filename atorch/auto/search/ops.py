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
