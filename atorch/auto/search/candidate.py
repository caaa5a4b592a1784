"""What the search's stages pass on, defined once: a candidate's record (its strategy, estimate,
measurements and the decision on it with the reason) and the names of the rules that decide.

A leaf: the stages (atorch/auto/search/engine.py lists them) and the report import it; it imports
none of them."""

from dataclasses import dataclass

MEASURED, PRUNED, FAILED = "measured", "pruned", "failed"


@dataclass
class CandidateResult:
    strategy: dict
    status: str = PRUNED
    estimated_peak_bytes: int | None = None
    estimate_breakdown: dict | None = None
    estimated_step_seconds: float | None = None
    # units of each method's host overhead the step estimate charged (StepCost.overhead_units)
    estimate_overheads: dict | None = None
    measured_peak_bytes: int | None = None
    throughput: float | None = None  # global samples per second
    # each dry run's, when it was timed again over more steps (a close call); throughput is then
    # that of all their timed steps
    throughputs: list[float] | None = None
    # samples/s of its median step when the close call was timed side by side (the candidates
    # within reach of the best, built together and stepped in turn); the winner is decided on it
    side_by_side: float | None = None
    side_by_side_seconds: list[float] | None = None  # each of its turns there, seconds a step
    # how far behind the fastest it ran there, turn by turn: [median ratio, band low, band high]
    # (sidebyside.behind_bands; [1, 1, 1] for the fastest); tied with it where the band's low end
    # is within sidebyside.TIE
    side_by_side_behind: list[float] | None = None
    # every timed step's seconds (the slowest rank's), over all its dry runs; the throughput is the
    # median step's, throughput_range the slowest and fastest step's (samples/s)
    step_seconds: list[float] | None = None
    throughput_range: list[float] | None = None
    seconds: float | None = None
    reason: str | None = None
    # How the ranks split, e.g. "tensor=2 x data=2" (None in reports from before layouts were searched).
    layout: str | None = None
    # The pruning rule that removed it (a key of SearchReport.pruned), when pruned.
    pruned_by: str | None = None
    # A duplicate (pruned as symmetric): the strategy as generated, where planning it for this model
    # dropped a method that would change nothing (the record's strategy is the planned one).
    generated_as: str | None = None

    @property
    def names(self) -> list[str]:
        return [m["name"] for m in self.strategy["methods"]]

    @property
    def labels(self) -> list[str]:
        """The names as the table shows them (a variant says which: ``checkpoint (selective)``)."""
        from atorch.auto.search.space import method_labels

        return method_labels((m["name"], m.get("config") or {}) for m in self.strategy["methods"])

    @property
    def name(self) -> str:
        """The candidate as the report and the progress lines name it: its labels and its layout."""
        return (" + ".join(self.labels) or "(plain)") + (f" [{self.layout}]" if self.layout else "")

# Why a candidate was pruned, as counted in the report (SearchReport.pruned); stop.py adds
# cannot_fit and cannot_win, space.py counts conflicting.
INELIGIBLE, SYMMETRIC, CONFIG_ERROR, OVER_BUDGET_RULE = "ineligible", "symmetric", "config_error", "over_budget"
MEMORY_ONLY, SLOWER, DOMINATED = "memory_only", "slower", "dominated"
MAX_DRYRUNS, TIME_LIMIT = "max_dryruns", "time_limit"
DUPLICATE = "the same as another candidate on this model (a method in it would change nothing)"
OVER_BUDGET = "estimated peak memory is over the memory budget beyond the estimate's error (x{:g})"
