"""fused_optimizer: the user's optimizer built with torch's fused (or multi-tensor) step.

Config forms: ``"fused_optimizer"`` (``fused=True``), ``{"impl": "foreach"}`` (``foreach=True``).
The optimizer keeps its class, hyperparameters and state layout; only the kernel that applies an
update changes (one fused kernel over every parameter, or torch's multi-tensor ``_foreach`` ops,
instead of one parameter at a time: torch's default on a CPU). Torch's Adam, AdamW, SGD and
Adagrad have a fused step (on CPU and CUDA); ``foreach`` covers most others. An optimizer whose
constructor takes neither keyword is refused with its name when the job is built. Beside
genomic_bottleneck, the user's optimizer (the weights it does not generate) is fused, the g-nets'
own is not.

The update is the same arithmetic, in another order: within 1e-6 relative of the unfused step in
fp32 after a few AdamW steps (tests/methods/test_fused_optimizer.py). On this project's CPU the
fused AdamW step ran 3-5x faster than torch's default (benchmarks/compiled_variants.py).
"""

import inspect
from typing import Literal

from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError


class FusedOptimizerConfig(MethodConfig):
    impl: Literal["fused", "foreach"] = Field(default="fused", description="fused: one kernel per step; "
                                              "foreach: torch's multi-tensor ops")


def optimizer_keywords(optim_func, impl: str) -> dict:
    """The keywords that select ``impl`` in ``optim_func``'s constructor, or a MethodConfigError
    naming the optimizer and the fix when it takes no such keyword."""
    try:
        parameters = inspect.signature(optim_func).parameters
    except (TypeError, ValueError):
        parameters = {}
    if impl not in parameters:
        name = getattr(optim_func, "__name__", type(optim_func).__name__)
        raise MethodConfigError(
            f"fused_optimizer: the optimizer {name} takes no {impl!r} argument, so it has no {impl} step; "
            f"use torch.optim.AdamW/Adam/SGD/Adagrad (fused) or an optimizer with a foreach argument, or remove "
            f"fused_optimizer from the strategy")
    other = "foreach" if impl == "fused" else "fused"
    return {impl: True, **({other: False} if other in parameters else {})}


def job_unsupported(ctx: ModelContext, config: FusedOptimizerConfig) -> str | None:
    """Why this job's optimizer has no such step (the search does not try the method then)."""
    try:
        optimizer_keywords(ctx.optim_func, config.impl)
    except MethodConfigError as error:
        return str(error)
    return None


def select_step(ctx: ModelContext, config: FusedOptimizerConfig) -> None:
    """Every optimizer this job builds (the plain one, ZeRO's, fairscale's) gets the keywords."""
    if ctx.optim_func is None:
        return
    ctx.optim_args = {**ctx.optim_args, **optimizer_keywords(ctx.optim_func, config.impl)}


def cost_term(config: FusedOptimizerConfig, cost) -> None:
    # The optimizer's step at the fused rate the search timed on this device, else the nominal share.
    if config.impl == "fused":
        cost.optim_impl = "fused"


register_method(
    MethodSpec(
        name="fused_optimizer",
        config_cls=FusedOptimizerConfig,
        # Before the OPTIMIZER stage, where the engine and the sharding methods build the optimizer.
        hooks={Stage.REWRITE: select_step},
        description="the optimizer's fused (or multi-tensor) step: the same update in fewer kernels",
        search_space=({},),
        tried_on_pick=True,
        kept_unless_slower=True,  # the same update and state: nothing lost where it is as fast
        job_unsupported=job_unsupported,
        cost_term=cost_term,
    )
)
