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
