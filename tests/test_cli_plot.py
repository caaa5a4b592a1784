"""`atorch explain REPORT --plot`: every candidate with a figure gets a row that tells it apart,
and no two labels overlap where measured points crowd (issue 36: they did)."""

import pytest

from atorch.auto.search.report import CandidateResult, SearchReport

MIB = 2**20


def _candidate(names, layout, peak_mib=None, step_ms=None, throughput=None) -> CandidateResult:
    return CandidateResult({"methods": [{"name": n} for n in names]}, "measured" if throughput else "pruned",
                           None if peak_mib is None else int(peak_mib * MIB), None,
                           None if step_ms is None else step_ms / 1e3,
                           measured_peak_bytes=None if throughput is None else int(peak_mib * MIB),
                           throughput=throughput, layout=layout)


def _crowded_report() -> SearchReport:
    # measured points within a few pixels of each other (as parallel_mode / zero1 / zero2 were)
    candidates = [_candidate(["parallel_mode"], "data=2", 5.9, 6.10, 1275.0),
                  _candidate(["parallel_mode", "zero1"], "data=2", 5.4, 6.00, 1268.0),
                  _candidate(["parallel_mode", "zero2"], "data=2", 5.5, 6.05, 1270.0),
                  _candidate(["parallel_mode", "pipeline_parallel"], "pipeline=2, microbatches=2", 4.7, 7.6, 944.0),
                  _candidate(["parallel_mode", "pipeline_parallel"], "pipeline=2, microbatches=4", 3.1, 7.0, 614.0),
                  _candidate(["parallel_mode", "fsdp"], "data=2", 5.1),  # estimated, pruned
                  _candidate(["parallel_mode", "fsdp"], "data=2")]  # pruned before any estimate: no row
    return SearchReport(2, "cpu", 12_000 * MIB, candidates, winner=0)


def _box(text, renderer):
    from matplotlib.text import Text

    return Text.get_window_extent(text, renderer)  # an annotation's text, without its leader line


def _texts_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_rows_tell_candidates_apart_and_labels_do_not_overlap():
    pytest.importorskip("matplotlib")
    from atorch.cli.plot_report import draw_report

    fig = draw_report(_crowded_report())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    memory, speed = fig.axes[:2]
    rows = [t.get_text() for t in memory.get_yticklabels()]
    assert rows[3] == "parallel_mode + pipeline_parallel [pipeline=2, microbatches=2]   4"
    assert len(rows) == 6 and len(set(rows)) == 6  # the unestimated twin left out, the rest distinct
    numbers = [t for t in speed.texts if t.get_text().isdigit()]
    assert sorted(t.get_text() for t in numbers) == ["1", "2", "3", "4", "5"]
    boxes = [_box(t, renderer) for t in numbers]
    assert not any(_texts_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    points = speed.collections[0].get_offsets()  # each label clear of every point's marker too
    dots = [speed.transData.transform(p) for p in points]
    assert not any(box.x0 < x + 4 and x - 4 < box.x1 and box.y0 < y + 4 and y - 4 < box.y1
                   for box in boxes for x, y in dots)
    titles = [fig.get_suptitle(), memory.get_title(), speed.get_title()]
    assert "6 of 7 candidates" in titles[0]
    top = fig._suptitle.get_window_extent(renderer)
    assert not any(_texts_overlap(top, ax.title.get_window_extent(renderer)) for ax in (memory, speed))
    assert "off scale" in memory.get_xlabel()  # the 12,000 MiB budget is named, not drawn


def test_spread_labels_moves_labels_that_sit_on_each_other():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from atorch.cli.plot_report import spread_labels

    fig, ax = plt.subplots()
    labels = [ax.annotate(str(i), (0.5, 0.5), xytext=(6, 0), textcoords="offset points") for i in range(4)]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    before = [_box(t, renderer) for t in labels]
    assert _texts_overlap(before[0], before[1])  # control: on one point, they overlap
    spread_labels(fig, labels)
    fig.canvas.draw()
    after = [_box(t, renderer) for t in labels]
    assert not any(_texts_overlap(a, b) for i, a in enumerate(after) for b in after[i + 1:])
    plt.close(fig)
