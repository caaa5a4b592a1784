"""PipelineModel: a model split into stages over the ``pipeline`` ranks, run by a torch schedule.

The model is split at module boundaries: by a layout that knows the model family (the fast path,
:mod:`atorch.pipeline.layouts`), or, for any other model, by tracing its forward
(:mod:`atorch.pipeline.traced`). Each rank keeps only its own stages' parameters, and a
``torch.distributed.pipelining`` schedule moves microbatches through the stages. The stage
holding the end of the model computes the loss.
"""

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from atorch.distributed.topology import Topology
from atorch.errors import MethodConfigError, NotSupportedError, WorldSizeError
from atorch.loss.contract import STEP_TOTALS, batch_samples, count_of, samples_of, weighed_part, with_count
from atorch.loss.counting import rule_for
from atorch.parallel_layers.expert_dispatch import average_over_copies
from atorch.pipeline import failure
from atorch.pipeline.failure import PipelineStepError
from atorch.pipeline.grad_sync import BUCKET_BYTES, GradSync, summed_params
from atorch.pipeline.layouts import layout_for
from atorch.pipeline.loss import pick_loss, reduce_losses, split_batch
from atorch.pipeline.partition import balanced_ranges, ranges_from_cuts
from atorch.pipeline.schedules import build_schedule, check_schedule, deallocate_after_send, local_stage_indices
from atorch.sharding.fsdp2 import held_per_rank


