"""The kept ranks of tests/helpers/pool.py give each run what a fresh process would: the caller's
environment, atorch's module state as imported, a new group; a failed run gets new ranks."""

import os

import pytest

from tests.helpers import pool
from tests.helpers.dist import run_distributed


def _leave_state_behind() -> dict:
    import torch.distributed as dist

    from atorch import parallel_state
    from atorch.auto import registry
    from atorch.auto.search import agree

    seen = {"pid": os.getpid(), "timeout": agree._wanted_timeout, "topology": parallel_state._CURRENT,
            "env": os.environ.get("ATORCH_POOL_PROBE"), "rank": dist.get_rank(),
            "registered": "_left_behind" in registry.method_names()}
    agree.set_timeout(2.0)
    parallel_state._CURRENT = "left behind"  # as auto_accelerate's topology stays after a run
    config_cls = registry.get_method("parallel_mode").config_cls
    registry.register_method(registry.MethodSpec("_left_behind", config_cls, {}, "a test's method"))
    return seen


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 was told to fail")
    dist.barrier()


def test_a_kept_rank_starts_each_run_as_a_fresh_one(monkeypatch):
    if not pool.pooled(2):
        pytest.skip("ATORCH_TEST_FRESH_RANKS=1: every run has new ranks")
    first = run_distributed(_leave_state_behind, 2)
    monkeypatch.setenv("ATORCH_POOL_PROBE", "seen")
    second = run_distributed(_leave_state_behind, 2)
    assert [r["pid"] for r in second] == [r["pid"] for r in first]  # the same processes
    for rank, seen in enumerate(second):
        assert seen["rank"] == rank and seen["env"] == "seen"
        assert seen["timeout"] is None and seen["topology"] is None and not seen["registered"], seen
    with pytest.raises(AssertionError, match="(?s)rank 1:.*ValueError: rank 1 was told to fail"):
        run_distributed(_fail_on_rank_1, 2)
    third = run_distributed(_leave_state_behind, 2)
    assert not {r["pid"] for r in third} & {r["pid"] for r in first}  # a failure retires the ranks


def test_a_single_process_reference_is_kept_and_starts_fresh_too(monkeypatch):
    # A world of one (the serial reference a distributed test compares with) is pooled as well.
    if not pool.pooled(1):
        pytest.skip("ATORCH_TEST_FRESH_RANKS=1: every run has new ranks")
    first = run_distributed(_leave_state_behind, 1)[0]
    monkeypatch.setenv("ATORCH_POOL_PROBE", "seen")
    second = run_distributed(_leave_state_behind, 1)[0]
    assert second["pid"] == first["pid"] and second["pid"] != os.getpid()
    assert second["env"] == "seen" and second["rank"] == 0
    assert second["timeout"] is None and second["topology"] is None and not second["registered"], second


_LEFT = []  # a weak reference a run leaves in this module for the next run of the same rank


class Cycle:
    pass


def _leave_a_cycle() -> dict:
    import gc
    import weakref

    garbage = Cycle()
    garbage.me = garbage  # only the collector frees it
    _LEFT.append(weakref.ref(garbage))
    # returned, it outlives the collection in atorch's release_groups: only the pool's frees it
    return {"frozen": gc.get_freeze_count(), "cycle": garbage}


def _was_it_collected() -> bool:
    return all(ref() is None for ref in _LEFT)


def test_a_kept_rank_skips_its_imports_when_collecting_but_not_a_runs_garbage():
    # The imports are frozen (two collections a run over them cost 0.4-0.6 s); the garbage a run
    # leaves is collected after it, before the next freeze, so it is never kept frozen.
    if not pool.pooled(1):
        pytest.skip("ATORCH_TEST_FRESH_RANKS=1: every run has new ranks")
    frozen = run_distributed(_leave_a_cycle, 1)[0]["frozen"]
    assert frozen > 100_000, frozen  # torch's, transformers' and atorch's objects
    assert run_distributed(_was_it_collected, 1) == [True]
