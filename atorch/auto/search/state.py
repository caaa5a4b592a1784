"""One search's options and running state, handed from stage to stage (see engine.py)."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atorch.auto.context import ModelContext
from atorch.auto.environment import DeviceContext
from atorch.auto.search import cost
from atorch.auto.search.agree import from_rank0
from atorch.auto.search.candidate import CandidateResult
from atorch.auto.strategy import Strategy
from atorch.utils.log import logger

# The stages whose seconds a report keeps (SearchRun.lap, SearchReport.stage_seconds), in their order.
STAGES = ("space", "estimates", "dry runs", "close call", "trials on the pick")


@dataclass
class SearchOptions:
    memory_budget: int
    time_limit: float | None = None
    # A fresh copy's first steps run slow (DDP's buckets, the optimizer's state and fresh pages are
    # allocated): its steps on search_quality's small Llama took 100, 100, 64 and 57 ms.
    warmup_steps: int = 2
    timed_steps: int = 3
    dryrun_timeout: float = 300.0
    max_dryruns: int = 8
    # Optimizer steps the job will train: a refinement's one-time cost (torch.compile's compiling)
    # is spread over them when it is tried on the pick (refine.py). 1000 when the user says nothing:
    # a short fine-tuning run; a compile must pay for itself within it.
    planned_steps: int = 1000
    verbose: bool = False
    # The budget is the device's own memory (the user gave none): a dry run that did not run out
    # of memory fits it, even where the peak tracker cannot follow the strategy.
    budget_is_device_memory: bool = False
    # estimated / measured peak memory, lowest and highest (see cost.ESTIMATE_RATIO)
    estimate_ratio: tuple[float, float] = cost.ESTIMATE_RATIO
    # rates to estimate with in place of this machine's cached calibration (calibration itself
    # measures the methods' overheads against estimates at the rates it has just measured)
    profile: Any = None


@dataclass
class SearchRun:
    """What one search knows so far. Each stage reads the ``results`` the stages before it left
    and adds its own decisions to them; none goes back to an earlier stage."""

    model: torch.nn.Module
    device_ctx: DeviceContext
    make_context: Callable[[torch.nn.Module], ModelContext]
    apply: Callable[[ModelContext, Strategy], None]
    options: SearchOptions
    global_batch: int
    # The candidates were given (measure(), a loaded strategy checked by a dry run): nothing is
    # pruned, and nothing is timed again.
    given: bool = False
    start: float = field(default_factory=time.perf_counter)
    # Every candidate with its record, in the order they were generated.
    results: list[tuple[Strategy, CandidateResult]] = field(default_factory=list)
    # ids of the strategies sure to fit: by their estimate, or by a dry run's measured peak
    fits: set[int] = field(default_factory=set)
    ratios: dict[int, tuple[float, float]] = field(default_factory=dict)  # id(result) -> its estimate's error bounds
    estimate_seconds: dict[int, float] = field(default_factory=dict)  # id(strategy) -> its estimate's seconds (agreed)
    timed_out: bool = False  # the time_limit cut something short (the report's note says so only then)
    last_seconds: float = 0.0  # the last dry run's (the next starts only if one as long fits the time left)
    rates_text: str | None = None  # which rates the estimates use (SearchReport.rates)
    # the rates measured on this machine (MethodSpec.decided_by's names); None: all of them (a
    # calibrated or given profile)
    measured_rates: frozenset | None = None
    # the pick with the methods tried on it kept (refine.py), when one was: it replaces pick_winner's
    refined: tuple | None = None
    refined_from: tuple | None = None  # the pick it refines (pick_winner's, before the trials)
    trials: int = 0  # rows refine.py added (counted as generated)
    # seconds each stage took, on this rank's clock (SearchReport.stage_seconds)
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def past_limit(self) -> bool:
        """On this rank's clock: rank 0's decides, through an agreement."""
        limit = self.options.time_limit
        return limit is not None and time.perf_counter() - self.start >= limit

    def lap(self, stage: str) -> None:
        """Charge the seconds since the last stage ended (since the search began, for the first) to ``stage``."""
        if stage not in STAGES:
            raise ValueError(f"unknown search stage {stage!r}; the stages: {', '.join(STAGES)}")
        last_ended = self.start + sum(self.stage_seconds.values())
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + time.perf_counter() - last_ended

    def out_of_time(self) -> bool:
        return from_rank0(self.past_limit())

    def time_left(self) -> float | None:
        limit = self.options.time_limit
        return None if limit is None else limit - (time.perf_counter() - self.start)

    def surely_fits(self, result: CandidateResult) -> bool:
        """Within the budget even at the low end of its estimate's known error."""
        ratio = self.ratios.get(id(result), self.options.estimate_ratio)
        return cost.surely_fits(result.estimated_peak_bytes, self.options.memory_budget, ratio)

    def say(self, message: str) -> None:
        if self.options.verbose:
            logger.info(message)
