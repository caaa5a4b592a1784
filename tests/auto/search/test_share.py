"""The ranks share a search's probes out (atorch/auto/search/share.py): each probe runs once, on
one rank, and every rank ends with every result, the same as it would have computed alone."""

import torch
import torch.distributed as dist

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.search import cost, estimate
from atorch.auto.search.share import run_shared
from atorch.auto.strategy import Strategy
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def _jobs(ran: list) -> list:
    def job(i):
        def run():
            ran.append(i)
            if i == 3:
                raise ValueError("job 3 breaks")
            return i * i
        return run

    return [(f"job{i}", job(i)) for i in range(5)]


def _run_jobs(stop_after_first_round: bool):
    ran: list = []
    results: dict = {}
    seconds = run_shared(_jobs(ran), results, lambda: stop_after_first_round)
    return dist.get_rank(), ran, results, sorted(seconds)


def test_each_job_runs_once_on_one_rank_and_every_rank_gets_every_result():
    outcomes = run_distributed(_run_jobs, 2, False, timeout_s=120)
    assert [ran for _, ran, _, _ in outcomes] == [[0, 2, 4], [1, 3]]
    for _, _, results, seconds in outcomes:
        assert {k: v for k, v in results.items() if k != "job3"} == {"job0": 0, "job1": 1, "job2": 4, "job4": 16}
        assert isinstance(results["job3"], cost.ProbeFailed) and "job 3 breaks" in results["job3"].error
        assert seconds == ["job0", "job1", "job2", "job3", "job4"]


def test_out_of_time_stops_between_rounds():
    outcomes = run_distributed(_run_jobs, 2, True, timeout_s=120)
    for _, ran, results, _ in outcomes:
        assert len(ran) == 1 and sorted(results) == ["job0", "job1"]


CANDIDATES = ([], ["checkpoint"], ["zero2"], ["checkpoint", "zero2"], [("amp_native", "bf16")], ["checkpoint"])


def _batch():
    return {k: torch.stack([TokenDataset(n=4)[i][k] for i in range(2)]) for k in ("input_ids", "labels")}


def _share(counted: list):
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    batch = _batch()
    device_ctx = DeviceContext.detect()
    ctx = type("Job", (), {"model_input_format": "unpack_dict", "loss_func": staticmethod(lm_loss)})()
    real = cost._saved_bytes
    cost._saved_bytes = lambda *args, **kw: counted.append(1) or real(*args, **kw)
    try:
        candidates = [resolve_strategy(model, Strategy([("parallel_mode", {}), *m])) for m in CANDIDATES]
        memo: dict = {}
        keys, _ = estimate.share_probes(model, candidates, lambda dims: batch, ctx, device_ctx, memo, lambda: False)
    finally:
        cost._saved_bytes = real
    # what this rank would have computed alone, key by key
    alone = {}
    for strategy in candidates:
        for stages, key in zip(cost.probe_stages(strategy), keys[id(strategy)], strict=True):
            alone[key] = cost.probe_once(model, strategy, batch, "unpack_dict", lm_loss, device_ctx, stages)
    return memo, alone


def _share_on_rank():
    counted: list = []
    memo, alone = _share(counted)
    # keys hold the batch's id, which differs between processes: compare by the applied methods
    return len(counted), sorted((k[1], v) for k, v in memo.items()), sorted((k[1], v) for k, v in alone.items())


def test_shared_probes_give_every_rank_what_it_would_have_computed_alone():
    single = _share_on_rank()
    shared = run_distributed(_share_on_rank, 2, timeout_s=180)
    for forwards, memo, alone in shared:
        assert memo == alone
    assert [memo for _, memo, _ in shared] == [single[1], single[1]]
    # plain, checkpointed (and its plain-forward probe, plain's), bf16: 3 distinct probes, split 2 + 1
    assert single[0] == 3 and sorted(f for f, _, _ in shared) == [1, 2]
