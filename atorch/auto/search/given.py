"""Given strategies estimated and dry-run as the search would, with no pruning and no search:
``atorch.auto.search.measure``, what the benchmarks set the cost model against."""

from collections.abc import Sequence
from typing import Any

import torch

from atorch.auto.search.engine import search
from atorch.auto.search.report import SearchReport
from atorch.auto.search.state import SearchOptions


def measure(model: torch.nn.Module, strategies: Sequence[Any], optim_func, dataset, loss_func,
            memory_budget: int | None = None, **job: Any) -> SearchReport:
    """Estimate and dry-run each of ``strategies`` (no pruning, no search) and report them.

    ``job`` takes auto_accelerate's training arguments (``optim_args``, ``dataloader_args``,
    ``model_input_format``, ...) plus SearchOptions fields (``timed_steps``, ``warmup_steps``).
    Benchmarks use it to set the cost model against measurements.
    """
    from atorch.auto.accelerate import apply_strategy
    from atorch.auto.context import ModelContext, move_to_device
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import plan_strategy
    from atorch.auto.strategy import parse_strategy
    from atorch.loss.contract import counted_loss

    device_ctx = DeviceContext.detect()
    option_names = set(SearchOptions.__dataclass_fields__) - {"memory_budget", "budget_is_device_memory"}
    options = SearchOptions(memory_budget=memory_budget or 2**62, budget_is_device_memory=memory_budget is None,
                            **{k: job.pop(k) for k in list(job) if k in option_names})
    job.setdefault("prepare_input", move_to_device)
    loss_func = counted_loss(model, loss_func, "tokens")  # the dry runs weigh their parts as a job does

    def make_context(module):
        return ModelContext(model=module, device_ctx=device_ctx, optim_func=optim_func, dataset=dataset,
                            loss_func=loss_func, **job)

    planned = [plan_strategy(parse_strategy(s), device_ctx)[0] for s in strategies]
    _, report = search(model, device_ctx, make_context, apply_strategy, options, only=planned)
    return report