class PipelineModel(nn.Module):
    """A model run as a pipeline over the ``pipeline`` dim of ``topology`` (NxD's pipeline API).

    ``module.forward`` returns the loss, or an output the loss is picked from by
    ``output_loss_value_spec`` (a tuple or dict of booleans shaped like the output, ``True`` at
    the loss; default: the output itself if it is a tensor, else its ``loss`` field or first
    item), or ``loss_fn(microbatch_kwargs, output)`` computes it. Stage boundaries come from
    ``pipeline_cuts`` (the names of the last module of each stage but the last) or
    ``auto_partition=True`` (balanced by parameter count over the transformer layers).
    ``leaf_module_cls`` (classes) are never split inside; ``input_names`` are the forward
    arguments the first stage takes (a traced model's other arguments go to the loss).

    Models no layout knows are traced (torch.export, on the meta device, at the first call);
    :func:`atorch.pipeline.pipeline_eligibility` says beforehand whether a model splits. Weights
    shared by two stages (a tied embedding and head) are kept equal: their gradients are summed
    over the stages that hold them.

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

    # Gradients of at least this many bytes are summed over the data ranks alone, smaller ones in
    # packed buckets of up to it (atorch.pipeline.grad_sync); set before the first step.
    grad_bucket_bytes = BUCKET_BYTES

    def __init__(self, module: nn.Module, transformer_layer_cls: type | None = None, num_microbatches: int = 1,
                 virtual_pipeline_size: int = 1, output_loss_value_spec: Any = None, return_mb_loss: bool = False,
                 broadcast_and_average_loss: bool = False, pipeline_cuts: list[str] | None = None,
                 input_names: list[str] | None = None, leaf_module_cls: list | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, use_zero1_optimizer: bool = False,
                 auto_partition: bool = False, deallocate_pipeline_outputs: bool = False, schedule: str = "1f1b",
                 *, loss_fn: Callable | None = None, topology: Topology | None = None,
                 stage_transform: Callable[[nn.Module], None] | None = None, device: torch.device | None = None):
        super().__init__()
        self.use_zero1_optimizer = use_zero1_optimizer
        self.deallocate_pipeline_outputs = deallocate_pipeline_outputs
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
        self.layout = layout_for(module, input_names, transformer_layer_cls, leaf_module_cls)
        self.traced = getattr(self.layout, "traced", False)
        if self.traced and stage_transform is not None:
            raise NotSupportedError(f"{type(module).__name__} is split by tracing, and a stage transform (tensor "
                                    "parallelism) needs a layout; register one with atorch.pipeline.register_layout")
        layers = self.layout.layer_units
        if transformer_layer_cls is not None:
            layers = [n for n in self.layout.units if isinstance(module.get_submodule(n), transformer_layer_cls)]
            if not layers:
                raise MethodConfigError(f"transformer_layer_cls {transformer_layer_cls.__name__} matches none of the "
                                        f"model's units {self.layout.units}")
        self.stage_units = self._partition(module, pipeline_cuts, auto_partition, layers)
        # The schedule's sends and receives, the tied weights' and the loss's collectives: on a group
        # of the model's own where the pipeline spans the world, so that a failed step, which closes
        # the group (atorch.pipeline.failure), never closes the default group.
        self.pipeline_group = failure.own_group(self.topology.group("pipeline"))
        self.ties = _tied_parameters(module, self.stage_units)
        self.local_stage_ids = local_stage_indices(self.schedule_name, pp_rank, pp_size, virtual_pipeline_size)
        self.local_units = [n for i in self.local_stage_ids for n in self.stage_units[i]]
        self._materialize(module, param_init_fn)
        # Kept out of nn.Module's children: the user's module holds every unit, local or not.
        self._module = [module]
        self.stage_modules = nn.ModuleList()
        self.has_first = 0 in self.local_stage_ids
        self.has_last = self.num_stages - 1 in self.local_stage_ids
        self._sync_tied(weights=True)
        self._microbatches: list[dict] = []
        # Each microbatch's loss is weighted by what it counts (atorch/loss): its [count, sum,
        # samples] on the last stage, and K, the previous step's count per microbatch and data rank.
        # Keyed by microbatch: the schedule's first step also calls the loss to infer gradient shapes.
        self._parts: dict[int, torch.Tensor] = {}
        self._mb_losses: dict[int, torch.Tensor] = {}
        self._expected = 1.0
        self._count_rule = rule_for(module)
        self._failed: str | None = None  # why a step failed inside the schedule (the model cannot run again)
        self._in_schedule = False
        self._steps = 0
        self._traced_runs: dict = {}  # input shapes -> (stages, schedule), for a traced model
        self._grad_sync: tuple | None = None  # (the parameters it was built for, GradSync)
        if self.traced:  # stages are built from the trace (on these parameters), at the first call
            _mark_shards(self.local_parameters(), self.topology)
            self.stages, self._schedule = [], None
            return
        self._build_stages(module, stage_transform)

    def _build_stages(self, module: nn.Module, stage_transform: Callable[[nn.Module], None] | None) -> None:
        """This rank's stages from the layout (through ``stage_transform``, written back into
        ``module``), and their schedule."""
        stages = []
        for index in self.local_stage_ids:
            stage_module = self.layout.stage_module(self.stage_units[index], index == 0, index == self.num_stages - 1)
            if stage_transform is not None:
                stage_transform(stage_module)
                _write_back(module, self.stage_units[index], stage_module)
            self.stage_modules.append(stage_module)
            stages.append(_Stage(stage_module, index, self.num_stages, self.device, group=self.pipeline_group))
        self.stages = stages
        # After stage_transform: its tensor-parallel slices are new parameters.
        _mark_shards(self.local_parameters(), self.topology)
        if self.deallocate_pipeline_outputs:
            for stage in stages:
                deallocate_after_send(stage)
        self._schedule = build_schedule(self.schedule_name, stages, self.num_microbatches, self._microbatch_loss)

    def _traced_schedule(self, microbatch: dict):
        """The stages and schedule for this microbatch's input shapes (traced once per shape)."""
        inputs = tuple(microbatch[name] for name in self.layout.inputs)
        key = (tuple(self.layout.inputs),
               *((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in inputs))
        if key not in self._traced_runs:
            pipe = self.layout.trace(inputs, self.stage_units, adjacent=len(self.local_stage_ids) > 1)
            stages = []
            for index in self.local_stage_ids:
                stage_module = self.layout.bind(pipe, index, self.stage_units, self.device)
                self.stage_modules.append(stage_module)
                stages.append(pipe.build_stage(index, self.device, group=self.pipeline_group))
            if self.deallocate_pipeline_outputs:
                for stage in stages:
                    deallocate_after_send(stage)
            schedule = build_schedule(self.schedule_name, stages, self.num_microbatches, self._microbatch_loss)
            self._traced_runs[key] = (stages, schedule, self.layout.out)
        # each trace has its own output map (labels traced or not change what the last stage returns)
        self.stages, self._schedule, self.layout.out = self._traced_runs[key]

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
        local = set(self.local_units) | set(self.layout.shared_units() if self.traced else ())
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
        """``(name, parameter)`` of this rank's stages, named as in the user's module; a weight two
        local units share (a tied embedding and head on one rank) once, under its first name, as
        ``nn.Module.named_parameters`` does: listed twice, the optimizer stepped it twice and the
        data ranks' all-reduce scaled its gradient twice."""
        seen: set[int] = set()
        for name in self.local_units:
            for pname, param in self._module[0].get_submodule(name).named_parameters(prefix=f"{prefix}{name}"):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield pname, param

    def local_parameters(self):
        """This rank's parameters, for the optimizer."""
        for _, param in self.local_named_parameters():
            yield param

    def make_optimizer(self, optimizer_class: type = torch.optim.AdamW, **defaults) -> torch.optim.Optimizer:
        """``optimizer_class(local_parameters(), **defaults)``; with ``use_zero1_optimizer=True`` a
        ``ZeroRedundancyOptimizer`` instead, which shards the optimizer state over the data-parallel
        ranks of this rank's stages (each keeps about 1/data of it, steps its share and broadcasts
        the updated parameters). The gradients it reads are already averaged over those ranks.

        Example::

            model = PipelineModel(net, num_microbatches=4, auto_partition=True, use_zero1_optimizer=True,
                                  topology=Topology.build([("pipeline", 2), ("data", 2)]))
            optim = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        """
        params = list(self.local_parameters())
        if not self.use_zero1_optimizer or self.topology.data_parallel_size == 1:
            return optimizer_class(params, **defaults)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class,
                                       process_group=self.topology.data_parallel_group, **defaults)

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

        Returns the batch's loss on the rank holding the last stage and ``None`` elsewhere (with
        ``broadcast_and_average_loss`` every rank gets it): the mean over everything its losses
        count, every microbatch and data-parallel rank together (a Hugging Face model's label
        tokens, or what ``loss_fn`` says it counts: atorch/loss), so padded microbatches weigh
        as they would in one batch; with ``return_mb_loss``, each microbatch's own loss instead.
        Gradients are left in the local parameters: the gradient of that mean, the same on every
        data-parallel rank.
        """
        return self._run(kwargs, train=True)

    @torch.no_grad()
    def run_eval(self, **kwargs):
        """Forward only; returns the loss as :meth:`run_train` does."""
        return self._run(kwargs, train=False)

    def _run(self, kwargs, train: bool):
        if self._failed is not None:
            raise PipelineStepError(f"a previous step of this PipelineModel failed inside its schedule ({self._failed})")
        self._steps += 1
        try:
            return self._run_step(kwargs, train)
        except Exception as error:
            if not self._in_schedule:
                raise  # before the schedule: every rank raises the same (the batch, the trace)
            # Peers wait for this rank's messages: tell them why and close the groups, so that they
            # raise now rather than at the groups' timeout (atorch.pipeline.failure).
            self._failed = failure.stop(self._groups(), error, f"rank {dist.get_rank()} (stages "
                                        f"{self.local_stage_ids})", self._steps)
            if self._grad_sync is not None:  # its hooks, left armed, would sum on the closed group
                self._grad_sync[1].remove()
            raise PipelineStepError(self._failed) from error
        finally:
            self._in_schedule = False

    def _groups(self) -> list:
        """Every process group a step of this model communicates over."""
        groups = [self.pipeline_group, self.topology.data_parallel_group]
        for mesh in {id(m): m for m in (self.topology.mesh, self.topology.named_mesh) if m is not None}.values():
            groups += list(mesh.get_all_groups())  # tensor (or its 3D sub-dims) and data
        return groups

    def _run_step(self, kwargs, train: bool):
        kwargs = self.layout.prepare_batch(kwargs)
        self.layout.check_kwargs(list(kwargs))
        inputs = self.layout.inputs or list(kwargs)[:1]
        missing = [name for name in inputs if name not in kwargs]
        if missing:
            raise MethodConfigError(f"PipelineModel's first stage takes {inputs}; {missing} missing from the call")
        self._microbatches = split_batch(kwargs, self.num_microbatches)
        if self.traced:
            self._traced_schedule(self._microbatches[0])
        args = tuple(kwargs[name].to(self.device) for name in inputs) if self.has_first else ()
        target = torch.arange(self.num_microbatches) if self.has_last else None
        run = self._schedule.step if train else self._schedule.eval
        extra = {"return_outputs": False} if train else {}
        sync = self._sync_for_step() if train else None
        self._in_schedule = True  # from here a failure leaves the ranks out of step
        self._parts, self._mb_losses = {}, {}
        with _copies_unsynced(module for _, module in self.local_named_modules()):
            run(*args, target=target, losses=[], **extra)
        self._microbatches = []
        last_rank = self.stages[0].stage_index_to_group_rank[self.num_stages - 1]
        totals = self._step_totals(last_rank)
        if train:
            self._reduce_data_parallel_grads(self._expected / max(float(totals[0]), 1.0), sync)
            self._sync_tied(weights=False)
            if totals[0] > 0:
                self._expected = float(totals[0]) / (self.topology.data_parallel_size * self.num_microbatches)
        return self._returned_loss(totals, last_rank)

    def _step_totals(self, last_rank: int) -> torch.Tensor:
        """The step's ``[count, sum, samples]`` over every microbatch and data rank, on every rank."""
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        if self.has_last and self._parts:
            totals = torch.stack(list(self._parts.values())).sum(0).to(self.device)
        group = self.pipeline_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast(totals, group_src=last_rank, group=group)
        if self.topology.data_parallel_size > 1:
            dist.all_reduce(totals, group=self.topology.data_parallel_group)
        return totals

    def _returned_loss(self, totals: torch.Tensor, last_rank: int):
        if self.return_mb_loss:  # each microbatch's own mean, as NxD returns them
            losses = [self._mb_losses[i] for i in sorted(self._mb_losses)] if self.has_last else None
            return reduce_losses(losses, self.topology, self.pipeline_group, last_rank, self.num_microbatches, True,
                                 self.broadcast_and_average_loss)
        if not (self.has_last or self.broadcast_and_average_loss):
            return None
        # the global batch's mean over what its losses count (NaN where it counts nothing)
        loss = (totals[1] / totals[0]).float()
        setattr(loss, STEP_TOTALS, totals)
        return loss

    def _microbatch_loss(self, output, index: torch.Tensor) -> torch.Tensor:
        # The schedule hands each microbatch's "target": its index (the whole range while it infers shapes).
        which = int(index.reshape(-1)[0]) if not index.is_meta and index.numel() else 0
        batch = self._microbatches[which]
        inputs = set(self.layout.inputs or list(batch)[:1])
        model_output = self.layout.model_output(output, {k: v for k, v in batch.items() if k not in inputs})
        if self.loss_fn is not None:
            loss = self.loss_fn(batch, model_output)
        else:
            loss = pick_loss(model_output, self.output_loss_value_spec)
            if self._count_rule is not None and count_of(loss) is None and loss is getattr(model_output, "loss", None):
                count = self._count_rule.count(batch)
                if count is not None:
                    with_count(loss, count)
        if loss.is_meta or index.is_meta or index.numel() != 1:  # the schedule inferring shapes: not a step's
            return loss
        return self._weighed(loss, batch, which)

    def _weighed(self, loss: torch.Tensor, batch: dict, which: int) -> torch.Tensor:
        """What the schedule runs backward on: the microbatch's loss times its count over K; the
        gradients are multiplied by ``K / N`` after the step (:meth:`_reduce_data_parallel_grads`)."""
        part = weighed_part(loss, samples_of(loss) or batch_samples(batch))
        self._parts[which], self._mb_losses[which] = part, loss.detach()
        return loss * (part[0] / self._expected).to(loss.dtype)

    def _sync_tied(self, weights: bool) -> None:
        """A tied weight lives on every rank whose stages use it (one copy per rank). Weights: the
        copy of its first stage is given to the others; gradients: summed over the copies, as the
        serial model sums the gradients of its uses."""
        group = self.pipeline_group
        for users in self.ties:
            local = next((name for stage, name in users if stage in self.local_stage_ids), None)
            param = self._module[0].get_parameter(local) if local is not None else None
            ref = self._module[0].get_parameter(users[0][1])
            zeros = torch.zeros(ref.shape, dtype=ref.dtype, device=self.device)
            if weights:
                mine = param is not None and min(stage for stage, _ in users) in self.local_stage_ids
                value = param.detach().clone() if mine else zeros
            else:
                value = param.grad if param is not None and param.grad is not None else zeros
                if isinstance(value, DTensor) or self._data_sharded:
                    # fsdp/zero2 beside the pipeline: every copy is sharded alike over its stage's
                    # data ranks, so the copies' local shards add up row for row
                    value = value.to_local() if isinstance(value, DTensor) else self._local_rows(zeros)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(value, group=group)
            if param is None:
                continue
            if weights:
                with torch.no_grad():
                    param.copy_(value)
            elif not isinstance(param, DTensor):
                param.grad = value
            elif param.grad is None:  # (a DTensor's local shard was summed in place)
                param.grad = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())

    @property
    def _data_sharded(self) -> bool:
        """Whether fsdp or zero2 sharded this rank's stages over their data ranks."""
        return any(isinstance(p, DTensor) for p in self.local_parameters())

    def _local_rows(self, whole: torch.Tensor) -> torch.Tensor:
        """The rows of ``whole`` this rank's data coordinate holds under FSDP2's dim-0 sharding
        (torch.chunk's: ceil(n / size) rows each, the last ranks fewer or none)."""
        size = self.topology.data_parallel_size
        rank = dist.get_rank(self.topology.data_parallel_group) if size > 1 else 0
        rows = -(-whole.shape[0] // size)
        return whole[rank * rows:(rank + 1) * rows].clone()

    def _sync_for_step(self) -> GradSync | None:
        """The step's :class:`GradSync` (rebuilt when the local parameters changed); None where
        there is one data rank, or fsdp/zero2 shard the stages (their hooks reduce-scatter)."""
        if self.topology.data_parallel_size == 1 or self._data_sharded:
            return None
        params = tuple(self.local_parameters())
        if self._grad_sync is None or self._grad_sync[0] != tuple(map(id, params)):
            if self._grad_sync is not None:
                self._grad_sync[1].remove()
            self._grad_sync = (tuple(map(id, params)), self._new_grad_sync())
        sync = self._grad_sync[1]
        for stage in self.stages:
            if isinstance(stage, _Stage):
                stage.grad_sync = sync
        sync.begin()
        return sync

    def _new_grad_sync(self) -> GradSync:
        """Each local stage's parameters, in the order its units register them; a parameter two
        local stages use (a tied embedding and head on one rank) is summed after the schedule."""
        module = self._module[0]
        by_stage = {stage: summed_params(module.get_submodule(name) for name in self.stage_units[stage])
                    for stage in self.local_stage_ids}
        users = Counter(id(p) for params in by_stage.values() for p in params)
        shared = {key for key, count in users.items() if count > 1}
        late = list({id(p): p for ps in by_stage.values() for p in ps if id(p) in shared}.values())
        stages = {stage: [p for p in ps if id(p) not in shared] for stage, ps in by_stage.items()}
        return GradSync(stages, late, self.topology.data_parallel_group, self.grad_bucket_bytes)

    def _reduce_data_parallel_grads(self, factor: float, sync: GradSync | None) -> None:
        """Gradients summed over the data ranks, then multiplied by ``factor`` (``K / N``): by
        ``sync``, which started each stage's sums inside the schedule (atorch.pipeline.grad_sync).

        expert_parallel's slices are not: each is a different tensor on each rank of its expert
        group, whose gradient the all-to-all's backward already brought from every token of the
        group, divided by the group's size. Averaged over the slice's copies (the ranks of other
        groups that hold the same experts), it is the data ranks' mean, times the data size the
        sum the other weights get."""
        done = sync.finish(factor) if sync is not None else set()
        group, size = self.topology.data_parallel_group, self.topology.data_parallel_size
        for param in self.local_parameters():
            if param.grad is None or id(param) in done:
                continue
            if held_per_rank(param):
                average_over_copies(param, getattr(param, "replica_group", None))
                param.grad.mul_(factor * size)
                continue
            if isinstance(param.grad, DTensor):  # fsdp/zero2 beside the pipeline: reduce-scattered, averaged
                param.grad.mul_(factor * size)
                continue
            if size > 1:
                dist.all_reduce(param.grad, group=group)
            param.grad.mul_(factor)


class _Stage(PipelineStage):
    """A stage whose last backward of a step starts its gradients' sum over the data ranks, and
    whose first-step shape inference leaves its tensor-parallel random streams as they were.

    torch runs that inference forward on real tensors inside ``fork_rng``, which keeps the default
    stream only; a stage sharded by mixed_parallel draws attention dropout from a tracker of its
    own, which moved, so a run resumed from a checkpoint (whose first step infers again) drew other
    masks than the uninterrupted run from then on."""

    grad_sync: GradSync | None = None  # set by PipelineModel for a training step over several data ranks

    def _prepare_forward_infra(self, *args, **kwargs):
        from atorch.parallel_layers.random import tracker_of

        with tracker_of(self.submod).kept():
            return super()._prepare_forward_infra(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        """The backward of one microbatch; the last one that fills the weights' gradients (a full
        or weight backward) starts their sum over the data ranks (:class:`GradSync`)."""
        sync = self.grad_sync if last_backward and backward_type != "input" else None
        if sync is not None:
            sync.arm(self.stage_index)
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if sync is not None:
            sync.stage_done(self.stage_index)
        return result


@contextlib.contextmanager
def _copies_unsynced(modules):
    """expert_parallel's copies of a slice left unaveraged through the schedule's microbatches:
    :meth:`PipelineModel._reduce_data_parallel_grads` averages them once, after the last."""
    owners = [m for m in modules if getattr(m, "_atorch_expert_sync", None) is True]
    for owner in owners:
        owner._atorch_expert_sync = False
    try:
        yield
    finally:
        for owner in owners:
            owner._atorch_expert_sync = True


def _tied_parameters(module: nn.Module, stage_units: list[list[str]]) -> list[list[tuple[int, str]]]:
    """Parameters shared by units of different stages: for each, its ``(stage, name)`` users."""
    users: dict[int, list[tuple[int, str]]] = {}
    for stage, names in enumerate(stage_units):
        for name in names:
            for pname, param in module.get_submodule(name).named_parameters(remove_duplicate=False):
                users.setdefault(id(param), []).append((stage, f"{name}.{pname}"))
    return [found for found in users.values() if len({stage for stage, _ in found}) > 1]


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
        if held_per_rank(param):
            # other experts on each rank of its expert group (all in this stage), other layers on
            # each stage: summed over the expert group first, then with the stage's other weights
            param.presum_group, param.shard_group = param.shard_group, topology.group("pipeline")
            continue
        if getattr(param, "shard_group", None) is not None and not getattr(param, "tensor_model_parallel", False):
            continue  # a tensor-parallel slice's group is widened to pipeline x tensor below
        sharded = getattr(param, "tensor_model_parallel", False) and pipeline_tensor is not None
        param.shard_group = pipeline_tensor if sharded else topology.group("pipeline")
