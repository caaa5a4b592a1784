"""auto_accelerate's entry into the search: options from its kwargs, the cache, the report."""

from pathlib import Path

from atorch.auto.search import cache
from atorch.auto.search.engine import SearchOptions, search
from atorch.auto.strategy import Strategy
from atorch.distributed import env
from atorch.errors import NotSupportedError
from atorch.utils.log import logger
from atorch.utils.sizes import parse_bytes


def check_searchable(optim_func, dataset, loss_func) -> None:
    missing = [name for name, value in (("optim_func", optim_func), ("dataset", dataset), ("loss_func", loss_func))
               if value is None]
    if missing:
        raise NotSupportedError(
            f"the strategy search dry-runs training steps and needs {missing}; pass them, or pass "
            "load_strategy to apply a strategy without searching"
        )


def run_search(model, device_ctx, make_context, apply_strategy, kwargs, excluded, included, base,
               only_base) -> Strategy | None:
    """Run the search with auto_accelerate's ``kwargs``: use the cache, print and save the report."""

    budget = parse_bytes(kwargs.get("memory_budget")) or device_ctx.memory_per_device
    options = SearchOptions(
        memory_budget=budget,
        time_limit=kwargs.get("time_limit"),
        warmup_steps=int(kwargs.get("dryrun_warmup_steps", SearchOptions.warmup_steps)),
        timed_steps=max(1, int(kwargs.get("dryrun_steps", 3))),
        dryrun_timeout=float(kwargs.get("dryrun_timeout", 300.0)),
        max_dryruns=int(kwargs.get("max_dryruns", 8)),
        planned_steps=int(kwargs.get("planned_steps", SearchOptions.planned_steps)),
        verbose=bool(kwargs.get("verbose", False)),
        budget_is_device_memory=kwargs.get("memory_budget") is None,
    )
    key = directory = None
    if kwargs.get("use_search_cache", True):
        directory = Path(kwargs.get("search_cache_dir") or cache.default_dir())
        extra = {"excluded": sorted(excluded or []), "included": sorted(included or []), "only": only_base,
                 "base": None if base is None else base.to_dict(), "options": repr(options)}
        key = cache.cache_key(model, make_context(model), device_ctx, budget, extra)
        hit = cache.load(directory, key)
        if hit is not None:
            winner, report = hit
            if options.verbose:
                logger.info("%s", report.table())
            if kwargs.get("report_file") and env.rank() == 0:
                report.save(kwargs["report_file"])
            return winner
    winner, report = search(model, device_ctx, make_context, apply_strategy, options, excluded, included, base,
                            only=[base] if only_base else None)
    if key is not None and winner is not None:
        cache.store(directory, key, winner, report)
    if options.verbose:
        logger.info("%s", report.table())
    if kwargs.get("report_file") and env.rank() == 0:
        report.save(kwargs["report_file"])
    if winner is None:
        # Printed, not only in the report file: a job-wide problem (a loss that is not a scalar, a
        # batch that does not fit anywhere) shows as the same failure on every candidate.
        failures = sorted({c.reason for c in report.candidates if c.status == "failed" and c.reason})
        logger.warning("the search found no strategy that runs: %s%s", report.note,
                       "".join(f"\n  failed: {reason}" for reason in failures[:5]))
    return winner
