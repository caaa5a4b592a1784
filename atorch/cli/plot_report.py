"""``atorch explain REPORT --plot FILE``: a search report's estimates against its measurements.

Left: the peak memory per rank of each candidate the search estimated or measured (those pruned
before any estimate have no bar and are left out), with the budget when it is in range. Right:
each measured candidate's estimated step time against its measured throughput (a good cost model
puts them on a falling curve: the faster estimate, the higher throughput), each labelled with
its row number on the left; labels are moved apart where points crowd, so no two overlap.
"""

MIB = 2**20


def candidate_label(c) -> str:
    """A candidate as the report's table names it: the methods, then the layout that tells rows apart."""
    return (" + ".join(c.labels) or "(plain)") + (f" [{c.layout}]" if c.layout else "")


def draw_report(report):
    """The two panels as a matplotlib Figure (Agg backend)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("atorch explain --plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in report.candidates if c.estimated_peak_bytes or c.measured_peak_bytes or c.throughput]
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(14, max(3.5, 0.3 * len(shown) + 2)), layout="constrained")
    fig.suptitle(f"search on {report.world_size} x {report.device}: {len(shown)} of {len(report.candidates)} "
                 "candidates estimated or measured", fontsize=10)
    _memory_panel(memory, report, shown)
    _speed_panel(fig, speed, report, shown)
    return fig


def _memory_panel(ax, report, shown) -> None:
    rows = range(len(shown))
    estimated = [(c.estimated_peak_bytes or 0) / MIB for c in shown]
    measured = [(c.measured_peak_bytes or 0) / MIB for c in shown]
    ax.barh([r - 0.2 for r in rows], estimated, height=0.4, label="estimated", color="#9ecae1")
    ax.barh([r + 0.2 for r in rows], measured, height=0.4, label="measured", color="#08519c")
    right = max([*estimated, *measured, 1.0]) * 1.15
    budget = report.memory_budget_bytes / MIB
    if budget <= right:  # a budget far above would squash every bar to the left edge
        ax.axvline(budget, color="#cb181d", linestyle="--", label="budget")
    ax.set_yticks(list(rows), [f"{candidate_label(c)}  {r + 1:>2}" for r, c in enumerate(shown)], fontsize=8)
    ax.set_ylim(len(shown) - 0.5, -0.5)  # the report's order, top down
    ax.set_xlim(0, right)
    ax.set_xlabel("peak memory per rank (MiB)" + ("" if budget <= right else f"; budget {budget:,.0f} MiB, off scale"))
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("memory: estimated vs measured", fontsize=10)


def _speed_panel(fig, ax, report, shown) -> None:
    winner = report.candidates[report.winner] if report.winner is not None else None
    points = [(c.estimated_step_seconds * 1e3, c.throughput, str(r + 1), c is winner)
              for r, c in enumerate(shown) if c.estimated_step_seconds and c.throughput]
    ax.set_xlabel("estimated step time (ms)")
    ax.set_ylabel("measured throughput (samples/s)")
    ax.set_title("time: estimated vs measured" if points else "time: no candidate was measured", fontsize=10)
    if not points:
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.scatter(xs, ys, color="#08519c")
    for x, y, _, won in points:
        if won:
            ax.scatter(x, y, s=160, facecolors="none", edgecolors="#cb181d", label="picked")
            ax.legend(fontsize=8, loc="upper right")
    pad_x, pad_y = (max(xs) - min(xs)) or max(xs), (max(ys) - min(ys)) or max(ys)
    ax.set_xlim(min(xs) - 0.1 * pad_x, max(xs) + 0.1 * pad_x)
    ax.set_ylim(min(ys) - 0.2 * pad_y, max(ys) + 0.15 * pad_y)
    ax.text(0.01, 0.01, "numbers: the rows on the left", transform=ax.transAxes, fontsize=7, color="#636363")
    labels = [ax.annotate(number, (x, y), xytext=(6, 0), textcoords="offset points", va="center", fontsize=8,
                          arrowprops={"arrowstyle": "-", "color": "#969696", "lw": 0.5})
              for x, y, number, _ in points]
    spread_labels(fig, labels)


def _overlap(a, b, gap: float) -> bool:
    return a.x0 < b.x1 + gap and b.x0 < a.x1 + gap and a.y0 < b.y1 + gap and b.y0 < a.y1 + gap


def spread_labels(fig, labels, gap_px: float = 2.0, marker_pt: float = 4.0) -> None:
    """Move annotations down (in offset points) until no label overlaps another or a point's
    marker (``marker_pt`` around each annotated point): top to bottom, each below whatever above
    it it would touch. The layout is fixed first, so the points do not move afterwards."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    radius = marker_pt * fig.dpi / 72.0
    centres = [label.axes.transData.transform(label.xy) for label in labels]
    placed = [Bbox.from_extents(x - radius, y - radius, x + radius, y + radius) for x, y in centres]
    # Text's extent: the label's box without its leader line
    boxes = [(Text.get_window_extent(label, renderer), label) for label in labels]
    for box, label in sorted(boxes, key=lambda b: -b[0].y1):
        shift = 0.0
        while any(_overlap(box.translated(0, -shift), other, gap_px) for other in placed):
            shift += max(box.translated(0, -shift).y1 - (other.y0 - gap_px) for other in placed
                         if _overlap(box.translated(0, -shift), other, gap_px))
        if shift:
            dx, dy = label.xyann
            label.xyann = (dx, dy - shift * 72.0 / fig.dpi)
        placed.append(box.translated(0, -shift))


def plot_report(report, path: str) -> str:
    """Write the two panels to ``path`` (any format matplotlib writes: .png, .svg, .pdf); return it."""
    import matplotlib.pyplot as plt

    fig = draw_report(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
