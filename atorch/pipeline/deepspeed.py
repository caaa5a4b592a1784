"""The DeepSpeed pipeline engine behind ds_3d_parallel, imported only when a strategy asks for it.

The model's units (the same layouts PipelineModel uses) become a ``deepspeed.pipe.PipelineModule``
laid over atorch's pipeline and data dims; ``deepspeed.initialize`` returns the pipeline engine,
whose ``train_batch`` runs forward, backward and the optimizer step of every microbatch.
"""

import torch
import torch.distributed as dist

from atorch.auto.context import ModelContext
from atorch.errors import NotSupportedError
from atorch.pipeline.layouts import layout_for
from atorch.pipeline.loss import pick_loss, split_batch
from atorch.utils.optim import OptimizerWrapper


def pipeline_module(ctx: ModelContext, partition_method: str):
    """A DeepSpeed PipelineModule over ``ctx.model``'s units, on atorch's pipeline x data mesh."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    if ctx.topology.rank_order is not None:
        raise NotSupportedError("ds_3d_parallel lays ranks out in their natural order; drop parallel_mode's rank_order")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    layout = layout_for(ctx.model)
    layout.route_mask = False  # DeepSpeed's stages pass one tensor: no mask beside the hidden states
    if layout.traced:
        raise NotSupportedError(
            f"ds_3d_parallel runs DeepSpeed's pipeline engine over a chain of modules, and no layout knows "
            f"{type(ctx.model).__name__} (atorch splits it by tracing, which DeepSpeed cannot run): use "
            "pipeline_parallel, or register a layout with atorch.pipeline.register_layout")
    last = len(layout.units) - 1
    layers = [layout.stage_module([name], i == 0, i == last) for i, name in enumerate(layout.units)]
    # DeepSpeed lists axes outermost first; atorch's dims are innermost first.
    sizes = {"pipeline": ctx.topology.size("pipeline"), "data": ctx.topology.data_parallel_size}
    names = [n for n, _ in reversed(ctx.topology.dims) if n in sizes] or ["pipeline"]
    names += [n for n in sizes if n not in names]
    topology = ProcessTopology(axes=[{"pipeline": "pipe"}.get(n, n) for n in names], dims=[sizes[n] for n in names])
    user_loss = ctx.loss_func

    def loss_fn(output, labels):
        targets = dict(zip(layout.targets, labels if isinstance(labels, tuple) else (labels,)))
        model_output = layout.model_output(output, targets)
        if user_loss is None:
            return pick_loss(model_output, None)
        loss = user_loss(targets, model_output)
        return loss[0] if isinstance(loss, (tuple, list)) else loss

    module = PipelineModule(layers=layers, topology=topology, loss_fn=loss_fn, partition_method=partition_method)
    module.atorch_layout = layout
    return module.to(ctx.device)


class DeepSpeedPipelineCall(torch.nn.Module):
    """``model(**batch)``: one training step of the engine (forward, backward and optimizer step
    of every microbatch); returns the mean loss, equal on every rank."""

    def __init__(self, engine, layout, num_microbatches: int):
        super().__init__()
        self.engine, self.num_microbatches = engine, num_microbatches
        self._layout = [layout]

    def forward(self, *args, **batch):
        if len(args) == 1 and isinstance(args[0], dict) and not batch:
            batch = args[0]
        layout = self._layout[0]
        batch = layout.prepare_batch(batch)
        layout.check_kwargs(list(batch))
        inputs = layout.inputs or list(batch)[:1]
        layout.targets = [k for k in batch if k not in inputs]
        parts = split_batch(batch, self.num_microbatches)
        items = []
        for part in parts:
            labels = tuple(part[k] for k in layout.targets)
            items.append((part[inputs[0]], labels[0] if len(labels) == 1 else labels))
        return self.engine.train_batch(iter(items))


class SteppedByEngine(OptimizerWrapper):
    """``result.optim`` of ds_3d_parallel: the engine already stepped the optimizer inside the
    model call (``result.args["step_in_forward"]``), so ``step`` and ``zero_grad`` do nothing;
    ``param_groups``, ``state`` and the rest are the real optimizer's (learning-rate schedulers use it)."""

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None
