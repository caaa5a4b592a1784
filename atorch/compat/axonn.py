"""AxoNN's ``ax`` module on atorch: ``from atorch.compat import axonn as ax``.

AxoNN code runs with its imports changed::

    from axonn import axonn as ax                  ->  from atorch.compat import axonn as ax
    from axonn.intra_layer import Linear, ...      ->  from atorch.compat.axonn import Linear, ...

``Linear`` and ``auto_parallelize`` here keep AxoNN's default contract: each rank passes its own
samples with whole features (``atorch.intra_layer.Linear(batch_per_rank=True)``), and
``expert_mode=True`` is AxoNN's sliced one. ``clip_grad_norm_``, ``optimize_communication``,
``drop`` and ``gather`` are atorch.intra_layer's; ``sync_gradients`` is too, and does nothing
inside ``no_grad_sync()``, as in AxoNN.

    ax.init(1, 2, 2, mixed_precision=True)         # G_inter, G_data, G_intra_r (AxoNN's order)
    loader = ax.create_dataloader(dataset, 64, 8)  # global batch, micro batch
    model, optimizer = ax.register_model_and_optimizer(model, optimizer)
    ax.register_loss_fn(torch.nn.CrossEntropyLoss())
    for x, y in loader:
        optimizer.zero_grad()
        loss = ax.run_batch(x, y)                  # forward + backward over the micro batches
        optimizer.step()                           # skipped after an fp16 overflow

The grid is atorch's (:func:`atorch.intra_layer.init`); ``comm_handle`` names its groups as
AxoNN does. What differs: ranks are numbered row fastest, then column, depth, data, pipeline
(AxoNN: column fastest, then row, depth, pipeline, data), so read roles from ``comm_handle``,
not from the global rank; AxoNN's MPI pipeline (``G_inter > 1``) and CPU offload are not
ported (atorch's ``pipeline_parallel`` method pipelines models).
"""

import contextlib

import torch
import torch.distributed as dist

from atorch import intra_layer
from atorch.data import create_dataloader as _create_dataloader
from atorch.distributed.env import init_distributed
from atorch.distributed.topology import Topology
from atorch.errors import AtorchConfigError, NotSupportedError
from atorch.intra_layer import clip_grad_norm_, drop, gather, overlap  # noqa: F401 - AxoNN's names
from atorch.intra_layer.grads import _group_of, per_rank_batch, sample_ranks
from atorch.intra_layer.overlap import optimize_communication  # noqa: F401 - AxoNN code may take it from here

# AxoNN's module attributes, set by init.
is_initialized = False
comm_handle: "CommHandle | None" = None
computation_dtype: torch.dtype | None = None

_no_sync = False  # inside no_grad_sync()


@contextlib.contextmanager
def no_grad_sync():
    """AxoNN's ``no_grad_sync()``: :func:`sync_gradients` does nothing inside it, so micro batches
    accumulate local gradients and one call after the block reduces them.

    Example::

        for micro in micro_batches[:-1]:
            with ax.no_grad_sync():
                loss_fn(model(micro)).backward()
                ax.sync_gradients(model)           # skipped
        loss_fn(model(micro_batches[-1])).backward()
        ax.sync_gradients(model)                   # reduces the accumulated gradients once
    """
    global _no_sync
    before, _no_sync = _no_sync, True
    try:
        yield
    finally:
        _no_sync = before


def sync_gradients(model: torch.nn.Module, gradient_attr_name: str = "grad", mean: bool = False,
                   vectorize: bool = False, expert_mode: bool = False, **kwargs) -> None:
    """AxoNN's ``sync_gradients``: :func:`atorch.intra_layer.sync_gradients`, skipped inside
    :func:`no_grad_sync`."""
    if not _no_sync:
        intra_layer.sync_gradients(model, gradient_attr_name, mean, vectorize, expert_mode, **kwargs)


# AxoNN's dynamic loss scaling (the same constants).
_INITIAL_SCALE, _MIN_SCALE, _MAX_SCALE, _SCALING_WINDOW = 2.0**16, 2.0**10, 2.0**24, 200


