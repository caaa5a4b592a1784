"""The optimizer step on FSDP2's local shards gives the DTensor step's result, on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from atorch.sharding import local_step
from atorch.sharding.local_step import step_on_local_shards
from tests.helpers.dist import run_distributed

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "rmsprop-foreach-off": (torch.optim.RMSprop, {"lr": 1e-2, "foreach": False}),
}


def _sharded_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 7 rows: the second rank's shards are shorter (uneven sharding), the bias's shard too.
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, optim, steps: int = 4, scheduler=None) -> None:
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(4, 5, generator=gen)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _local_state(optim) -> list:
    return [{k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in optim.state[p].items()}
            for group in optim.param_groups for p in group["params"]]


def _compare(name: str) -> dict:
    cls, kwargs = OPTIMIZERS[name]
    runs = {}
    for local in (False, True):
        model = _sharded_model()
        optim = cls(model.parameters(), **kwargs)
        patched = step_on_local_shards(optim) if local else False
        scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
        plans = []  # each step's plan: None would mean that step fell back to the DTensor step
        real = local_step._local_plan
        local_step._local_plan = lambda opt: plans.append(real(opt)) or plans[-1]
        try:
            _train(model, optim, scheduler=scheduler)
        finally:
            local_step._local_plan = real
        state = optim.state[next(iter(model.parameters()))]
        runs[local] = {
            "patched": patched,
            "local_steps": sum(plan is not None for plan in plans),
            "params": [p.to_local().clone() for p in model.parameters()],
            "state": _local_state(optim),
            "state_is_dtensor": {k: isinstance(v, DTensor) for k, v in state.items()},
            "state_dict_keys": sorted(optim.state_dict()["state"][0]),
            "lr": optim.param_groups[0]["lr"],
            "foreach": optim.param_groups[0].get("foreach"),
        }
    return runs


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_local_step_matches_the_dtensor_step(name):
    for runs in run_distributed(_compare, 2, name):
        dtensor, local = runs[False], runs[True]
        assert local["patched"] and local["local_steps"] == 4 and dtensor["local_steps"] == 0
        for a, b in zip(dtensor["params"], local["params"]):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for a, b in zip(dtensor["state"], local["state"]):
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7)
        # Same layout as before: shard-shaped state as DTensors, step counters plain.
        assert local["state_is_dtensor"] == dtensor["state_is_dtensor"]
        assert local["state_dict_keys"] == dtensor["state_dict_keys"]
        assert local["lr"] == dtensor["lr"] < OPTIMIZERS[name][1]["lr"]  # the scheduler's decay reached it
        assert local["foreach"] == OPTIMIZERS[name][1].get("foreach")  # the user's setting is left as given


def _moved_params() -> dict:
    model = _sharded_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert step_on_local_shards(optim)
    before = [p.to_local().clone() for p in model.parameters()]
    x = torch.randn(4, 5)

    def closure():
        optim.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = optim.step(closure)
    return {"loss": float(loss), "moved": [not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())
                                           if p.to_local().numel()]}


def test_closure_gradients_are_the_ones_stepped():
    for result in run_distributed(_moved_params, 2):
        assert result["loss"] > 0 and all(result["moved"])


def test_optimizers_that_are_not_elementwise_keep_their_step():
    class MyAdam(torch.optim.Adam):
        pass

    params = [nn.Parameter(torch.ones(3))]
    for optim in (torch.optim.LBFGS(params), MyAdam(params), torch.optim.Adam(params, differentiable=True)):
        assert not step_on_local_shards(optim)
        assert "step" not in vars(optim)
