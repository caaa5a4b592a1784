"""Count the collectives a piece of code really makes, with their payload bytes, on real process
groups: a dispatch mode that sees every ``c10d`` operator as torch.distributed dispatches it
(forward and backward alike) and lets it run. The cost model's communication terms are checked
against these counts, not against a restated formula."""

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator -> the kind the cost model names
_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send_recv",
    "recv_": "send_recv",
    "recv_any_source_": "send_recv",
    "barrier": "barrier",
}


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group_name(args) -> str:
    """The name of the process group among a c10d operator's arguments (a boxed ProcessGroup)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return torch.distributed.ProcessGroup.unbox(arg).group_name
    return "?"


class Collectives(TorchDispatchMode):
    """``with Collectives() as seen: step()``; then ``seen.calls[(kind, group_name)]`` and
    ``seen.bytes[(kind, group_name)]``: how many collectives of that kind ran over that process
    group, and the bytes of their payload (an all-reduce's tensor; an all-gather's or
    reduce-scatter's output, the whole gathered tensor; a send's tensor)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            kind = _KINDS.get(name, name)
            key = (kind, _group_name(args))
            self.calls[key] += 1
            # all-gather's output (args[0]) is the whole gathered list or tensor; the others' first
            # tensor argument is the payload (reduce-scatter: the input, args[1], is the whole)
            payload = args[1] if kind == "reduce_scatter" else args[0]
            self.bytes[key] += sum(t.numel() * t.element_size() for t in _tensors(payload))
        return func(*args, **kwargs)

    def by_dim(self, topology) -> dict:
        """``{dim: {kind: (calls, bytes)}}`` over the groups of ``topology``'s dims ("data": its
        data-parallel group); "other" for any other group."""
        names = {}
        for dim, _ in topology.dims:
            group = topology.group(dim)
            if group is not None:
                names[group.group_name] = dim
        if topology.data_parallel_group is not None:
            names[topology.data_parallel_group.group_name] = "data"
        out: dict = {}
        for (kind, group), calls in self.calls.items():
            dim = out.setdefault(names.get(group, "other"), {})
            before = dim.get(kind, (0, 0))
            dim[kind] = (before[0] + calls, before[1] + self.bytes[(kind, group)])
        return out


def step_traffic(model, load_strategy, dataset, batch_size: int = 8, loss_func=None, accumulation: int = 1,
                 peak: bool = False) -> dict:
    """The collectives of one training step (after a first, which may set things up), by the
    dim of the group they ran over (:meth:`Collectives.by_dim`); on every rank of a run. A step
    is ``accumulation`` micro-batches (auto_accelerate's gradient_accumulation_steps) and one
    optimizer step; with ``peak``, the step's peak tensor bytes too (under "peak")."""
    from atorch.auto import auto_accelerate
    from atorch.auto.search.peak import PeakMemory
    from atorch.parallel_state import current_topology

    _, result, _ = auto_accelerate(model, torch.optim.AdamW, dataset, loss_func or (lambda b, out: out.loss),
                                   optim_args={"lr": 1e-3}, dataloader_args={"batch_size": batch_size},
                                   model_input_format="unpack_dict", load_strategy=load_strategy,
                                   gradient_accumulation_steps=accumulation)
    batches = iter(result.dataloader)

    def step():  # the loader's batches of one optimizer step (gradient_accumulation splits them too)
        for _ in range(result.args.get("gradient_accumulation_steps", 1)):
            batch = result.prepare_input(next(batches), torch.device("cpu"))
            loss = result.loss_func(batch, result.model(**batch))
            result.backward(loss)
            result.step()

    step()
    tracker = PeakMemory(result.model, result.optim) if peak else contextlib.nullcontext()
    with Collectives() as seen, tracker:
        step()
    out = seen.by_dim(current_topology())
    if peak:
        out["peak"] = tracker.peak
    return out
