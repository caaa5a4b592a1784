"""The activation memory of a training step's forward and backward, moment by moment, as the
cost model's probe measures it on real tensors.

Counting what autograd saves in forward misses what backward adds: the loss's gradient (as large
as the logits), each layer's gradient temporaries, and, under activation checkpointing, the block
recomputed while the gradients of the later blocks already exist (on benchmarks/search_quality.py's
deep-narrow Llama the checkpointed peak was 1.35x what the saved tensors and one recomputed block
add up to). So the probe runs backward too, under :class:`StepTimeline`, which logs each storage
the step allocates or frees. Afterwards each moment splits into the parameters' gradients (the
storages that end as ``.grad``), autocast's copies of the weights (amp's cost term scales them
to a rank's share of the model; a sharding method that computes in amp's dtype has none) and the
rest, the activations.

A candidate's peak over the step is then its worst moment: the activations, gradients and copies
alive then, each scaled to what the candidate keeps on a rank (a sharding method divides the
gradients, a layout the activations): :func:`envelope` keeps the moments that are the worst for
some such scaling.
"""

import torch

from atorch.auto.search.peak import PeakMemory

# The weights of the gradients against the activations that envelope() tries: 0 to 1 finely, then
# coarser up to "gradients only" (a layout can divide the activations more than the gradients).
_WEIGHTS = (*(i / 32 for i in range(33)), 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 1e6)
_COPY_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 1e6)  # the same for autocast's weight copies


class StepTimeline(PeakMemory):
    """PeakMemory that logs every change of the live bytes, by storage, from the step's start:
    the tensors of ``external`` (the model) exist before it and are not logged, but known, so a
    view of a weight is not taken for new memory."""

    def __init__(self, *external):
        super().__init__(*external)
        self.events: list[tuple[int, int, bool]] = []  # (storage, bytes added or freed, new storage)
        self._last_new: dict[int, int] = {}  # storage -> index of the event that last allocated it
        self._copies: set[int] = set()  # events that allocated autocast's copy of a weight

    def _changed(self, key: int, size: int, new: bool = False) -> None:
        super()._changed(key, size, new)
        if new:
            self._last_new[key] = len(self.events)
        self.events.append((key, size, new))

    def __enter__(self):
        entered = super().__enter__()
        self.events.clear()
        self._last_new.clear()
        return entered

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.nn.Parameter):
            key = out.untyped_storage()._cdata
            if key in self._last_new:
                self._copies.add(self._last_new[key])
        return out

    def moments(self, grads: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
        """(activation bytes, gradient bytes, weight-copy bytes, event index) alive at each moment
        the live bytes peak locally (an allocation the next event does not undo); ``grads`` are
        the parameters' gradients at the end of the step."""
        final = {self._last_new[k] for k in (g.untyped_storage()._cdata for g in grads) if k in self._last_new}
        kind: dict[int, int] = {}  # storage -> 0: activation, 1: gradient, 2: weight copy
        alive = [0, 0, 0]
        out = []
        for index, (key, size, new) in enumerate(self.events):
            if new:
                kind[key] = 2 if index in self._copies else 1 if index in final else 0
            if key in kind:  # else a tensor of the model, resized: not counted
                alive[kind[key]] += size
            if size > 0 and (index + 1 == len(self.events) or self.events[index + 1][1] <= 0):
                out.append((*alive, index))
        return out


def envelope(moments: list[tuple[int, int, int]], grad_total: int, copy_total: int,
             reference: int) -> tuple[tuple[float, float, float], ...]:
    """The moments that are the step's worst for some weights of the gradients and weight copies
    against the activations, as shares (activations / ``reference``, gradients / ``grad_total``,
    copies / ``copy_total``): a candidate with activations ``A``, gradients ``G`` and weight
    copies ``C`` peaks at the largest ``A a + G g + C c`` of them."""
    if not moments or reference <= 0:
        return ()
    worst = []
    for grad_weight in _WEIGHTS:
        for copy_weight in _COPY_WEIGHTS:
            acts, grad, copies = max(moments, key=lambda m, g=grad_weight, c=copy_weight: m[0] + g * m[1] + c * m[2])
            point = (acts / reference, grad / max(grad_total, 1), copies / max(copy_total, 1))
            if point not in worst:
                worst.append(point)
    return tuple(worst)