class CommHandle:
    """AxoNN's ``ax.comm_handle``: this rank's place on the grid and its process groups.

    Groups (AxoNN's names): ``inner_intra_layer_parallel_group`` (the column group: a layer's
    input features), ``outer_intra_layer_parallel_group`` (the row group: its output features),
    ``depth_intra_layer_parallel_group``, ``intra_layer_group`` (row x column x depth),
    ``data_parallel_group`` (the ``G_data`` ranks holding the same shards; ``coll_nccl_comm`` is
    the same group). Every group exists, of size 1 where the dim is 1, when a process group runs.
    """

    def __init__(self, topology: Topology, G_inter: int, G_data: int, G_intra_r: int, G_intra_c: int,
                 G_intra_d: int):
        self.topology = topology
        self.G_inter, self.G_data = G_inter, G_data
        self.G_intra_r, self.G_intra_c, self.G_intra_d = G_intra_r, G_intra_c, G_intra_d
        self.G_intra = G_intra_r * G_intra_c * G_intra_d
        self.world_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.intra_layer_parallel_rank = topology.coordinate("tensor")
        self.intra_layer_row_parallel_rank = topology.coordinate("row")
        self.intra_layer_column_parallel_rank = topology.coordinate("col")
        self.intra_layer_depth_parallel_rank = topology.coordinate("depth")
        self.inter_layer_parallel_rank = topology.coordinate("pipeline")
        self.data_parallel_rank = topology.coordinate("data")
        self.inner_intra_layer_parallel_group = topology.group("col")
        self.outer_intra_layer_parallel_group = topology.group("row")
        self.depth_intra_layer_parallel_group = topology.group("depth")
        self.intra_layer_group = topology.group("tensor")
        self.data_parallel_group = self.coll_nccl_comm = topology.group("data")

    def get_intra_layer_groups(self, tensor_parallel_dims=None):
        """(inner, outer, depth) groups of a layer, as AxoNN's ``Linear`` reads them."""
        if tensor_parallel_dims is not None:
            raise NotSupportedError("tensor_parallel_dims (per-layer grids) is not ported; every layer uses the grid")
        return (self.inner_intra_layer_parallel_group, self.outer_intra_layer_parallel_group,
                self.depth_intra_layer_parallel_group)


class Linear(intra_layer.Linear):
    """AxoNN's ``Linear(in_features, out_features, transpose=, bias=, skip_bias_add=, init_method=,
    expert_mode=)``: by default each rank passes its own samples with whole features and gets
    their whole output features (AxoNN's non-expert mode; the layer regroups the batch);
    ``expert_mode=True`` is the sliced contract. As in AxoNN, the weight is drawn in full by
    ``init_method`` (default: nn.Linear's) and sliced, and the bias starts at zero; unlike AxoNN,
    the bias is whole on every rank. Older AxoNN's keywords: ``use_easy_api`` (``True``: whole
    features, i.e. ``expert_mode=False``) and ``async_comm_in_backward_pass`` (the overlap of
    :func:`optimize_communication`; the numbers do not change) are accepted.
    """

    def __init__(self, in_features: int, out_features: int, *args, transpose: bool = False, bias: bool = True,
                 skip_bias_add: bool = False, init_method=None, expert_mode: bool | None = None,
                 use_easy_api: bool | None = None, async_comm_in_backward_pass: bool = True, **kwargs):
        if args:
            raise AtorchConfigError(
                f"axonn Linear({in_features}, {out_features}, {', '.join(map(repr, args))}): AxoNN takes only the "
                "two sizes positionally; pass bias=, transpose= and the rest by keyword"
            )
        if use_easy_api is not None and expert_mode is not None and bool(expert_mode) == bool(use_easy_api):
            raise AtorchConfigError(
                f"axonn Linear(expert_mode={expert_mode}, use_easy_api={use_easy_api}) contradict each other "
                "(use_easy_api=True is expert_mode=False); pass one of them"
            )
        if kwargs.get("tensor_parallel_dims") is not None:
            raise NotSupportedError("tensor_parallel_dims (per-layer grids) is not ported; every layer uses the grid")
        kwargs.pop("tensor_parallel_dims", None)
        expert = bool(expert_mode) if expert_mode is not None else use_easy_api is False
        super().__init__(in_features, out_features, bias=bias, transpose=transpose, skip_bias_add=skip_bias_add,
                         expert_mode=expert, batch_per_rank=not expert, **kwargs)
        with torch.no_grad():
            if init_method is not None:
                full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype,
                                   device=self.weight.device)
                init_method(full)
                self.weight.copy_(self.shard(full))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor, scatter_input: bool | None = None, gather_output: bool | None = None,
                cache_weights_in_all_gather: bool = False):
        """AxoNN's forward; ``cache_weights_in_all_gather`` is :func:`optimize_communication`'s
        ``cache_weights`` (the numbers do not change)."""
        return super().forward(x, scatter_input, gather_output)


