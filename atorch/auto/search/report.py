"""The search report: every candidate's outcome, readable as JSON and as a table."""

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from atorch.auto.search.candidate import FAILED, MEASURED, PRUNED, CandidateResult  # noqa: F401 - their old home
from atorch.auto.search.report_schema import check_report
from atorch.utils.files import write_text_atomic
from atorch.utils.sizes import size_text  # noqa: F401 - its old home
from atorch.utils.text_table import fold, output_width, table, wrap_cell


@dataclass
class SearchReport:
    world_size: int
    device: str
    memory_budget_bytes: int
    candidates: list[CandidateResult] = field(default_factory=list)
    winner: int | None = None
    search_seconds: float = 0.0
    note: str | None = None
    # Candidates generated (layouts x method combinations), pruned by each rule, and dry-run;
    # None in reports written before they were counted.
    generated: int | None = None
    pruned: dict[str, int] | None = None
    dry_run: int | None = None
    # Which rates the step-time estimates used: calibrated on this machine (and where from), or
    # nominal and why (see atorch/auto/search/calibrate.py); None in reports from before.
    rates: str | None = None
    # Measured candidates the winner was tied with (indexes): within sidebyside.TIE (2.5%) of the
    # fastest side by side (the lower measured peak, then fewer methods, then the faster there,
    # picked the winner), or, where the close call was timed one by one, readings that could not be
    # told apart from the best's (fewer methods among those estimated near the fastest, then the
    # estimate).
    tied: list[int] | None = None
    # The close call's pick (index) where the winner is that pick with methods tried on it and kept
    # (refine.py: a fused step, a compile); ``tied`` is then with that pick. None: not refined.
    refined_from: int | None = None
    # The global batch (samples per step): estimated step times are shown as samples/s with it.
    global_batch: int | None = None
    # When the search finished (seconds since the epoch): a cached report says how old it is.
    created: float | None = None
    # Why the search stopped dry-running before max_dryruns (atorch/auto/search/stop.py), if it did.
    stopped: str | None = None
    # Where the search's time went: seconds by stage (engine.py's: space, estimates, dry runs,
    # close call, trials on the pick), rank 0's clock; None in reports from before.
    stage_seconds: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as JSON, atomically; every rank may save to the same path at once."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchReport":
        """A report from its JSON, every field checked (report_schema.py): a wrong one is a
        ValueError naming it."""
        check_report(cls, CandidateResult, data)
        data = dict(data)
        data["candidates"] = [CandidateResult(**c) for c in data.get("candidates", [])]
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SearchReport":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path} is not an atorch search report: {error}") from None

    def table(self, width: int | None = None, all_rows: bool = False) -> str:
        """One row per dry-run candidate (and the pick): status, measured and estimated throughput,
        estimated and measured memory, reason; then the pruned ones grouped by the rule that
        pruned them (``all_rows``: a row for each of them too). Lines fit ``width`` characters.

        Reasons are shown whole, wrapped under their column (a reason is often the one thing that
        says what to change). ``width``: the terminal's (``$COLUMNS``), at most 120."""
        width = width or output_width()
        rows = [("", "strategy", "layout", "samples/s", "est.", "est. peak", "peak", "status")]
        shown = [i for i in self._display_order()
                 if all_rows or self.candidates[i].status != PRUNED or i == self.winner]
        for index in shown:
            c = self.candidates[index]
            rows.append((
                "*" if index == self.winner else "",
                " + ".join(c.labels) or "(plain)",
                c.layout or "-",
                _throughput_text(c),
                self._estimate_text(c),
                size_text(c.estimated_peak_bytes),
                size_text(c.measured_peak_bytes),
                c.status + (f": {c.reason}" if c.reason else ""),
            ))
        lines = _table_lines(rows, width)
        head = (f"atorch search: {len(self.candidates)} candidates on {self.world_size} x {self.device}, "
                f"memory budget {size_text(self.memory_budget_bytes)}, {self.search_seconds:.1f}s")
        tail = [self.note] if self.note else []
        if self.note and "search cache" in self.note:  # a cached result says so first
            age = f", {_age_text(time.time() - self.created)} ago" if self.created else ""
            head = f"from the search cache (searched{age} in {self.search_seconds:.1f}s): " + head.replace(
                f", {self.search_seconds:.1f}s", "")
        rates = [f"step times estimated at {self.rates}"] if self.rates else []
        legend = ["* the pick; samples/s: the median timed step's (the slowest-fastest step's); est.: the cost "
                  "model's samples/s; peak: measured, per rank"
                  + ("; a close call timed side by side is decided there (the line under the header; its "
                     "candidates come first, in that order)" if any(c.side_by_side for c in self.candidates) else "")]
        hidden = [] if all_rows else self._pruned_lines(set(shown), width)
        stopped = [self.stopped] if self.stopped else []
        top = [wrapped for line in (head, *self._time_lines(width), *self._counts_line(), *stopped, *rates, *self._tie_line())
               for wrapped in fold(line, width)]
        bottom = [wrapped for line in (*tail, *legend) for wrapped in fold(line, width)]
        return "\n".join([*top, *lines, *hidden, *bottom])

    def _pruned_lines(self, shown: set[int], width: int) -> list[str]:
        """The pruned candidates without a row, grouped by the rule that pruned them, a few named."""
        groups: dict[str, list[str]] = {}
        for index, c in enumerate(self.candidates):
            if c.status == PRUNED and index not in shown:
                name = self._name(index)
                if c.generated_as:  # a duplicate: how it was generated, and what it is once planned
                    name = f"{c.generated_as} (planned: {name})"
                groups.setdefault(c.pruned_by or "other", []).append(name)
        lines = []
        for rule, names in sorted(groups.items(), key=lambda item: -len(item[1])):
            listed = "; ".join(names[:3]) + ("; ..." if len(names) > 3 else "")
            lines += fold(f"pruned, {rule.replace('_', ' ')} ({self._group_count(rule, len(names))}): {listed}",
                          width)
        if lines:
            lines.append("every candidate with its reason: atorch explain REPORT --all, or the report's JSON")
        return lines

    def _group_count(self, rule: str, listed: int) -> str:
        """How many a grouped line lists, beside the header's count where that is larger: candidates
        the same as one generated before them were merged as the space was built, and have no record."""
        total = (self.pruned or {}).get(rule, listed)
        records = sum(1 for c in self.candidates if c.status == PRUNED and (c.pruned_by or "other") == rule)
        merged = total - records  # counted in the header, no record (merged before planning)
        return f"{listed}" if merged <= 0 else f"{listed} listed of {total}; {merged} merged as the space was built"

    def _estimate_text(self, c: CandidateResult) -> str:
        if not c.estimated_step_seconds:
            return "-"
        if self.global_batch:
            return _rate_text(self.global_batch / c.estimated_step_seconds)
        return f"{c.estimated_step_seconds * 1e3:.2f}ms/step"

    def _name(self, index: int) -> str:
        return self.candidates[index].name

    def _tie_line(self) -> list[str]:
        together = sorted((i for i, c in enumerate(self.candidates) if c.status == MEASURED and c.side_by_side),
                          key=lambda i: -self.candidates[i].side_by_side)
        if self.winner is not None and len(together) > 1:
            return self._side_by_side_lines(together)
        if self.winner is None or not self.tied:
            return self._refined_line()
        others = ", ".join(self._name(i) for i in self.tied)
        from atorch.auto.search.pick import TIE_CAP, TIE_ESTIMATE

        return [f"{self._decided()}: tied with {others} (their step ranges overlap the best's, medians within "
                f"{TIE_CAP:.0%}); the tie goes to fewer methods among those estimated within {TIE_ESTIMATE:.0%} of "
                "the fastest, then the faster estimate", *self._refined_line()]

    def _decided(self) -> str:
        """Who the close call (or the tie rule) picked: the winner, or the pick it refines."""
        if self.refined_from is None:
            return f"winner {self._name(self.winner)}"
        return f"pick {self._name(self.refined_from)}"

    def _refined_line(self) -> list[str]:
        """Where the winner is the pick with methods tried on it and kept: which ones."""
        if self.winner is None or self.refined_from is None:
            return []
        added = [n for n in self.candidates[self.winner].names if n not in self.candidates[self.refined_from].names]
        return [f"winner {self._name(self.winner)}: the pick with {' + '.join(added) or 'a config'} tried on it "
                "and kept (its row says why)"]

    def _side_by_side_lines(self, together: list[int]) -> list[str]:
        from atorch.auto.search.sidebyside import CONFIDENCE, TIE, TURN_STEPS

        figures = "; ".join(self._side_by_side_figure(i) for i in together)
        lines = [f"the close call timed side by side (turns of {TURN_STEPS} steps in turn; samples/s of the "
                 f"median turn; behind the fastest turn by turn, with the {CONFIDENCE:.0%} band of that ratio): "
                 f"{figures}"]
        if self.tied:
            others = ", ".join(self._name(i) for i in self.tied)
            lines.append(f"{self._decided()}: tied with {others} (a band reaching within {TIE:.1%} "
                         "of the fastest: the turns cannot tell them apart); the tie goes to the lower measured "
                         "peak, then fewer methods, then the faster")
        elif self.winner is not None:
            lines.append(f"{self._decided()}: no tie (every other band lies beyond {TIE:.1%} behind)")
        return lines + self._refined_line()

    def _side_by_side_figure(self, index: int) -> str:
        c = self.candidates[index]
        text = f"{self._name(index)} {_rate_text(c.side_by_side)} ({len(c.side_by_side_seconds or ())} turns"
        behind = c.side_by_side_behind
        if behind and behind[0] > 1.0:
            text += f", x{behind[0]:.3f} behind, band {behind[1]:.3f}-{behind[2]:.3f}"
        elif behind:
            text += ", the fastest"
        return text + ")"

    def _time_lines(self, width: int) -> list[str]:
        """Where the search's time went, stage by stage, folded between stages (none in reports
        from before it was kept)."""
        if not self.stage_seconds:
            return []
        text = "time: " + ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in self.stage_seconds.items())
        first, *rest = wrap_cell(text, width - 4)
        return [first, *("    " + line for line in rest)]

    def _counts_line(self) -> list[str]:
        if self.generated is None:
            return []
        pruned = ", ".join(f"{n} {rule.replace('_', ' ')}" for rule, n in (self.pruned or {}).items()) or "none"
        return [f"{self.generated} generated; pruned: {pruned}; {self.dry_run} dry-run"]

    def _display_order(self) -> list[int]:
        """Measured, then failed, then pruned; the measured ones timed side by side first, in their
        order there (what decided), then the others by their dry runs' samples/s."""
        rank = {MEASURED: 0, FAILED: 1, PRUNED: 2}

        def key(i: int) -> tuple:
            c = self.candidates[i]
            together = c.status == MEASURED and bool(c.side_by_side)
            return rank.get(c.status, 3), not together, -((c.side_by_side if together else c.throughput) or 0)

        return sorted(range(len(self.candidates)), key=key)

    def breakdown(self, width: int | None = None) -> str:
        """Each candidate's memory estimate per rank, term by term (what the JSON's
        ``estimate_breakdown`` holds), in the table's order, within ``width``."""
        width = width or output_width()
        lines = ["estimated memory per rank, by term:"]
        for index in self._display_order():
            c = self.candidates[index]
            if not c.estimate_breakdown:
                continue
            terms = ", ".join(f"{key} {_term_text(key, value)}" for key, value in c.estimate_breakdown.items())
            lines += fold(f"  {self._name(index)}: {terms}", width)
        return "\n".join(lines) if len(lines) > 1 else "no memory estimates in this report"

