"""Dry runs: a candidate applied to a fresh copy of the model and trained for a few steps on
every rank, timed, and its peak memory tracked; failures are caught and agreed on.

A rank that fails alone (its forward raises, say) goes to the agreement while its peers may be
inside the model's collectives, waiting for it. Two things keep that from sinking the job: the
agreements run on a process group of their own (:func:`agree.agreement_group`), never matched
against the model's collectives, and the candidate's groups are built with the dry run's timeout
(:func:`collective_timeout`), so a waiting peer raises within it, joins the agreement, and every
rank records the failure of the rank that failed first.

A pipeline candidate's sends and receives are on those groups too, so a stage stopped or hung
holds its peers at most ``dryrun_timeout``. A stage that raises (its forward, its loss) does not
even hold them that long: :class:`atorch.pipeline.PipelineModel` closes the candidate's groups
as it fails (atorch/pipeline/failure.py), its peers leave their receives at once, and the
candidate is recorded as failed with that stage's error within seconds."""

import contextlib
import copy
import functools
import gc
import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from atorch.auto import loop
from atorch.auto.context import ModelContext, run_model
from atorch.auto.plan import resolve_strategy
from atorch.auto.search.agree import agreement_group, all_ok, first_error, max_each, max_over_ranks
from atorch.auto.search.cost import free_copy
from atorch.auto.search.peak import PeakMemory, optimizer_state
from atorch.auto.strategy import Strategy
from atorch.distributed.env import destroy_groups
from atorch.distributed.topology import collective_timeout
from atorch.utils.log import logger
from atorch.utils.optim import unwrap_optimizer

# Steps whose peak memory a dry run tracks; the highest counts. A collective's buffer is freed
# when the backend's thread lets it go, which can fall after the next allocations of the step or
# before them: search_quality's boundary candidate (tensor=2 x pipeline=2 with checkpointing)
# measured 4.91 MiB in most single-step readings and up to 5.22 in the others. Training runs
# many steps, and its peak is the highest of them.
PEAK_STEPS = 2


def train_step(ctx: ModelContext, batches: list) -> None:
    """One optimizer step the way a user's loop runs it with this context's result: one call per
    batch the loader yields, as many as the strategy accumulates (gradient_accumulation)."""
    for batch in batches:
        batch = ctx.prepare_input(batch, ctx.device)
        loss = ctx.loss_func(batch, run_model(ctx.model, batch, ctx.model_input_format))
        loss = loss[0] if isinstance(loss, (tuple, list)) else loss
        # the model: accumulation turns its reduction on and off
        loop.backward(ctx.args, ctx.optim, loss, ctx.model, ctx.loss_tokens)
        loop.step(ctx.args, ctx.optim, ctx.loss_tokens)


def draw(ctx: ModelContext, batches) -> list:
    """The loader's batches of one optimizer step."""
    return [next(batches) for _ in range(ctx.args.get(loop.ACCUMULATION_STEPS, 1))]


def _peak_bytes(ctx: ModelContext, step: Callable[[], None]) -> int | None:
    """Peak tensor memory of one step on this rank (pipeline schedules included). Garbage is
    collected first, so the step starts from the same state whatever ran before in this process:
    what reference cycles hold waits for the collector, whose timing follows the process's
    history of allocations."""
    gc.collect()
    optim = unwrap_optimizer(ctx.optim)
    with PeakMemory(ctx.model, *([optim] if isinstance(optim, torch.optim.Optimizer) else [])) as tracker:
        step()
    return None if tracker.failed else tracker.peak


