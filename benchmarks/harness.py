"""What every benchmark shares: interleaved timing, medians, results on disk, plots.

Timing rules (these machines are shared and noisy, so only ratios taken side by side hold):
- every compared variant lives in the same processes at the same time;
- variants run in interleaved blocks (A B C, then C B A, ...), so drift hits all of them alike;
- each block starts at a barrier and lasts as long as the slowest rank (max over ranks);
- a benchmark reports medians with min and max over the repetitions, and ratios of medians.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"


def _slowest(seconds: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def interleave(steps: dict[str, Callable[[], None]], repeats: int, steps_per_block: int,
               warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step of each variant, one sample per repetition, taken in interleaved blocks.

    ``steps`` maps a name to a function that runs one training step of that variant. Every rank
    calls this with the same names in the same order.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            _barrier()
            start = time.perf_counter()
            for _ in range(steps_per_block):
                steps[name]()
            samples[name].append(_slowest(time.perf_counter() - start) / steps_per_block)
    return samples


def summary(samples: list[float]) -> dict:
    """Median, min and max of one variant's samples."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median of ``numerator`` over median of ``denominator`` (>1: the numerator is slower)."""
    return statistics.median(samples[numerator]) / statistics.median(samples[denominator])


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2 long")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def machine() -> dict:
    """Where and when a result was taken."""
    import os

    return {"date": date.today().isoformat(), "python": sys.version.split()[0], "torch": torch.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}


def run_loaded(job, nproc: int):
    """``job`` on ``nproc`` local gloo ranks; rank 0's result and the machine's load average before
    and after (these machines are shared: the load says how much else competed for the cores)."""
    import os

    from atorch.distributed.local import run_local

    before = os.getloadavg()[0]
    result = run_local(job, nproc, timeout_s=3600)[0]
    return result, {"before": before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}


def load_note(load: dict | None) -> str:
    """A results file's first line about the machine's load (:func:`run_loaded`)."""
    if not load:
        return ""
    return f"Load average {load['before']:.1f} before, {load['after']:.1f} after, on {load['cpus']} cores.\n\n"


def write(out: str | Path, payload: dict, markdown: str) -> Path:
    """Write ``out``.json (payload plus machine) and ``out``.md; return the markdown path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "command": " ".join(["python", *sys.argv]), **payload}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    header = f"<!-- {payload['command']} | {payload['machine']['date']} | torch {torch.__version__} -->\n"
    out.with_suffix(".md").write_text(header + markdown + "\n")
    return out.with_suffix(".md")


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio_plot(path: str | Path, labels: list[str], series: dict[str, list[float]], title: str,
               goal: float | None = None, ylabel: str = "step time ratio (lower is faster)") -> Path | None:
    """A grouped bar chart of ratios with an optional goal line; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels)), 3.5))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
    if goal is not None:
        ax.axhline(goal, color="black", linestyle="--", linewidth=1, label=f"goal {goal:g}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser(doc: str, name: str, option: str, known, repeats: int, steps: int, tiny: str) -> argparse.ArgumentParser:
    """The command line every timed benchmark shares: --nproc, --repeats, --steps, ``--<option>``
    (a comma-separated choice from ``known``), --tiny, --out and --plot (defaults named ``name``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--steps", type=int, default=steps, help="steps per timed block")
    p.add_argument(f"--{option}", default=",".join(known), help=f"comma-separated, from {list(known)}")
    p.add_argument("--tiny", action="store_true", help=tiny)
    p.add_argument("--out", default=str(RESULTS / name))
    p.add_argument("--plot", default=str(IMAGES / f"{name}.png"))
    return p


def choices(p: argparse.ArgumentParser, text: str, known, what: str) -> list[str]:
    """The names in comma-separated ``text``; an unknown one ends the command with the known list."""
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown:
        p.error(f"unknown {what} {unknown}; choose from {list(known)}")
    return names


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"
