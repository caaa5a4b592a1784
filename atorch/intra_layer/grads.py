"""Gradients of a model with 3D layers: the data-parallel reduction, and global-norm clipping.

Each rank computes the loss of its share of the global batch (split over data x depth). The
reduction sums every gradient over those ranks, as AxoNN's ``sync_gradients`` does by default:
a replicated parameter's gradient is summed over the data x depth ranks; a 3D weight's shard
already holds the sum over its depth ranks (the reduce-scatter of its backward), so it is summed
over the data ranks that hold the same shard. ``mean=True`` then divides by data x depth, which
with a mean loss per rank gives the serial model's gradient on the whole global batch.

A model whose 3D layers take AxoNN's per-rank batch (``Linear(batch_per_rank=True)``) is data
parallel over every rank outside those layers: its replicated parameters are summed over all
ranks, a weight shard (whose backward already covers the row x column group's samples) over its
data replicas, and ``mean=True`` divides by every rank that holds its own samples.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from atorch.auto.clip import clip_grad_norm
from atorch.distributed.topology import Topology
from atorch.errors import AtorchConfigError, NotSupportedError
from atorch.intra_layer.grid import current


def _group_of(param: torch.Tensor, topology: Topology, per_rank: bool = False) -> dist.ProcessGroup | None:
    if getattr(param, "intra_layer_sharded", False):
        replicas = topology.data_parallel_size // topology.size("depth")
        return topology.replica_group if replicas > 1 else None
    if per_rank:
        return dist.group.WORLD if sample_ranks(topology, True) > 1 else None
    return topology.data_parallel_group if topology.data_parallel_size > 1 else None


def per_rank_batch(model: torch.nn.Module) -> bool:
    """Whether ``model``'s 3D layers take AxoNN's per-rank batch (an error if some do and some do not)."""
    from atorch.intra_layer.linear import Linear

    contracts = {m.batch_per_rank for m in model.modules() if isinstance(m, Linear)}
    if len(contracts) > 1:
        raise AtorchConfigError(
            "the model mixes intra_layer.Linear layers with batch_per_rank=True and False: the parameters between "
            "them would need both reductions; build every 3D layer with the same contract"
        )
    return contracts == {True}


def sample_ranks(topology: Topology, per_rank: bool) -> int:
    """How many ranks hold their own samples: data x depth, and row x column under a per-rank batch."""
    if not per_rank:
        return topology.data_parallel_size
    if topology.size("pipeline") > 1:
        raise NotSupportedError(
            "intra_layer.Linear(batch_per_rank=True) with a pipeline dim: the gradient reduction over every "
            "rank of a stage is not built; use batch_per_rank=False (the same samples on a row x column group)"
        )
    return topology.data_parallel_size * topology.size("row") * topology.size("col")


def sync_gradients(model: torch.nn.Module, gradient_attr_name: str = "grad", mean: bool = False,
                   vectorize: bool = False, expert_mode: bool = False, *, topology: Topology | None = None) -> None:
    """Reduce every gradient over the ranks that see different samples (call after ``backward``).

    AxoNN's signature and default: ``mean=False`` sums, so every gradient is the sum of the
    data x depth ranks' gradients (replicated parameters summed over data x depth, 3D weight
    shards over their data replicas, their depth sum being done by the layer's backward).
    ``mean=True`` divides by data x depth: with a mean loss on each rank's share, the gradients
    then equal the serial model's on the whole global batch, whatever the grid. One all-reduce
    per group, on one flattened buffer.

    - ``gradient_attr_name``: the attribute holding each parameter's gradient (``"grad"``, or for
      example a ``main_grad`` kept beside it).
    - ``vectorize``: accepted for AxoNN's signature; the gradients of a group are always reduced
      as one flattened buffer (the numbers are the same either way).
    - ``expert_mode``: accepted for AxoNN's signature; the reduction is the same under the whole
      and sliced contracts of :class:`intra_layer.Linear` (its bias gets the whole gradient under
      both), so it changes nothing. A model whose 3D layers take a per-rank batch
      (``batch_per_rank=True``) is reduced over every rank (see the module docstring).

    Example::

        loss = loss_fn(model(batch), target)      # mean over this rank's share of the global batch
        loss.backward()
        atorch.intra_layer.sync_gradients(model, mean=True)   # now the serial model's gradients
        optimizer.step()
    """
    topology = topology if topology is not None else current()
    per_rank = per_rank_batch(model)
    scale = 1.0 / sample_ranks(topology, per_rank) if mean else 1.0
    buckets: dict[int, tuple[dist.ProcessGroup | None, list[torch.Tensor]]] = {}
    for param in model.parameters():
        grad = getattr(param, gradient_attr_name, None)
        if grad is None:
            continue
        group = _group_of(param, topology, per_rank)
        buckets.setdefault(id(group), (group, []))[1].append(grad)
    for group, grads in buckets.values():
        if group is not None:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
        if scale != 1.0:
            for grad in grads:
                grad.mul_(scale)


def install_gradient_sync(model: torch.nn.Module, topology: Topology | None = None, *, mean: bool) -> list:
    """Make ``backward`` itself leave synchronized gradients (what DDP does for a plain model).

    Registers a hook on every trainable parameter that applies :func:`sync_gradients`'
    reduction (summed, or with ``mean=True`` averaged, over data x depth; no default, since the
    two differ by that factor) to the gradient arriving from each backward, before it is
    accumulated into ``.grad`` (so accumulating over several backwards stays correct); the
    ``tensor_parallel`` method's 3d algorithm uses it with ``mean=True`` in place of DDP.
    Returns the hook handles.
    """
    topology = topology if topology is not None else current()
    per_rank = per_rank_batch(model)
    scale = 1.0 / sample_ranks(topology, per_rank) if mean else 1.0

    def make_hook(group):
        def hook(grad):
            grad = grad.clone()
            if group is not None:
                dist.all_reduce(grad, group=group)
            return grad.mul_(scale) if scale != 1.0 else grad
        return hook

    return [param.register_hook(make_hook(_group_of(param, topology, per_rank)))
            for param in model.parameters() if param.requires_grad]


def clip_grad_norm_(parameters: torch.nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; return the norm before clipping.

    The norm is the serial model's: each 3D weight shard counted once over the tensor ranks,
    replicated parameters once. Call after :func:`sync_gradients`. The same helper as
    ``atorch.auto.clip_grad_norm`` (which reads the shards' ``shard_group``).
    """
    return clip_grad_norm(parameters, max_norm, norm_type)