def auto_parallelize(topology: Topology | None = None):
    """AxoNN's ``auto_parallelize()``: inside the block ``nn.Linear`` builds 3D layers that take a
    per-rank batch, as AxoNN's do (see :func:`atorch.intra_layer.auto_parallelize`)."""
    return intra_layer.auto_parallelize(topology, batch_per_rank=True)


class _Flow:
    """What AxoNN's training flow registers: model, optimizer, loss, micro batch, loss scale."""

    def __init__(self):
        self.model = self.optimizer = self.loss_fn = self.micro_batch_size = None
        self.fp16_allreduce = True
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (fp16 model param, fp32 master)
        self.loss_scale, self.good_steps, self.skip_next_step = _INITIAL_SCALE, 0, False


_flow = _Flow()


def init(G_inter: int, G_data: int, G_intra_r: int = 1, G_intra_c: int = 1, G_intra_d: int = 1,
         gpus_per_node: int | None = None, mixed_precision: bool = False, fp16_allreduce: bool = True,
         cpu_offload: bool = False) -> None:
    """AxoNN's ``ax.init`` (its positional order: ``G_inter`` first, then ``G_data``).

    Starts the process group if torchrun launched this process and it is not running yet
    (``gpus_per_node`` is not needed: the device comes from ``LOCAL_RANK``), builds the grid
    with :func:`atorch.intra_layer.init` and sets ``comm_handle``. ``mixed_precision=True``:
    :func:`register_model_and_optimizer` keeps the model in fp16 and the optimizer on fp32
    copies, and :func:`run_batch` scales the loss dynamically; ``fp16_allreduce`` reduces the
    gradients in fp16 (then descales) or in fp32 (after descaling), as AxoNN does.
    """
    global is_initialized, comm_handle, computation_dtype, _flow
    if G_inter != 1:
        raise NotSupportedError(
            f"ax.init(G_inter={G_inter}): AxoNN's MPI pipeline is not ported to atorch.compat.axonn; use G_inter=1 "
            "(and atorch's pipeline_parallel method to pipeline a model)"
        )
    if cpu_offload:
        raise NotSupportedError("ax.init(cpu_offload=True): AxoNN's CPU offload is not ported; use cpu_offload=False")
    init_distributed()
    topology = intra_layer.init(G_inter, G_data, G_intra_r, G_intra_c, G_intra_d)
    comm_handle = CommHandle(topology, G_inter, G_data, G_intra_r, G_intra_c, G_intra_d)
    computation_dtype = torch.float16 if mixed_precision else torch.float32
    _flow = _Flow()
    _flow.fp16_allreduce = bool(fp16_allreduce)
    is_initialized = True


def _topology() -> Topology:
    if not is_initialized:
        raise AtorchConfigError("call ax.init(G_inter, G_data, G_intra_r, G_intra_c, G_intra_d) first")
    return comm_handle.topology


def create_dataloader(dataset, global_batch_size: int, micro_batch_size: int | None = None, num_workers: int = 0,
                      *args, **kwargs) -> torch.utils.data.DataLoader:
    """AxoNN's ``ax.create_dataloader``: :func:`atorch.data.create_dataloader` on the grid of
    :func:`init`; :func:`run_batch` splits each batch into micro batches of this size."""
    loader = _create_dataloader(dataset, global_batch_size, micro_batch_size, num_workers, *args,
                                topology=_topology(), **kwargs)
    _flow.micro_batch_size = loader.micro_batch_size
    return loader


