"""The DeepSpeed ZeRO path of zero1/zero2, imported only when a strategy asks for it."""

import importlib.util
from typing import Any

import torch

from atorch.amp.optimizer import ScaledLossFunc
from atorch.auto.context import ModelContext, unwrap
from atorch.utils.optim import unwrap_optimizer


def deepspeed_unavailable() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "use_ds_zero needs DeepSpeed, which is not installed (pip install 'atorch[deepspeed]')"
    return None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(ctx: ModelContext, stage: int, user_config: dict[str, Any] | None) -> dict:
    micro_batch = ctx.dataloader.batch_size if ctx.dataloader is not None else 1
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        # DeepSpeed's ZeRO optimizer clips at norm 1.0 unless told otherwise, which changed the
        # updates of any model whose gradient norm passed 1; atorch clips only when asked
        # (ds_config={"gradient_clipping": x}, or clip_grad_norm in the loop).
        "gradient_clipping": 0.0,
    }
    amp = ctx.strategy.get("amp_native") if ctx.strategy is not None else None
    if amp is not None:
        # DeepSpeed keeps fp32 master weights and scales fp16 losses itself.
        config["bf16" if amp.dtype == torch.bfloat16 else "fp16"] = {"enabled": True}
    return _merge(config, user_config or {})


# DeepSpeed's zero_optimization.reduce_bucket_size default, in elements
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000


def reduce_bucket_elements(user_config: dict[str, Any] | None) -> int:
    """The elements of DeepSpeed's gradient bucket: ``zero_optimization.reduce_bucket_size`` of the
    user's ds_config, else DeepSpeed's default."""
    zero = (user_config or {}).get("zero_optimization", {})
    return int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET_ELEMENTS))


def zero_memory_terms(cost, user_config: dict[str, Any] | None) -> None:
    """What DeepSpeed's ZeRO-1/2 engine holds beyond the sharded optimizer state (cost-model
    terms, on a :class:`~atorch.auto.search.cost.StepCost`):

    - its gradient bucket (``ipg_buffer``), allocated whole at ``reduce_bucket_size`` elements in
      the compute dtype however small the model: 1.0 GB under bf16 and 2.0 GB in fp32 at
      DeepSpeed's default, measured as the peak of a 3 MB Llama on 2 gloo ranks (the estimate
      without it was 0.01 of that);
    - under bf16/fp16 (amp_native hands its dtype to DeepSpeed) the model itself in the 2-byte
      dtype, plus the rank's partition of the fp32 master weights; no autocast weight copies.
    """
    elements = reduce_bucket_elements(user_config)
    element = cost.element_bytes()
    if "amp_native" in cost.methods and element > 2:
        piece = cost.params
        cost.params = piece * 2 / element + piece / cost.dp_size
        cost.copies = 0.0
        element = 2
    cost.buffers = elements * element


class TopologyMpu:
    """Megatron's ``mpu`` interface over a :class:`Topology`, for ``deepspeed.initialize``.

    Without one DeepSpeed takes the whole world as its data-parallel group: on a tensor x data
    layout it broadcast tensor rank 0's shards over the other tensor ranks at start and averaged
    gradients of different shards together. With it, DeepSpeed broadcasts, reduces and
    partitions over the data-parallel ranks only, and counts a replicated parameter's gradient
    norm once per model-parallel group (the tensor and pipeline dims).
    """

    def __init__(self, topology):
        from atorch.distributed.topology import DATA_PARALLEL_DIMS

        self.topology = topology
        mesh = topology.mesh
        model_dims = [name for name in (mesh.mesh_dim_names if mesh is not None else ())
                      if name not in DATA_PARALLEL_DIMS and topology.size(name) > 1]
        # None marks an absent dim to DeepSpeed (no collective), never the world.
        self._model_group = None
        if len(model_dims) == 1:
            self._model_group = topology.group(model_dims[0])
        elif model_dims:  # a collective call: every rank wraps its engine here
            self._model_group = mesh[tuple(model_dims)]._flatten("model_parallel").get_group()

    def get_data_parallel_group(self):
        return self.topology.data_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return self.topology.data_parallel_size

    def get_data_parallel_rank(self) -> int:
        return self.topology.data_parallel_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        group = self.topology.data_parallel_group
        return list(range(_world_size())) if group is None else torch.distributed.get_process_group_ranks(group)

    def get_model_parallel_group(self):
        return self._model_group

    def get_model_parallel_world_size(self) -> int:
        return 1 if self._model_group is None else torch.distributed.get_world_size(self._model_group)

    def get_model_parallel_rank(self) -> int:
        return 0 if self._model_group is None else torch.distributed.get_rank(self._model_group)

    def get_tensor_model_parallel_group(self):
        return self.topology.group("tensor")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.size("tensor")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.coordinate("tensor")

    def get_tensor_model_parallel_src_rank(self) -> int:
        group = self.topology.group("tensor")
        return torch.distributed.get_rank() if group is None else torch.distributed.get_global_rank(group, 0)


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def wrap_deepspeed(ctx: ModelContext, stage: int, user_config: dict[str, Any] | None = None) -> None:
    """Hand the model and optimizer to ``deepspeed.initialize`` with ZeRO ``stage``.

    DeepSpeed owns the backward pass and the step: the result's model and optimizer are its
    engine, and ``result.args["use_optim_backward"]`` tells the loop to call
    ``result.optim.backward(loss)`` then ``result.optim.step()`` (which also zeroes gradients).
    """
    import deepspeed

    # amp_native's loss scaling and step wrapper give way to DeepSpeed's own precision handling.
    if isinstance(ctx.loss_func, ScaledLossFunc):
        ctx.loss_func = ctx.loss_func.loss_func
    optimizer = unwrap_optimizer(ctx.optim)
    engine, _, _, _ = deepspeed.initialize(
        model=unwrap(ctx.model), optimizer=optimizer, config=deepspeed_config(ctx, stage, user_config),
        dist_init_required=False, mpu=TopologyMpu(ctx.topology),
    )
    ctx.model, ctx.optim = engine, engine
    ctx.args["use_optim_backward"] = True
    ctx.args["requires_set_gradient_accumulation_boundary"] = True
