"""AxoNN's ``optimize_communication`` (``from atorch.intra_layer import optimize_communication``):
every option on, on a row x depth grid of 4 gloo ranks, trains the serial model's weights; the
collectives really run asynchronously around the computation (the order of issue, compute and
wait is recorded), and a cached weight is gathered once for several micro batches."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atorch import intra_layer
from atorch.compat import axonn as ax
from atorch.intra_layer import optimize_communication, overlap
from tests.compat.test_axonn import dataset, mlp
from tests.helpers.dist import run_distributed

GLOBAL_BATCH, MICRO_BATCH, STEPS, LR = 16, 4, 3, 0.5
ALL_ON = dict(overlap_all_reduce=True, overlap_reduce_scatter=True, cache_weights=True, overlap_all_gather=True)


def _serial() -> tuple[list, dict]:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _, (x, y) in zip(range(STEPS), torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH)):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _model():
    torch.manual_seed(123)
    with intra_layer.auto_parallelize():
        model = mlp()
    torch.manual_seed(0)
    model.load_state_dict(mlp().state_dict())
    return model


def _weights(model) -> dict:
    out = {}
    for name, param in model.state_dict().items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        out[name] = module.full_weight() if isinstance(module, intra_layer.Linear) and name.endswith("weight") else param
    return out


def _global_loss(loss: float) -> float:
    total = torch.tensor(loss)
    dist.all_reduce(total)  # row ranks hold the same samples, depth ranks different ones: the world mean
    return total.item() / dist.get_world_size()


def _easy_api(options: dict) -> dict:
    """AxoNN's EasyAPI loop: forward and backward of every micro batch inside the context."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = ax.create_dataloader(dataset(), GLOBAL_BATCH, MICRO_BATCH)
    losses, events = [], None
    for step, (x, y) in zip(range(STEPS), loader):
        optimizer.zero_grad()
        micro = x.shape[0] // MICRO_BATCH
        with overlap.record_events() as recorded:
            with optimize_communication(**options, model_object_for_overlapping_allgathers=model):
                total = 0.0
                for xm, ym in zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)):
                    loss = nn.functional.cross_entropy(model(xm), ym) / micro
                    loss.backward()
                    total += loss.item()
        if step == 0:
            events = list(recorded)
        intra_layer.sync_gradients(model, mean=True)
        optimizer.step()
        losses.append(_global_loss(total))
    return {"losses": losses, "weights": _weights(model), "events": events, "micro": micro}


def _guide_flow() -> list:
    """The AxoNN guide's flow (register_*, run_batch) with run_batch inside the context."""
    model = _model()
    model, optimizer = ax.register_model_and_optimizer(model, torch.optim.SGD(model.parameters(), lr=LR))
    ax.register_loss_fn(nn.CrossEntropyLoss())
    losses = []
    for _, (x, y) in zip(range(STEPS), ax.create_dataloader(dataset(), GLOBAL_BATCH, MICRO_BATCH)):
        optimizer.zero_grad()
        with optimize_communication(**ALL_ON, model_object_for_overlapping_allgathers=model):
            loss = ax.run_batch(x, y)
        optimizer.step()
        losses.append(_global_loss(loss))
    return losses


def _all() -> dict:
    ax.init(1, 1, 2, 1, 2)  # G_inter, G_data, G_intra_r=2, G_intra_c=1, G_intra_d=2
    linears = sum(isinstance(m, intra_layer.Linear) for m in _model().modules())
    return {"on": _easy_api(ALL_ON), "off": _easy_api(dict(overlap_all_reduce=False)), "guide": _guide_flow(),
            "linears": linears}


def test_optimize_communication_on_4_ranks_matches_serial_and_overlaps():
    ref_losses, ref_weights = _serial()
    for rank, result in enumerate(run_distributed(_all, 4)):
        for run in ("on", "off"):
            for got, want in zip(result[run]["losses"], ref_losses, strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (rank, run, result[run]["losses"], ref_losses)
            for name, want in ref_weights.items():
                diff = (result[run]["weights"][name] - want).abs().max().item()
                assert diff <= 1e-5 * max(1.0, want.abs().max().item()), (rank, run, name, diff)
        for got, want in zip(result["guide"], ref_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, result["guide"], ref_losses)
        events, off = result["on"]["events"], result["off"]["events"]
        assert off == []  # control: outside the options nothing runs asynchronously
        assert result["on"]["micro"] == 2 and result["linears"] >= 2
        # each weight gathered once for both micro batches (cache), started ahead (prefetch)
        assert events.count("all_gather_issue") == result["linears"], events
        assert events.index("all_gather_issue") < events.index("all_gather_wait")
        # the input-gradient all-reduce runs while the weight gradient is computed
        issue = events.index("all_reduce_issue")
        assert events[issue + 1:issue + 3] == ["weight_grad", "all_reduce_wait"], events
        # the depth reduce-scatters are all issued during backward and waited for at the exit
        last_issue = len(events) - 1 - events[::-1].index("reduce_scatter_issue")
        assert events.count("reduce_scatter_issue") == 2 * result["linears"]  # 2 micro batches
        assert events[last_issue + 1:] == ["reduce_scatter_wait"] * (2 * result["linears"])


def test_optimize_communication_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="model_object_for_overlapping_allgathers"):
        with optimize_communication(overlap_all_gather=True):
            pass
    with pytest.raises(ValueError, match="does not know"):
        with optimize_communication(bucket_size=10):
            pass
