"""atorch.shutdown(): every rank leaves together, and atorch holds no process group after it."""

import torch

from tests.helpers.dist import run_distributed


def _train_then_shutdown() -> dict:
    import atorch
    from atorch import parallel_state
    from tests.helpers.models import train_losses

    losses = train_losses([("parallel_mode", ([("data", 2)], None)), "fsdp"], steps=2)["losses"]
    held = parallel_state.current_topology() is not None
    atorch.shutdown()
    atorch.shutdown()  # a second call does nothing
    return {"held_before": held, "held_after": parallel_state.current_topology() is not None,
            "initialized": torch.distributed.is_initialized(), "losses": losses}


def test_shutdown_leaves_nothing_initialized():
    results = run_distributed(_train_then_shutdown, 2)
    for result in results:
        assert result["held_before"] and not result["held_after"], result
        assert not result["initialized"]
    assert results[0]["losses"] == results[1]["losses"]


def _gloo_threads() -> int:
    from pathlib import Path

    return sum((task / "comm").read_text().strip() in ("pt_gloo_runloop", "gloo_tcp_loop")
               for task in Path("/proc/self/task").iterdir())


def _import_late_then_shutdown() -> dict:
    import sys

    import atorch

    # Imported after the group started (atorch does so in a save): their default arguments hold it.
    for name in ("torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer"):
        sys.modules.pop(name, None)
    import torch.distributed.nn.functional as fn
    import torch.distributed.optim.zero_redundancy_optimizer as zero

    before = _gloo_threads()
    atorch.shutdown()
    held = [type(fn.all_reduce.__defaults__[-1]).__name__, type(zero._broadcast_object.__defaults__[0]).__name__]
    return {"before": before, "after": _gloo_threads(), "defaults": held}


def test_shutdown_ends_gloo_threads_even_with_the_group_bound_in_defaults():
    """Before: the group lived on in those defaults, its gloo threads until interpreter
    finalization, where tearing it down sometimes aborted a finished job (SIGABRT)."""
    for result in run_distributed(_import_late_then_shutdown, 2):
        assert result["before"] > 0
        assert result["after"] == 0, result
        assert result["defaults"] == ["NoneType", "NoneType"], result
