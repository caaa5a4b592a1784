"""Close calls are timed again (engine._close_call) where they cannot be timed side by side: one
dry run's few steps vary enough between runs on a loaded machine to swap candidates within several
percent of each other, or to leave one that its other readings put in a tie far behind after a
single reading."""

import statistics

import pytest
import torch

from atorch.auto.search import closecall, dryruns, refine
from atorch.auto.search.candidate import MEASURED
from atorch.auto.search.closecall import RETIME_BAND, RETIME_MARGIN
from atorch.auto.search.closecall import close_call as _close_call
from atorch.auto.search.report import CandidateResult, SearchReport
from atorch.auto.strategy import Strategy


def _measured(**throughputs):
    return [(Strategy([name]), CandidateResult(Strategy([name]).to_dict(), status=MEASURED, throughput=value))
            for name, value in throughputs.items()]


def _search(tmp_path) -> SearchReport:
    """A search in this one process whose budget (under plain's peak, 672 KiB) lets
    memory-saving candidates run beside it; its report."""
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    path = tmp_path / "report.json"
    status, _, _ = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=str(path),
        use_search_cache=False, dryrun_warmup_steps=1, dryrun_steps=2, max_dryruns=4, memory_budget="650KiB",
        excluded=["fused_optimizer", "native_dynamo"],  # the close call only: no trial on the pick after it
    )
    assert status
    return SearchReport.load(path)


def test_the_best_and_a_close_runner_up_are_timed_again_runner_up_first():
    results = _measured(checkpoint=100.0, zero1=100.0 * (1 - RETIME_MARGIN / 2), fsdp=100.0 * (1 - RETIME_MARGIN) / 2)
    assert [s.opt_names for s, _ in _close_call(results)] == [["zero1"], ["checkpoint"]]


def test_every_runner_up_within_the_margin_is_timed_again_slowest_first_up_to_the_band():
    # not only the runner-up: a third candidate read once far below its other readings would stay
    # out of the tie its estimate wins (small's plain data parallelism, 2 searches of 5)
    names = ["checkpoint", "zero1", "zero2", "amp_native", "gradient_accumulation", "module_replace"][:RETIME_BAND + 1]
    near = {name: 100.0 * (1 - RETIME_MARGIN * i / (RETIME_BAND + 1)) for i, name in enumerate(names)}
    close = _close_call(_measured(**near, fsdp=100.0 * (1 - RETIME_MARGIN) / 2))
    assert [s.opt_names[0] for s, _ in close] == names[:RETIME_BAND][::-1]


def test_a_runner_up_whose_fastest_step_is_within_the_margin_joins_the_close_call():
    # the README example's search: plain data parallelism read 968 samples/s (816-1191), 34% behind
    # zero1's 1465, and was left out; side by side it runs 5-17% ahead of zero1
    results = _measured(zero1=1465.0, parallel_mode=968.0, zero2=700.0)
    results[1][1].throughput_range = [816.0, 1191.0]
    results[2][1].throughput_range = [600.0, 1465.0 * (1 - RETIME_MARGIN) - 1]  # behind even at its fastest step
    assert [s.opt_names for s, _ in _close_call(results)] == [["parallel_mode"], ["zero1"]]
    # the best is in the close call even where the others' fastest steps outrun its median
    ahead = _measured(zero1=100.0, **{name: 95.0 for name in ("zero2", "fsdp", "checkpoint", "amp_native", "half")})
    for _, result in ahead[1:]:
        result.throughput_range = [90.0, 110.0]
    close = _close_call(ahead)
    assert len(close) == RETIME_BAND and close[-1][0].opt_names == ["zero1"]


def test_a_clear_winner_or_a_lone_one_is_not_timed_again():
    assert _close_call(_measured(checkpoint=100.0, zero1=100.0 * (1 - RETIME_MARGIN) / 2)) == []
    assert _close_call(_measured(checkpoint=100.0)) == []


def test_a_search_times_a_close_call_again_and_keeps_the_median_step(tmp_path, monkeypatch):
    # Every runner-up counts as close here, so the search re-times: one by one, as where the
    # candidates' copies cannot be alive together (tests/auto/search/test_side_by_side.py has the rest).
    monkeypatch.setattr(closecall, "RETIME_MARGIN", 1.0)
    monkeypatch.setattr(closecall, "fits_together", lambda *args: False)
    monkeypatch.setattr(refine, "fits_together", lambda *args: False)  # no trial on the pick either
    order = []
    measure = dryruns.dry_run

    def recorded(pristine, strategy, *args, **kwargs):
        order.append(strategy.to_json())  # two candidates may differ only in a config (accumulation steps)
        return measure(pristine, strategy, *args, **kwargs)

    monkeypatch.setattr(dryruns, "dry_run", recorded)
    report = _search(tmp_path)
    retimed = [c for c in report.candidates if c.throughputs]
    band = min(RETIME_BAND, sum(c.status == MEASURED for c in report.candidates))
    assert band >= 3 and len(retimed) == band, report.table()
    assert report.candidates[report.winner] in retimed
    for candidate in retimed:
        assert len(candidate.throughputs) == 1 + closecall.RETIME_ROUNDS and candidate.status == MEASURED
        # the median step over every timed step of the 3 dry runs (each dry run's own reading kept)
        assert len(candidate.step_seconds) == 2 * len(candidate.throughputs)  # dryrun_steps=2 per run
        median = statistics.median(candidate.step_seconds)
        assert candidate.throughput == pytest.approx(report.global_batch / median)
    # each round times every candidate of the band once, in turn
    again = order[-band * closecall.RETIME_ROUNDS:]
    rounds = [again[i * band:(i + 1) * band] for i in range(closecall.RETIME_ROUNDS)]
    assert all(sorted(r) == sorted(rounds[0]) and len(set(r)) == band for r in rounds)


def test_a_second_round_runs_only_while_two_are_within_the_margin():
    results = _measured(checkpoint=100.0, zero1=100.0 * (1 - RETIME_MARGIN / 2))
    assert _close_call(results)
    results[1][1].throughput = 100.0 * (1 - RETIME_MARGIN) / 2  # the runner-up's next reading: far behind
    assert _close_call(results) == []
    results[1][1].throughput = 100.0 / ((1 - RETIME_MARGIN) / 2)  # or far ahead: settled the other way
    assert _close_call(results) == []


def test_a_time_limit_reached_while_re_timing_ends_the_re_timing(tmp_path, monkeypatch):
    # The first re-timing dry run finds no time left: the search stops re-timing and returns
    # what it measured (it had gone on to judge an emptied close call and raised).
    monkeypatch.setattr(closecall, "RETIME_MARGIN", 1.0)
    original, closes = closecall.from_rank0, closecall.close_call

    def close_then_out_of_time(results):
        picked = closes(results)
        monkeypatch.setattr(closecall, "from_rank0", lambda value: False if isinstance(value, bool) else original(value))
        return picked

    monkeypatch.setattr(closecall, "close_call", close_then_out_of_time)
    report = _search(tmp_path)
    assert not [c for c in report.candidates if c.throughputs]  # no re-timing ran
