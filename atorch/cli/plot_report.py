"""``atorch explain REPORT --plot FILE``: a search report's estimates against its measurements.

Left: each candidate's peak memory per rank, estimated and measured, with the budget. Right: each
measured candidate's estimated step time against its measured throughput (a good cost model puts
them on a falling curve: the faster estimate, the higher throughput).
"""


def plot_report(report, path: str) -> str:
    """Write the two panels to ``path`` (any format matplotlib writes: .png, .svg, .pdf); return it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("atorch explain --plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    names = [" + ".join(c.names) or "(plain)" for c in report.candidates]
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(13, max(3.5, 0.35 * len(names) + 1.5)))
    rows = range(len(names))
    estimated = [(c.estimated_peak_bytes or 0) / mib for c in report.candidates]
    measured = [(c.measured_peak_bytes or 0) / mib for c in report.candidates]
    memory.barh([r + 0.2 for r in rows], estimated, height=0.4, label="estimated", color="#9ecae1")
    memory.barh([r - 0.2 for r in rows], measured, height=0.4, label="measured", color="#08519c")
    memory.axvline(report.memory_budget_bytes / mib, color="#cb181d", linestyle="--", label="budget")
    memory.set_yticks(list(rows), names, fontsize=8)
    memory.invert_yaxis()
    memory.set_xlabel("peak memory per rank (MiB)")
    memory.set_xlim(0, max([*estimated, *measured, 1.0]) * 1.15)  # a budget far above stays off the plot
    memory.legend(fontsize=8)
    memory.set_title("memory: estimated vs measured")

    points = [(c.estimated_step_seconds * 1e3, c.throughput, name)
              for c, name in zip(report.candidates, names) if c.estimated_step_seconds and c.throughput]
    for x, y, name in points:
        speed.scatter(x, y, color="#08519c")
        speed.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if report.winner is not None and report.candidates[report.winner].throughput:
        best = report.candidates[report.winner]
        speed.scatter((best.estimated_step_seconds or 0) * 1e3, best.throughput, s=120, facecolors="none",
                      edgecolors="#cb181d", label="picked")
        speed.legend(fontsize=8)
    speed.set_xlabel("estimated step time (ms)")
    speed.set_ylabel("measured throughput (samples/s)")
    speed.set_title("time: estimated vs measured" if points else "time: no candidate was measured")
    fig.suptitle(f"search on {report.world_size} x {report.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