@contextlib.contextmanager
def collector_frozen():
    """While the search runs, the garbage collector leaves alone what existed when it started.

    Each dry run collects garbage before it tracks a step's peak and after it releases its copy
    (so every candidate starts from the same state). A full collection walks every object the
    process tracks: 360 thousand after importing torch and transformers, 0.16 s a collection
    alone and 0.36 s with 4 ranks on 2 cores, three per dry run: more than its timed steps on
    benchmarks/search_quality.py's small Llama. Frozen (``gc.freeze``), the imports, the user's
    model and data are skipped; the search's own garbage is still collected. A process that froze
    objects itself (a server before it forks) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    # No collection first: garbage frozen with the rest is collected after the search (a full
    # collection here cost as much as the three of a dry run).
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _free_storage(ctx: ModelContext) -> None:
    """Give back the memory of the candidate's copy: its parameters, buffers, gradients and
    optimizer state (see :func:`atorch.auto.search.cost.free_copy`)."""
    optim = unwrap_optimizer(ctx.optim) if ctx.optim is not None else None
    free_copy(ctx.model, optimizer_state(optim) if isinstance(optim, torch.optim.Optimizer) else [])


def release(ctx: ModelContext | None, ran: bool = False) -> None:
    """Destroy the candidate's groups; then, after a dry run that completed on every rank (no
    collective of the copy can still be in flight), give back its storage."""
    if ctx is not None and ctx.topology.mesh is not None:
        groups = set(ctx.topology.mesh.get_all_groups())
        if ctx.topology.data_parallel_group is not None:
            groups.add(ctx.topology.data_parallel_group)
        destroy_groups(groups)
    if ctx is not None and ran:
        _free_storage(ctx)
    if ctx is not None and _compiled(ctx.model):
        # A graph dynamo compiled for this copy stays cached for its code and is reused for the
        # job's own model when its guards pass; after the search tried native_dynamo on its pick,
        # the picked job's compiled model ran at eager speed on this CPU (9.9 K tokens/s against
        # 14.1 K compiled afresh; the copy's storage is freed above). The job compiles its own.
        import torch._dynamo

        torch._dynamo.reset()
    gc.collect()


def _compiled(model) -> bool:
    """Whether any module of ``model`` was compiled in place (``Module.compile``)."""
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())


def dry_run(
    pristine: torch.nn.Module,
    strategy: Strategy,
    make_context: Callable[[torch.nn.Module], ModelContext],
    apply: Callable[[ModelContext, Strategy], None],
    warmup_steps: int,
    timed_steps: int,
    timeout_s: float,
    global_batch: int,
    stop_after_s: float | None = None,
) -> dict:
    """Measure ``strategy`` on every rank. Returns throughput (global samples/s), the peak bytes
    over ranks, seconds, and the failure reason (None when it ran).

    Running past ``timeout_s`` is a failure; passing ``stop_after_s`` (the search's time left)
    ends the timed steps early and measures the ones that ran. Every rank takes both decisions
    on the slowest rank's clock."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    if several:
        agreement_group()  # created here, in step on every rank, before the candidate's groups
    with collective_timeout(timeout_s if several else None):
        return _dry_run(pristine, strategy, make_context, apply, warmup_steps, timed_steps, timeout_s,
                        global_batch, stop_after_s)


def build(pristine: torch.nn.Module, strategy: Strategy, make_context: Callable, apply: Callable,
          start: float) -> tuple[ModelContext | None, str | None]:
    """``strategy`` applied to a fresh copy of ``pristine`` on every rank: its context, or None and
    the first rank's error (agreed; what was built is released)."""
    ctx, error, failed_at = None, None, None
    try:
        ctx = make_context(copy.deepcopy(pristine))
        strategy = resolve_strategy(ctx.model, strategy)
        ok = all_ok(True)
    except Exception as exc:  # noqa: BLE001 - any failure of a candidate is recorded, not raised
        error, failed_at = f"{type(exc).__name__}: {exc}", time.perf_counter() - start
        ok = all_ok(False)
    if ok:
        try:
            apply(ctx, strategy, stage_barrier=all_ok)
        except Exception as exc:  # noqa: BLE001
            error, failed_at = f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    if error is not None or not ok:
        release(ctx)
        return None, first_error(error, failed_at)
    return ctx, None


def _dry_run(pristine, strategy, make_context, apply, warmup_steps, timed_steps, timeout_s, global_batch,
             stop_after_s) -> dict:
    start = time.perf_counter()
    ctx, reason = build(pristine, strategy, make_context, apply, start)
    if ctx is None:
        return {"reason": reason, "seconds": time.perf_counter() - start}

    error = failed_at = None
    elapsed = peak = None
    done, late = 0, False
    step_seconds: list[float] = []  # each timed step's, the slowest rank's clock
    try:
        batches = itertools.cycle(ctx.dataloader) if len(ctx.dataloader) else iter(())
        for _ in range(warmup_steps):
            train_step(ctx, draw(ctx, batches))
        t0 = time.perf_counter()
        for _ in range(timed_steps):
            train_step(ctx, draw(ctx, batches))
            done += 1
            # Every rank learns the slowest rank's times, so all stop together.
            now = time.perf_counter()
            before = elapsed or 0.0
            elapsed, since_start = max_each(now - t0, now - start)
            step_seconds.append(elapsed - before)
            if elapsed > timeout_s:
                raise TimeoutError(f"dry run exceeded its timeout of {timeout_s:.0f}s")
            late = stop_after_s is not None and since_start > stop_after_s
            if late:
                break  # the search's time_limit: measure the steps that ran
        try:
            for _ in range(PEAK_STEPS if not late else 0):
                # Drawn before the tracker starts: a sample can be a view of the dataset's whole
                # storage (a dataset that slices one tensor), which would count as the step's.
                drawn = draw(ctx, batches)
                step_peak = _peak_bytes(ctx, functools.partial(train_step, ctx, drawn))
                peak = None if step_peak is None else max(peak or 0, step_peak)
                if step_peak is None:
                    break  # the tracker failed: no peak
        except Exception as exc:  # noqa: BLE001 - a tracker that cannot follow a backend is not fatal
            logger.debug("memory tracking failed for %s: %s", strategy.opt_names, exc)
    except Exception as exc:  # noqa: BLE001
        error, failed_at = f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    ok = all_ok(error is None)
    peak = max_over_ranks(peak) if ok else None
    release(ctx, ran=ok)
    ctx = None
    if not ok:
        return {"reason": first_error(error, failed_at), "seconds": time.perf_counter() - start}
    return {
        "reason": None,
        "throughput": global_batch * done / elapsed,
        "step_seconds": step_seconds,
        "timed_steps": done,
        "measured_peak_bytes": None if peak is None else int(peak),
        "seconds": time.perf_counter() - start,
    }
