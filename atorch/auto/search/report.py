"""The search report: every candidate's outcome, readable as JSON and as a table."""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    seconds: float | None = None
    reason: str | None = None

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

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

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

    def table(self) -> str:
        """One row per candidate: status, throughput, estimated and measured memory, reason."""
        rows = [("", "strategy", "status", "samples/s", "est. step", "est. peak", "meas. peak", "reason")]
        rank = {MEASURED: 0, FAILED: 1, PRUNED: 2}
        order = sorted(range(len(self.candidates)),
                       key=lambda i: (rank.get(self.candidates[i].status, 3), -(self.candidates[i].throughput or 0)))
        for index in order:
            c = self.candidates[index]
            rows.append((
                "*" if index == self.winner else "",
                " + ".join(c.names) or "(plain)",
                c.status,
                f"{c.throughput:.1f}" if c.throughput else "-",
                f"{c.estimated_step_seconds * 1e3:.2f}ms" if c.estimated_step_seconds else "-",
                _size(c.estimated_peak_bytes),
                _size(c.measured_peak_bytes),
                (c.reason or "")[:70],
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        head = (f"atorch search: {len(self.candidates)} candidates on {self.world_size} x {self.device}, "
                f"memory budget {_size(self.memory_budget_bytes)}, {self.search_seconds:.1f}s")
        tail = [self.note] if self.note else []
        return "\n".join([head, *lines, *tail])


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= factor:
            return f"{value / factor:.1f}{unit}"
    return f"{value}B"
