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

A pipeline stage keeps its own units' activations, for several microbatches at once, which no
scaling of the whole model's moments describes (the last stage's logits are no share of the
first stage's blocks; a checkpointed stage recomputes one block per microbatch). So the timeline
also marks when each of the units a pipeline splits the model into (``watch``) runs forward and
backward, and :meth:`StepTimeline.unit_spans` tells what each keeps and the most alive while it
runs: a stage's peak follows from its units' spans (atorch/methods/pipeline_parallel.py).
"""

from dataclasses import dataclass
from functools import partial

import torch

from atorch.auto.search.peak import PeakMemory

# The weights of the gradients against the activations that envelope() tries: 0 to 1 finely, then
# coarser up to "gradients only" (a layout can divide the activations more than the gradients).
_WEIGHTS = (*(i / 32 for i in range(33)), 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 1e6)
_COPY_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 1e6)  # the same for autocast's weight copies


@dataclass(frozen=True)
class UnitSpan:
    """One unit of the probed step (a pipeline unit: an embedding, a block, the head), its bytes
    as shares of the forward's activation peak: what it leaves alive from its forward's start to
    the next unit's (``kept``: the tensors saved for backward, its output; the loss, after the last
    unit), and the most activations alive while its forward and while its backward run (all
    units', the earlier units' kept included). The last unit also has ``output``: the model's
    output the step dropped once the loss was computed (a pipeline schedule holds its last stage's
    until the microbatch's backward)."""

    name: str
    kept: float
    forward_peak: float
    backward_peak: float
    output: float = 0.0


def _first_tensor(value):
    while not torch.is_tensor(value):
        if isinstance(value, (tuple, list)) and value:
            value = value[0]
        elif isinstance(value, dict) and value:
            value = next(iter(value.values()))
        else:
            return None
    return value


class StepTimeline(PeakMemory):
    """PeakMemory that logs every change of the live bytes, by storage, from the step's start:
    the tensors of ``external`` (the model) exist before it and are not logged, but known, so a
    view of a weight is not taken for new memory."""

    def __init__(self, *external):
        super().__init__(*external)
        self.events: list[tuple[int, int, bool]] = []  # (storage, bytes added or freed, new storage)
        self._last_new: dict[int, int] = {}  # storage -> index of the event that last allocated it
        self._copies: set[int] = set()  # events that allocated autocast's copy of a weight
        # watched unit -> event index of its forward's start and end, and of its backward's start
        # (its output's gradient computed)
        self.marks: dict[str, dict[str, int]] = {}

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

    def watch(self, model: torch.nn.Module, names: list[str]) -> list:
        """Mark the forward and backward of each of ``model``'s submodules ``names`` (the first call
        of each); returns the hooks' handles, to remove after the step."""
        handles = []
        for name in names:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(partial(self._forward_starts, name)))
            handles.append(module.register_forward_hook(partial(self._forward_ends, name)))
        return handles

    def _forward_starts(self, name, module, args):
        self.marks.setdefault(name, {}).setdefault("forward", len(self.events))

    def _forward_ends(self, name, module, args, output):
        marks = self.marks[name]
        if "forward_end" in marks:
            return
        marks["forward_end"] = len(self.events)
        tensor = _first_tensor(output)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(partial(self._backward_starts, name))

    def _backward_starts(self, name, grad):
        self.marks[name].setdefault("backward", len(self.events))

    def _alive(self, grads: list[torch.Tensor]):
        """(activation bytes, gradient bytes, weight-copy bytes) alive after each event; ``grads``
        are the parameters' gradients at the end of the step."""
        final = {self._last_new[k] for k in (g.untyped_storage()._cdata for g in grads) if k in self._last_new}
        kind: dict[int, int] = {}  # storage -> 0: activation, 1: gradient, 2: weight copy
        alive = [0, 0, 0]
        for index, (key, size, new) in enumerate(self.events):
            if new:
                kind[key] = 2 if index in self._copies else 1 if index in final else 0
            if key in kind:  # else a tensor of the model, resized: not counted
                alive[kind[key]] += size
            yield tuple(alive)

    def moments(self, grads: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
        """(activation bytes, gradient bytes, weight-copy bytes, event index) alive at each moment
        the live bytes peak locally (an allocation the next event does not undo); ``grads`` are
        the parameters' gradients at the end of the step."""
        out = []
        for index, alive in enumerate(self._alive(grads)):
            size = self.events[index][1]
            if size > 0 and (index + 1 == len(self.events) or self.events[index + 1][1] <= 0):
                out.append((*alive, index))
        return out

    def unit_spans(self, grads: list[torch.Tensor], forward_end: int, reference: int,
                   output: int = 0) -> tuple[UnitSpan, ...]:
        """The watched units that ran, in the order their forwards ran, each with its
        :class:`UnitSpan` as shares of ``reference`` bytes. A unit's forward lasts until the next
        unit's starts (the last one's until ``forward_end``, the loss included; the first one's
        from the step's start); its backward from its output's gradient (the last unit's from
        ``forward_end``: the loss's backward) until the next backward that starts. A unit whose
        output needs no gradient has no backward of its own: what it does in backward falls in
        the span of the unit after it, whose backward runs just before. ``output``: the bytes
        the model's output held, freed before ``forward_end``."""
        acts = [alive[0] for alive in self._alive(grads)]
        ran = sorted((m["forward"], name) for name, m in self.marks.items() if "forward_end" in m)
        if not ran or reference <= 0:
            return ()

        def before(index):  # activations alive before event `index`
            return acts[index - 1] if index > 0 else 0

        def most(start, end):
            return max(acts[start:end], default=before(start))

        starts = [0, *(start for start, _ in ran[1:]), forward_end]
        backward = {name: self.marks[name].get("backward") for _, name in ran}
        backward[ran[-1][1]] = forward_end
        began = sorted(b for b in backward.values() if b is not None)
        spans = []
        for i, (_, name) in enumerate(ran):
            begin, end = starts[i], starts[i + 1]
            start = backward[name]
            after = next((b for b in began if b > start), len(acts)) if start is not None else None
            spans.append(UnitSpan(name, (before(end) - before(begin)) / reference, most(begin, end) / reference,
                                  most(start, after) / reference if start is not None else 0.0,
                                  output / reference if i == len(ran) - 1 else 0.0))
        return tuple(spans)


def envelope(moments: list[tuple[int, int, int]], grad_total: int, copy_total: int,
             reference: int) -> tuple[tuple[float, float, float], ...]:
    """The moments that are the step's worst for some weights of the gradients and weight copies
    against the activations, as shares (activations / ``reference``, gradients / ``grad_total``,
    copies / ``copy_total``): a candidate with activations ``A``, gradients ``G`` and weight
    copies ``C`` peaks at the largest ``A a + G g + C c`` of them."""
    if not moments or reference <= 0:
        return ()
    # Every weighting at once, in float64 and in the order Python would add them (acts + g x
    # grads, then + c x copies), so each argmax (the first of equal maxima, as max() takes) is
    # the moment a loop over the weights would pick: the loop made a probe 1.7x slower.
    values = torch.tensor(moments, dtype=torch.float64)
    grad_weights = torch.tensor(_WEIGHTS, dtype=torch.float64).repeat_interleave(len(_COPY_WEIGHTS))
    copy_weights = torch.tensor(_COPY_WEIGHTS, dtype=torch.float64).repeat(len(_WEIGHTS))
    scores = values[:, :1] + grad_weights * values[:, 1:2] + copy_weights * values[:, 2:3]
    worst = []
    for index in scores.argmax(dim=0).tolist():
        acts, grad, copies = moments[index]
        point = (acts / reference, grad / max(grad_total, 1), copies / max(copy_total, 1))
        if point not in worst:
            worst.append(point)
    return tuple(worst)
