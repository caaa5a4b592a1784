import torch

import atorch
from tests.helpers.dist import run_distributed


def test_single_process_without_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert atorch.init_distributed() is False
    assert (atorch.rank(), atorch.world_size(), atorch.local_rank()) == (0, 1, 0)
    assert atorch.device() == torch.device("cpu")


def test_partial_environment_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for var in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    import pytest

    with pytest.raises(RuntimeError, match="torchrun"):
        atorch.init_distributed()


def _describe():
    import torch.distributed as dist

    again = atorch.init_distributed()
    return atorch.rank(), atorch.world_size(), atorch.local_rank(), str(atorch.device()), dist.get_backend(), again


def test_two_processes():
    results = run_distributed(_describe, 2)
    assert results == [(0, 2, 0, "cpu", "gloo", True), (1, 2, 1, "cpu", "gloo", True)]
