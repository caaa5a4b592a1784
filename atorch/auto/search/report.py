"""The search report: every candidate's outcome, readable as JSON and as a table."""

import json
import os
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from atorch.utils.files import write_text_atomic

MEASURED, PRUNED, FAILED = "measured", "pruned", "failed"


@dataclass
class CandidateResult:
    strategy: dict
    status: str = PRUNED
    estimated_peak_bytes: int | None = None
    estimate_breakdown: dict | None = None
    estimated_step_seconds: float | None = None
    measured_peak_bytes: int | None = None
    throughput: float | None = None  # global samples per second
    # each dry run's, when it was timed again over more steps (a close call); throughput is then
    # that of all their timed steps
    throughputs: list[float] | None = None
    seconds: float | None = None
    reason: str | None = None
    # How the ranks split, e.g. "tensor=2 x data=2" (None in reports from before layouts were searched).
    layout: str | None = None
    # The pruning rule that removed it (a key of SearchReport.pruned), when pruned.
    pruned_by: str | None = None

    @property
    def names(self) -> list[str]:
        return [m["name"] for m in self.strategy["methods"]]


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

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as JSON, atomically; every rank may save to the same path at once."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchReport":
        data = dict(data)
        data["candidates"] = [CandidateResult(**c) for c in data.get("candidates", [])]
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SearchReport":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path} is not an atorch search report: {error}") from None

    def table(self, reason_width: int = 72) -> str:
        """One row per candidate: status, throughput, estimated and measured memory, reason.

        Reasons are shown whole, wrapped at ``reason_width`` characters under their column (a
        reason is often the one thing that says what to change)."""
        rows = [("", "strategy", "layout", "status", "samples/s", "est. step", "est. peak", "meas. peak", "reason")]
        for index in self._display_order():
            c = self.candidates[index]
            rows.append((
                "*" if index == self.winner else "",
                " + ".join(c.names) or "(plain)",
                c.layout or "-",
                c.status,
                f"{c.throughput:.1f}" if c.throughput else "-",
                f"{c.estimated_step_seconds * 1e3:.2f}ms" if c.estimated_step_seconds else "-",
                size_text(c.estimated_peak_bytes),
                size_text(c.measured_peak_bytes),
                c.reason or "",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        indent = " " * (sum(widths) + 2 * len(widths))
        lines = []
        for row in rows:
            reason = textwrap.wrap(row[-1], reason_width, break_on_hyphens=False) or [""]
            cells = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
            lines.append(f"{cells}  {reason[0]}".rstrip())
            lines += [indent + more for more in reason[1:]]
        head = (f"atorch search: {len(self.candidates)} candidates on {self.world_size} x {self.device}, "
                f"memory budget {size_text(self.memory_budget_bytes)}, {self.search_seconds:.1f}s")
        tail = [self.note] if self.note else []
        rates = [f"step times estimated at {self.rates}"] if self.rates else []
        return "\n".join([head, *self._counts_line(), *rates, *lines, *tail])

    def _counts_line(self) -> list[str]:
        if self.generated is None:
            return []
        pruned = ", ".join(f"{n} {rule.replace('_', ' ')}" for rule, n in (self.pruned or {}).items()) or "none"
        return [f"{self.generated} generated; pruned: {pruned}; {self.dry_run} dry-run"]

    def _display_order(self) -> list[int]:
        rank = {MEASURED: 0, FAILED: 1, PRUNED: 2}
        return sorted(range(len(self.candidates)),
                      key=lambda i: (rank.get(self.candidates[i].status, 3), -(self.candidates[i].throughput or 0)))

    def breakdown(self) -> str:
        """Each candidate's memory estimate per rank, term by term (what the JSON's
        ``estimate_breakdown`` holds), in the table's order."""
        lines = ["estimated memory per rank, by term:"]
        for index in self._display_order():
            c = self.candidates[index]
            if not c.estimate_breakdown:
                continue
            terms = ", ".join(f"{key} {_term_text(key, value)}" for key, value in c.estimate_breakdown.items())
            lines.append(f"  {' + '.join(c.names) or '(plain)'}: {terms}")
        return "\n".join(lines) if len(lines) > 1 else "no memory estimates in this report"

def size_text(value: int | None) -> str:
    """Bytes as ``12.1MiB``; None as ``-``."""
    if value is None:
        return "-"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= factor:
            return f"{value / factor:.1f}{unit}"
    return f"{value}B"


def _term_text(key: str, value) -> str:
    if value is None:
        return "-"
    if "flops" in key:
        return f"{value:.3g} FLOP"
    if isinstance(value, (int, float)):
        return size_text(int(value))
    return str(value)