@torch.no_grad()
def register_model_and_optimizer(model_shard: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """AxoNN's registration: returns ``(model, optimizer)`` to train with :func:`run_batch`.

    Parameters are averaged over the ranks that should hold equal copies (so every replica
    starts the same). With ``mixed_precision``, the model is cast to fp16 and the optimizer
    steps fp32 copies of its parameters (taken before the cast), copied back into the model after every step that is
    not skipped (an fp16 overflow skips it, as in AxoNN).
    """
    topology = _topology()
    per_rank = per_rank_batch(model_shard)
    for param in model_shard.parameters():
        group = _group_of(param, topology, per_rank)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(param.data, group=group)
            param.data.div_(dist.get_world_size(group))
    _flow.model, _flow.optimizer, _flow.pairs = model_shard, optimizer, []
    if computation_dtype != torch.float16:
        return model_shard, optimizer
    for group in optimizer.param_groups:
        for i, param in enumerate(group["params"]):
            if param.requires_grad:
                # copied before the cast, so the fp32 copies start from the full-precision weights
                master = param.detach().float().clone()
                group["params"][i] = master
                _flow.pairs.append((param, master))
    model_shard.half()
    optimizer.load_state_dict(optimizer.state_dict())  # re-key any state to the fp32 copies
    step = optimizer.step

    def step_masters(*args, **kwargs):
        if _flow.skip_next_step:
            return None
        result = step(*args, **kwargs)
        with torch.no_grad():
            for param, master in _flow.pairs:
                param.copy_(master)
        return result

    optimizer.step = step_masters
    return model_shard, optimizer


def register_loss_fn(loss_fn) -> None:
    """AxoNN's ``ax.register_loss_fn``: the loss :func:`run_batch` computes (on fp32 outputs)."""
    _topology()
    _flow.loss_fn = loss_fn


def run_batch(batch: torch.Tensor, labels: torch.Tensor, eval_mode: bool = False) -> float:
    """AxoNN's ``ax.run_batch``: forward and backward over this rank's batch, micro batch by micro
    batch, then the gradient reduction; returns this rank's mean loss.

    Each micro batch's loss is divided by (data x depth ranks) x (micro batches), and the
    gradients are summed over those ranks, so they equal the serial model's on the global batch
    with a mean loss. With layers that take a per-rank batch (this module's ``Linear``), the
    row x column ranks count as data ranks too (AxoNN's own reduction over every rank). Call ``optimizer.zero_grad()`` before it and ``optimizer.step()`` after.
    """
    topology = _topology()
    if _flow.model is None or _flow.loss_fn is None:
        raise AtorchConfigError("call ax.register_model_and_optimizer(...) and ax.register_loss_fn(...) first")
    micro = _flow.micro_batch_size or batch.shape[0]
    if batch.shape[0] % micro:
        raise AtorchConfigError(f"run_batch: a batch of {batch.shape[0]} does not split into micro batches of {micro}")
    count = batch.shape[0] // micro
    half = computation_dtype == torch.float16
    if half and batch.is_floating_point():
        batch = batch.half()
    _flow.model.train(not eval_mode)
    # the ranks whose gradients sum_gradients adds: data x depth, and row x column as well when the
    # model's layers take a per-rank batch (AxoNN's default; ranks of a row x column group then
    # count as data parallel even when they were given the same samples)
    ranks = sample_ranks(topology, per_rank_batch(_flow.model))
    scale = (_flow.loss_scale if half else 1.0) / (ranks * count)
    total = 0.0
    for start in range(0, batch.shape[0], micro):
        with torch.set_grad_enabled(not eval_mode):
            loss = _flow.loss_fn(_flow.model(batch[start:start + micro]).float(), labels[start:start + micro])
        total += loss.item()
        if not eval_mode:
            (loss * scale).backward()
    if not eval_mode:
        overlap.flush()  # inside optimize_communication: reduce-scatters still in flight land in .grad first
        _reduce_gradients(topology, half)
    return total / count


@torch.no_grad()
def _reduce_gradients(topology: Topology, half: bool) -> None:
    if not half:
        intra_layer.sync_gradients(_flow.model, topology=topology)
        return
    pairs = [(param, master) for param, master in _flow.pairs if param.grad is not None]
    if _flow.fp16_allreduce:  # reduce in fp16 first, then descale (AxoNN: avoids underflow)
        intra_layer.sync_gradients(_flow.model, topology=topology)
        for param, master in pairs:
            param.main_grad = param.grad.float().div_(_flow.loss_scale)
    else:  # descale first, then reduce in fp32 (avoids overflow)
        for param, master in pairs:
            param.main_grad = param.grad.float().div_(_flow.loss_scale)
        intra_layer.sync_gradients(_flow.model, "main_grad", topology=topology)
    overflow = torch.zeros(1, device=pairs[0][1].device if pairs else None)
    for param, master in pairs:
        master.grad, param.grad = param.main_grad, None
        del param.main_grad
        overflow += (~torch.isfinite(master.grad)).any().float()
    if dist.is_initialized():
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
    _flow.skip_next_step = bool(overflow.item())
    if _flow.skip_next_step:
        _flow.loss_scale, _flow.good_steps = max(_flow.loss_scale / 2, _MIN_SCALE), 0
    else:
        _flow.good_steps += 1
        if _flow.good_steps == _SCALING_WINDOW:
            _flow.loss_scale, _flow.good_steps = min(_flow.loss_scale * 2, _MAX_SCALE), 0
