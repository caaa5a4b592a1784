"""PipelineModel: a model split into stages over the ``pipeline`` ranks, run by a torch schedule.

The model is split by module names (see :mod:`atorch.pipeline.layouts`), each rank keeps only
its own stages' parameters, and a ``torch.distributed.pipelining`` schedule moves microbatches
through the stages. The stage holding the end of the model computes the loss.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from atorch.distributed.topology import Topology
from atorch.errors import MethodConfigError, NotSupportedError, WorldSizeError
from atorch.pipeline.layouts import layout_for
from atorch.pipeline.loss import pick_loss, reduce_losses, split_batch
from atorch.pipeline.partition import balanced_ranges, ranges_from_cuts
from atorch.pipeline.schedules import build_schedule, check_schedule, local_stage_indices


class PipelineModel(nn.Module):
    """A model run as a pipeline over the ``pipeline`` dim of ``topology`` (NxD's pipeline API).

    ``module.forward`` returns the loss, or an output the loss is picked from by
    ``output_loss_value_spec`` (a tuple or dict of booleans shaped like the output, ``True`` at
    the loss; default: the output itself if it is a tensor, else its ``loss`` field or first
    item), or ``loss_fn(microbatch_kwargs, output)`` computes it. Stage boundaries come from
    ``pipeline_cuts`` (the names of the last module of each stage but the last) or
    ``auto_partition=True`` (balanced by parameter count over the transformer layers).

    ``topology`` (an :class:`atorch.distributed.topology.Topology`) gives the pipeline, data and
    tensor groups; without it the whole world is one pipeline. ``stage_transform(stage_module)``
    runs on each local stage once it is materialized (mixed_parallel shards it for tensor
    parallelism). ``param_init_fn(unit)`` initializes each local unit of a model built on the
    meta device (the unit has been moved to this rank's device with ``to_empty``).

    Example (2 processes)::

        model = PipelineModel(nn.Sequential(*layers), num_microbatches=4, auto_partition=True,
                              loss_fn=lambda mb, out: F.cross_entropy(out, mb["target"]))
        optim = torch.optim.SGD(model.local_parameters(), lr=0.1)
        loss = model.run_train(input=x, target=y)  # forward and backward of all microbatches
        optim.step(); optim.zero_grad()
    """

    def __init__(self, module: nn.Module, transformer_layer_cls: type | None = None, num_microbatches: int = 1,
                 virtual_pipeline_size: int = 1, output_loss_value_spec: Any = None, return_mb_loss: bool = False,
                 broadcast_and_average_loss: bool = False, pipeline_cuts: list[str] | None = None,
                 input_names: list[str] | None = None, leaf_module_cls: list | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, use_zero1_optimizer: bool = False,
                 auto_partition: bool = False, deallocate_pipeline_outputs: bool = False, schedule: str = "1f1b",
                 *, loss_fn: Callable | None = None, topology: Topology | None = None,
                 stage_transform: Callable[[nn.Module], None] | None = None, device: torch.device | None = None):
        super().__init__()
        _refuse_unsupported(use_zero1_optimizer, deallocate_pipeline_outputs, leaf_module_cls)
        if not dist.is_initialized():
            raise WorldSizeError("PipelineModel needs a process group; launch with torchrun and call "
                                 "atorch.init_distributed() first")
        if num_microbatches < 1:
            raise MethodConfigError(f"num_microbatches is {num_microbatches}; it must be at least 1")
        self.topology = topology or Topology.build([("pipeline", dist.get_world_size())])
        self.schedule_name = check_schedule(schedule, virtual_pipeline_size)
        self.num_microbatches = num_microbatches
        self.return_mb_loss, self.broadcast_and_average_loss = return_mb_loss, broadcast_and_average_loss
        self.output_loss_value_spec, self.loss_fn = output_loss_value_spec, loss_fn
        self.device = device or torch.device("cpu")
        pp_size, pp_rank = self.topology.size("pipeline"), self.topology.coordinate("pipeline")
        self.num_stages = pp_size * virtual_pipeline_size
        self.layout = layout_for(module, input_names)
        layers = self.layout.layer_units
        if transformer_layer_cls is not None:
            layers = [n for n in self.layout.units if isinstance(module.get_submodule(n), transformer_layer_cls)]
            if not layers:
                raise MethodConfigError(f"transformer_layer_cls {transformer_layer_cls.__name__} matches none of the "
                                        f"model's units {self.layout.units}")
        self.stage_units = self._partition(module, pipeline_cuts, auto_partition, layers)
        _refuse_tied_weights(module, self.stage_units)
        self.local_stage_ids = local_stage_indices(self.schedule_name, pp_rank, pp_size, virtual_pipeline_size)
        self.local_units = [n for i in self.local_stage_ids for n in self.stage_units[i]]
        self._materialize(module, param_init_fn)
        # Kept out of nn.Module's children: the user's module holds every unit, local or not.
        self._module = [module]
        self.stage_modules = nn.ModuleList()
        stages = []
        for index in self.local_stage_ids:
            stage_module = self.layout.stage_module(self.stage_units[index], index == 0, index == self.num_stages - 1)
            if stage_transform is not None:
                stage_transform(stage_module)
                _write_back(module, self.stage_units[index], stage_module)
            self.stage_modules.append(stage_module)
            stages.append(PipelineStage(stage_module, index, self.num_stages, self.device,
                                        group=self.topology.group("pipeline")))
        self.stages = stages
        _mark_shards(self.local_parameters(), self.topology)
        self.has_first = 0 in self.local_stage_ids
        self.has_last = self.num_stages - 1 in self.local_stage_ids
        self._schedule = build_schedule(self.schedule_name, stages, num_microbatches, self._microbatch_loss)
        self._microbatches: list[dict] = []

    def _partition(self, module, cuts, auto, layers) -> list[list[str]]:
        units = self.layout.units
        if cuts is not None and auto:
            raise MethodConfigError("give pipeline_cuts or auto_partition=True, not both")
        if cuts is not None:
            return ranges_from_cuts(units, list(cuts), self.num_stages)
        if auto or self.num_stages == 1:
            return balanced_ranges(module, units, layers, self.num_stages)
        raise MethodConfigError(f"PipelineModel needs stage boundaries for {self.num_stages} stages: give "
                                f"pipeline_cuts (names of the last module of each stage, from {units}) or "
                                "auto_partition=True")

    def _materialize(self, module: nn.Module, param_init_fn) -> None:
        local = set(self.local_units)
        on_meta = any(p.is_meta for p in module.parameters())
        for name in self.layout.units:
            unit = module.get_submodule(name)
            if name not in local:
                unit.to("meta")  # free what other ranks hold
            elif any(t.is_meta for t in [*unit.parameters(), *unit.buffers()]):
                if param_init_fn is None:
                    raise MethodConfigError(f"the model's unit {name!r} is on the meta device; pass param_init_fn "
                                            "to initialize the local stage")
                unit.to_empty(device=self.device)
                with torch.no_grad():
                    param_init_fn(unit)
            else:
                unit.to(self.device)
        if on_meta:
            self.layout.materialize_shared(self.device)

    # The optimizer's view: only what this rank holds.
    def local_named_parameters(self, prefix: str = "", recurse: bool = True):
        """``(name, parameter)`` of this rank's stages, named as in the user's module."""
        for name in self.local_units:
            yield from self._module[0].get_submodule(name).named_parameters(prefix=f"{prefix}{name}")

    def local_parameters(self):
        """This rank's parameters, for the optimizer."""
        for _, param in self.local_named_parameters():
            yield param

    def local_named_modules(self):
        """``(name, module)`` of every module in this rank's stages, named as in the user's module."""
        for name in self.local_units:
            yield from self._module[0].get_submodule(name).named_modules(prefix=name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.local_named_parameters(prefix)

    def forward(self, *args, **kwargs):
        """The same as :meth:`run_train` (forward and backward of the batch); a single dict
        argument is taken as the keyword arguments."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            kwargs = args[0]
        elif args:
            raise MethodConfigError("PipelineModel takes the model's inputs as keyword arguments (or one dict); "
                                    "name them, e.g. model(input_ids=ids, labels=labels)")
        return self.run_train(**kwargs)

    def run_train(self, **kwargs):
        """Forward and backward of every microbatch of ``kwargs`` (the model's forward kwargs).

        Returns the mean microbatch loss (a list with ``return_mb_loss``) on the rank holding the
        last stage and ``None`` elsewhere; with ``broadcast_and_average_loss`` every rank gets it,
        averaged over the data-parallel ranks. Gradients are left in the local parameters,
        already averaged over data-parallel ranks.
        """
        return self._run(kwargs, train=True)

    @torch.no_grad()
    def run_eval(self, **kwargs):
        """Forward only; returns the loss as :meth:`run_train` does."""
        return self._run(kwargs, train=False)

    def _run(self, kwargs, train: bool):
        self.layout.check_kwargs(list(kwargs))
        self._microbatches = split_batch(kwargs, self.num_microbatches)
        inputs = self.layout.inputs or list(kwargs)[:1]
        missing = [name for name in inputs if name not in kwargs]
        if missing:
            raise MethodConfigError(f"PipelineModel's first stage takes {inputs}; {missing} missing from the call")
        args = tuple(kwargs[name].to(self.device) for name in inputs) if self.has_first else ()
        target = torch.arange(self.num_microbatches) if self.has_last else None
        losses: list = []
        run = self._schedule.step if train else self._schedule.eval
        extra = {"return_outputs": False} if train else {}
        run(*args, target=target, losses=losses, **extra)
        self._microbatches = []
        if train:
            self._average_data_parallel_grads()
        last_rank = self.stages[0].stage_index_to_group_rank[self.num_stages - 1]
        return reduce_losses(losses if self.has_last else None, self.topology, last_rank, self.num_microbatches,
                             self.return_mb_loss, self.broadcast_and_average_loss)

    def _microbatch_loss(self, output, index: torch.Tensor) -> torch.Tensor:
        # The schedule hands each microbatch's "target": its index (the whole range while it infers shapes).
        batch = self._microbatches[int(index.reshape(-1)[0]) if not index.is_meta and index.numel() else 0]
        inputs = set(self.layout.inputs or list(batch)[:1])
        model_output = self.layout.model_output(output, {k: v for k, v in batch.items() if k not in inputs})
        if self.loss_fn is not None:
            return self.loss_fn(batch, model_output)
        return pick_loss(model_output, self.output_loss_value_spec)

    def _average_data_parallel_grads(self) -> None:
        group, size = self.topology.data_parallel_group, self.topology.data_parallel_size
        if size == 1:
            return
        for param in self.local_parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad /= size


def _refuse_unsupported(use_zero1_optimizer, deallocate_pipeline_outputs, leaf_module_cls) -> None:
    if use_zero1_optimizer:
        raise NotSupportedError("use_zero1_optimizer is not implemented by atorch's PipelineModel; build a "
                                "ZeroRedundancyOptimizer over model.local_parameters() yourself, or leave it False")
    if deallocate_pipeline_outputs:
        raise NotSupportedError("deallocate_pipeline_outputs is not implemented (torch's schedules keep stage "
                                "outputs until their backward); leave it False")
    if leaf_module_cls:
        raise NotSupportedError("leaf_module_cls is for tracing, and atorch's PipelineModel splits by module names "
                                "without tracing; leave it None")


def _refuse_tied_weights(module: nn.Module, stage_units: list[list[str]]) -> None:
    owner: dict[int, int] = {}
    for stage, names in enumerate(stage_units):
        for name in names:
            for pname, param in module.get_submodule(name).named_parameters():
                if owner.setdefault(id(param), stage) != stage:
                    raise NotSupportedError(
                        f"parameter {name}.{pname} is shared by stages {owner[id(param)]} and {stage} (tied weights); "
                        "PipelineModel does not synchronize tied weights across stages: untie them (e.g. "
                        "tie_word_embeddings=False) or put both users in one stage with pipeline_cuts")


def _write_back(module: nn.Module, names: list[str], stage_module: nn.Module) -> None:
    """Put units a stage transform replaced (a tensor-parallel embedding or head) back into the
    user's module, so names and local parameters keep following the running modules."""
    for name, unit in zip(names, stage_module.units):
        if module.get_submodule(name) is not unit:
            module.set_submodule(name, unit)


def _mark_shards(params, topology: Topology) -> None:
    """Tell ``atorch.auto.clip_grad_norm`` (which sums a parameter's norm over its ``shard_group``)
    that each pipeline rank holds different parameters, and a tensor-parallel shard is also
    different across the tensor ranks, so it computes the whole model's norm."""
    if topology.size("pipeline") == 1:
        return
    pipeline_tensor = None
    if topology.size("tensor") > 1:  # every rank flattens (a collective), whatever it holds
        names = sorted(("pipeline", "tensor"), key=topology.mesh.mesh_dim_names.index)
        pipeline_tensor = topology.submesh(*names)._flatten("pipeline_tensor").get_group()
    for param in params:
        if getattr(param, "shard_group", None) is not None and not getattr(param, "tensor_model_parallel", False):
            continue  # a tensor-parallel slice's group is widened to pipeline x tensor below
        sharded = getattr(param, "tensor_model_parallel", False) and pipeline_tensor is not None
        param.shard_group = pipeline_tensor if sharded else topology.group("pipeline")
