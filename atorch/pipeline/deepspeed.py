"""The DeepSpeed pipeline engine behind ds_3d_parallel, imported only when a strategy asks for it.

The model's units (the same layouts PipelineModel uses) become a ``deepspeed.pipe.PipelineModule``
laid over atorch's pipeline and data dims; ``deepspeed.initialize`` returns the pipeline engine,
whose ``train_batch`` runs forward, backward and the optimizer step of every microbatch.
"""

import torch
import torch.distributed as dist

from atorch.auto.context import ModelContext
from atorch.errors import NotSupportedError
from atorch.loss.contract import STEP_TOTALS, batch_samples, count_of
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
    weights = EngineWeights(ctx.topology, getattr(user_loss, "rule", None), getattr(user_loss, "mode", "per_part_mean"))

    def loss_fn(output, labels):
        targets = dict(zip(layout.targets, labels if isinstance(labels, tuple) else (labels,)))
        model_output = layout.model_output(output, targets)
        if user_loss is None:
            return pick_loss(model_output, None)
        loss = user_loss(targets, model_output)
        return weights.weigh(loss[0] if isinstance(loss, (tuple, list)) else loss, targets)

    module = PipelineModule(layers=layers, topology=topology, loss_fn=loss_fn, partition_method=partition_method)
    module.atorch_layout = layout
    module.atorch_weights = weights
    return module.to(ctx.device)


class DeepSpeedPipelineCall(torch.nn.Module):
    """``model(**batch)``: one training step of the engine (forward, backward and optimizer step
    of every microbatch); returns the mean loss, equal on every rank."""

    def __init__(self, engine, layout, num_microbatches: int, weights: "EngineWeights"):
        super().__init__()
        self.engine, self.num_microbatches = engine, num_microbatches
        self._layout, self._weights = [layout], [weights]

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
        totals = self._weights[0].start(parts, self.num_microbatches)
        loss = self.engine.train_batch(iter(items))
        # Each microbatch's loss was weighted by count x n x W / N: the engine's mean over
        # microbatches and data ranks is the global batch's mean over what its losses count.
        totals[1] = loss.detach().double() * totals[0]
        setattr(loss, STEP_TOTALS, totals)
        return loss


class EngineWeights:
    """Each microbatch's loss weighted before DeepSpeed's engine runs backward and steps: the
    engine divides by its microbatches (n) and averages over the W data ranks, and steps inside
    ``train_batch``, so the global count N must be known first. It is counted from the labels
    with the model's rule (a Hugging Face model's own loss, atorch/loss/counting.py), one
    all-reduce a step; a loss that carries no count weighs one per microbatch."""

    def __init__(self, topology, rule, mode: str):
        self.topology, self.rule, self.mode = topology, rule, mode
        self.tokens = self.parts = 1.0  # N counted by the rule, and the microbatches: the whole batch's
        self.scale = 1.0  # n x W

    def start(self, parts: list[dict], num_microbatches: int) -> torch.Tensor:
        """Count this step's microbatches (``[tokens, 0, samples]`` over the data ranks)."""
        counts = [self.rule.count(part) if self.rule is not None and self.mode == "tokens" else None for part in parts]
        tokens = sum(float(c) for c in counts) if all(c is not None for c in counts) else float(len(parts))
        samples = float(sum(batch_samples(part) for part in parts))
        totals = torch.tensor([tokens, 0.0, samples, float(len(parts))], dtype=torch.float64)
        if self.topology.data_parallel_size > 1:
            dist.all_reduce(totals, group=self.topology.data_parallel_group)
        self.tokens, self.parts = float(totals[0]), float(totals[3])
        self.scale = float(num_microbatches * self.topology.data_parallel_size)
        return totals[:3].clone()

    def weigh(self, loss: torch.Tensor, targets: dict) -> torch.Tensor:
        count = count_of(loss)
        if count is None or self.mode != "tokens" or self.rule is None:
            return loss * (self.scale / self.parts)  # one per microbatch: the per-part mean
        expected = self.rule.count(targets)
        if expected is None or int(count) != int(expected):
            raise NotSupportedError(
                "ds_3d_parallel weighs microbatches before DeepSpeed's engine runs them, by the labels the model's own "
                f"loss counts ({None if expected is None else int(expected)} here); loss_func said it counts "
                f"{int(count)}. Use pipeline_parallel, which reads each loss's count, or the model's own loss")
        return loss * (float(count) * self.scale / max(self.tokens, 1.0))


class SteppedByEngine(OptimizerWrapper):
    """``result.optim`` of ds_3d_parallel: the engine already stepped the optimizer inside the
    model call (``result.args["step_in_forward"]``), so ``step`` and ``zero_grad`` do nothing;
    ``param_groups``, ``state`` and the rest are the real optimizer's (learning-rate schedulers use it)."""

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None
