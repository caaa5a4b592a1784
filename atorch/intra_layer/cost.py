"""The cost model's term for ``tensor_parallel``'s 3d algorithm: what a rank holds and computes,
and the collectives :class:`atorch.intra_layer.Linear` makes, counted as its code makes them.

Each replaced layer (``in`` x ``out``; grid row R x column C x depth D; T tokens a rank, the
batch split over depth) in one micro-batch:

- R > 1: its output gathered over the row group in forward (T x out), its input's gradient
  all-reduced over it in backward (T x in / C);
- C > 1: its partial sums all-reduced over the column group in forward (T x out / R), its
  input's gradient gathered in backward (T x in);
- D > 1: its weight block gathered over depth in forward, the block's gradient
  reduce-scattered in backward (the parameter's bytes, also under amp);
- a checkpointed block reruns its forward: each gather of a weight block again, and the
  activation collectives of each layer but its last (torch stops recomputing once backward has
  every tensor it needs: the last layer's output is taken by the residual add only);
- the gradient hooks all-reduce each replicated parameter's gradient over data x depth, one
  collective a parameter, each backward.

On 2 gloo ranks a 2-layer Llama's counted step equals these, grid by grid
(tests/auto/search/test_cost_traffic_3d.py).
"""

import torch

from atorch.auto.step_cost import Comm


def terms_3d(cost, row: int, col: int, depth: int) -> None:
    """Memory, compute and collectives of AxoNN's 3d algorithm on ``cost``'s model: each nn.Linear
    whose input features divide by ``col`` and output features by ``row x depth`` keeps
    1 / (row x col x depth) of its weight, gradient and optimizer state on a rank, and gathers its
    row x column block over depth in forward, which autograd keeps for the layer's backward; the
    batch is split over depth."""
    cost.grad_buckets = False  # hooks reduce each gradient over its own group: no DDP
    tensor = row * col * depth
    if tensor <= 1:
        return
    from atorch.intra_layer.auto import replaceable_linears

    linears = replaceable_linears(cost.model, col, row * depth)
    sizes = [_bytes(m) for _, m in linears]
    whole = max(cost.param_bytes(), 1)
    cost.split_layers(sum(sizes) / whole * (1 - 1 / tensor))
    if depth > 1:  # each layer's gathered block is saved for its backward: all of them at forward's end
        cost.gathered += sum(sizes) * cost.weight_scale / (row * col)
    cost.activations /= depth
    linear = sum(sizes) / whole  # the Linears' share of the FLOPs, by their share of the parameters
    cost.compute_share *= linear / tensor + (1 - linear) / depth
    _layer_comms(cost, linears, row, col, depth)
    _replica_comms(cost, linears, depth)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _checkpointed(cost, linears) -> tuple[set[str], set[str]]:
    """(layers whose forward reruns, layers whose activation collectives rerun) under checkpoint:
    every replaced layer inside a checkpointed block, and all of a block's but its last."""
    if "checkpoint" not in cost.methods:
        return set(), set()
    from atorch.utils.modules import by_block

    blocks = by_block(cost.model, [name for name, _ in linears])
    return {name for inside in blocks for name in inside}, {name for inside in blocks for name in inside[:-1]}


def _layer_comms(cost, linears, row: int, col: int, depth: int) -> None:
    """The collectives inside the replaced layers (the module docstring), as Comms over ``tensor``."""
    tokens = cost.tokens / depth * cost.stage_share
    rerun, again = _checkpointed(cost, linears)
    # (group size, kind, weight bytes an element or None) -> [elements, calls]; the activations'
    # are the step's tokens already and follow the compute dtype, the weight blocks' are gathered
    # again for each micro-batch in the parameters' dtype
    sums: dict[tuple[int, str, int | None], list[float]] = {}

    def add(size: int, kind: str, elements: float, calls: int, weights: int | None = None) -> None:
        entry = sums.setdefault((size, kind, weights), [0.0, 0])
        entry[0] += elements
        entry[1] += calls

    for name, m in linears:
        times = 2 if name in again else 1
        if row > 1:
            add(row, "all_gather", tokens * m.out_features * times, times)
            add(row, "all_reduce", tokens * m.in_features / col, 1)
        if col > 1:
            add(col, "all_reduce", tokens * m.out_features / row * times, times)
            add(col, "all_gather", tokens * m.in_features, 1)
        if depth > 1:
            block = m.weight.numel() / (row * col) * cost.stage_share
            gathers = 2 if name in rerun else 1
            add(depth, "all_gather", block * gathers, gathers, m.weight.element_size())
            add(depth, "reduce_scatter", block, 1, m.weight.element_size())
    for (size, kind, weights), (elements, calls) in sums.items():
        factor = 2 * (size - 1) / size if kind == "all_reduce" else (size - 1) / size
        cost.comms.append(Comm("tensor", elements, max(1, round(calls * cost.stage_share)), factor, kind,
                               "tensor_parallel", each_micro_batch=weights is not None, element_bytes=weights))


def _replica_comms(cost, linears, depth: int) -> None:
    """The gradient hooks' sync (intra_layer.grads.install_gradient_sync, in place of DDP): each
    trainable parameter's gradient all-reduced, one blocking collective each, in every backward
    (every micro-batch): a replicated parameter's over data x depth, a 3D weight shard's over its
    data replicas. With data ranks beside the grid the data-parallel sync is these (until
    2026-11-29 it was costed as DDP's: a bucket a step, hidden behind the backward). Without, the
    step's loss count over depth (24 bytes; over data ranks the data-parallel terms count it)."""
    data = cost.dp_size
    if depth * data <= 1:
        return
    cost.data_sync, cost.sync_calls, cost.sync_overlap = {}, {}, {}
    sharded = {id(m.weight) for _, m in linears}
    trainable = [p for p in cost.model.parameters() if p.requires_grad]
    replicated = [p for p in trainable if id(p) not in sharded]
    shards = [p for p in trainable if id(p) in sharded]
    tensor = cost.size("tensor")
    dim = "data" if data > 1 else "tensor"
    # gradients in the weights' dtype (fp32 under amp too: ``stream``)
    for group, params, kept in ((depth * data, replicated, 1), (data, shards, tensor)):
        if group > 1 and params:
            elements = sum(p.numel() for p in params) / kept
            cost.comms.append(Comm(dim, elements * cost.stage_share, len(params), 2 * (group - 1) / group,
                                   "all_reduce", "tensor_parallel", each_micro_batch=True, stream=True))
    if data <= 1:  # [count, sum, samples] in float64 (atorch/loss/step.py)
        cost.comms.append(Comm("tensor", 3, 1, 2 * (depth - 1) / depth, "all_reduce", "tensor_parallel",
                               element_bytes=8))