def _table_lines(rows: list[tuple], width: int) -> list[str]:
    """``rows`` as aligned columns within ``width`` (atorch.utils.text_table.table): the strategy
    and layout columns fold at their " + ", ", " and " x ", the last (status and reason) takes the
    width left and wraps under itself; no word is cut. A cell past ``CELL_LIMIT`` characters (a
    damaged or hostile report) is cut there: wrapping 16 MB of one word took minutes."""
    rows = [tuple(_clipped(cell) for cell in row) for row in rows]
    return table(rows, width, wrap=(1, 2, 3), fill=len(rows[0]) - 1, title=(0, 1, 2), title_text=_stacked_title)


def _stacked_title(cells: list[str]) -> str:
    """A row's title where the table stacks (a narrow terminal): ``* zero1 [data=2]``."""
    *first, layout = cells
    return " ".join(first) + (f" [{layout}]" if layout not in ("-", "layout") else "")


CELL_LIMIT = 2000


def _clipped(text: str) -> str:
    return text if len(text) <= CELL_LIMIT else text[:CELL_LIMIT] + f" ... ({len(text) - CELL_LIMIT} more characters)"


def _rate_text(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _throughput_text(c: CandidateResult) -> str:
    """The median step's samples/s, with the slowest and fastest step's when there are several."""
    if not c.throughput:
        return "-"
    low, high = c.throughput_range or (None, None)
    if low is None or len(c.step_seconds or ()) < 2:
        return _rate_text(c.throughput)
    return f"{_rate_text(c.throughput)} ({_rate_text(low)}-{_rate_text(high)})"


def _age_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _term_text(key: str, value) -> str:
    if value is None:
        return "-"
    if "flops" in key:
        return f"{value:.3g} FLOP"
    if isinstance(value, (int, float)):
        return size_text(int(value))
    return str(value)
