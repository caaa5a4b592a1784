"""An MLP built under auto_parallelize trains like the serial model (sync_gradients, clipping,
create_dataloader), and the errors users can run into."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atorch import intra_layer
from atorch.data import create_dataloader
from atorch.errors import AtorchConfigError, WorldSizeError
from tests.helpers.dist import run_distributed

# (G_data, row, col, depth) on 4 ranks
GRIDS = [(1, 1, 2, 2), (2, 1, 1, 2), (2, 2, 1, 1)]
GLOBAL_BATCH, STEPS, CLIP = 8, 5, 0.5


def mlp() -> nn.Module:
    # 16 -> 3 does not divide a grid of 2: it stays an nn.Linear
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def dataset():
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen))


def _train(model, loader, sync=None, norm_fn=torch.nn.utils.clip_grad_norm_):
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms, first_grads = [], [], None
    for step, (x, y) in zip(range(STEPS), loader):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if sync is not None:
            sync(model)
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        norms.append(float(norm_fn(model.parameters(), CLIP)))
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, norms, first_grads


def _grid_run(g_data, r, c, d) -> dict:
    topology = intra_layer.init(G_data=g_data, G_intra_r=r, G_intra_c=c, G_intra_d=d)
    torch.manual_seed(0)
    serial = mlp()
    ref_losses, ref_norms, ref_grads = _train(serial, torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    torch.manual_seed(123)  # different init: the state dict must bring the serial weights
    with intra_layer.auto_parallelize():
        model = mlp()
    torch.manual_seed(0)
    model.load_state_dict(mlp().state_dict())
    kinds = [type(m).__name__ for m in model if isinstance(m, (nn.Linear, intra_layer.Linear))]
    loader = create_dataloader(dataset(), GLOBAL_BATCH)
    sync = functools.partial(intra_layer.sync_gradients, mean=True)  # each rank's loss is a mean
    losses, norms, grads = _train(model, loader, sync, intra_layer.clip_grad_norm_)
    global_losses = []
    for loss in losses:  # mean over the data x depth ranks = the global batch's mean
        loss = loss.clone()
        dist.all_reduce(loss)
        global_losses.append(loss.item() / dist.get_world_size())
    grad_diff = 0.0
    for name, module in model.named_modules():
        for pname, grad in ((f"{name}.weight", None), (f"{name}.bias", None)):
            if pname not in grads:
                continue
            grad = grads[pname]
            if isinstance(module, intra_layer.Linear) and pname.endswith("weight"):
                grad = module.full_weight(grad)
            grad_diff = max(grad_diff, (grad - ref_grads[pname]).abs().max().item())
    return {"losses": global_losses, "ref_losses": [x.item() for x in ref_losses], "norms": norms,
            "ref_norms": ref_norms, "kinds": kinds, "batch": len(next(iter(loader))[0]), "grad_diff": grad_diff,
            "dp": topology.data_parallel_size, "sum_and_mean": _sum_and_mean(model, ref_grads, topology)}


def _full(model: nn.Module, name: str, grad: torch.Tensor) -> torch.Tensor:
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(module, intra_layer.Linear) and name.endswith("weight"):
        return module.full_weight(grad)
    return grad


def _sum_and_mean(model: nn.Module, ref_grads: dict, topology) -> dict:
    """sync_gradients' default (AxoNN's mean=False) sums over the data x depth ranks: G times the
    serial gradient of the mean loss; mean=True gives the serial gradient (G = data x depth)."""
    torch.manual_seed(0)
    model.load_state_dict(mlp().state_dict())  # back to the serial initial weights
    model.zero_grad()
    x, y = next(iter(create_dataloader(dataset(), GLOBAL_BATCH)))
    nn.functional.cross_entropy(model(x), y).backward()
    for param in model.parameters():
        param.main_grad = param.grad.clone()
    intra_layer.sync_gradients(model)
    intra_layer.sync_gradients(model, gradient_attr_name="main_grad", mean=True)
    g = topology.data_parallel_size
    diffs = {"sum": 0.0, "mean": 0.0}
    for name, param in model.named_parameters():
        ref = ref_grads[name]
        diffs["sum"] = max(diffs["sum"], ((_full(model, name, param.grad) - g * ref).abs().max() / ref.abs().max()).item())
        diffs["mean"] = max(diffs["mean"], ((_full(model, name, param.main_grad) - ref).abs().max()
                                            / ref.abs().max()).item())
    return diffs


def _all_grids():
    results = [_grid_run(*grid) for grid in GRIDS]
    # errors on a real grid of depth 2 (G_data=1, col 2, depth 2)
    intra_layer.init(G_intra_c=2, G_intra_d=2)
    with pytest.raises(WorldSizeError, match="does not divide over 2 data-parallel ranks"):
        create_dataloader(dataset(), 3)
    # AxoNN's order: the third argument is the micro batch size, which must divide each rank's batch
    loader = create_dataloader(dataset(), 8, 2)
    assert (loader.batch_size, loader.micro_batch_size, loader.num_micro_batches, loader.num_workers) == (4, 2, 2, 0)
    with pytest.raises(WorldSizeError, match=r"micro_batch_size=3 does not divide each rank's batch of 4 samples "
                                             r"\(global batch 8 / 2 data x depth ranks\)"):
        create_dataloader(dataset(), 8, 3)
    with pytest.raises(WorldSizeError, match=r"in_features=3 must divide by 2 \(the input-feature group\)"):
        intra_layer.Linear(3, 4)
    with pytest.raises(WorldSizeError, match=r"out_features=3 must divide by 2 \(output-feature group x depth\)"):
        intra_layer.Linear(4, 3)
    # non-dividing layers stay nn.Linear
    intra_layer.init(G_data=2, G_intra_r=2)
    with intra_layer.auto_parallelize():
        model = mlp()
    kinds = [type(m).__module__.split(".")[1] for m in model if hasattr(m, "in_features")]
    # a deep copy (a dry run's pristine copy) shares the process groups and computes the same
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    assert torch.equal(twin(x), model(x)) and twin[0].weight.intra_layer_sharded
    return results, kinds


@functools.cache
def _four_ranks() -> list:
    """Every 4-rank check of this file in one spawn (spawning costs more than they do)."""
    return run_distributed(_all_grids, 4)


def test_auto_parallelized_mlp_trains_like_serial_on_4_ranks():
    for results, kinds in _four_ranks():
        assert kinds == ["intra_layer", "intra_layer", "nn"]  # 16 -> 3 does not divide by 2
        for grid, res in zip(GRIDS, results):
            assert res["kinds"] == ["Linear", "Linear", "Linear"]
            assert res["batch"] == GLOBAL_BATCH // res["dp"] and res["dp"] == grid[0] * grid[3]
            assert res["grad_diff"] <= 1e-5, (grid, res["grad_diff"])
            for got, want in zip(res["losses"] + res["norms"], res["ref_losses"] + res["ref_norms"]):
                assert abs(got - want) <= 1e-5 * abs(want), (grid, res)
            assert res["norms"][0] > CLIP  # clipping was active


def test_sync_gradients_sums_by_default_and_averages_with_mean_on_4_ranks():
    """AxoNN's sync_gradients(model, gradient_attr_name="grad", mean=False, ...): the default sums
    over data x depth (G = 2, 4, 2 on the grids here), mean=True is the serial gradient."""
    for results, _ in _four_ranks():
        for grid, res in zip(GRIDS, results):
            assert res["sum_and_mean"]["sum"] <= 1e-5, (grid, res["sum_and_mean"])
            assert res["sum_and_mean"]["mean"] <= 1e-5, (grid, res["sum_and_mean"])


def test_nn_linear_is_restored_even_after_an_exception():
    intra_layer.init()
    serial = nn.Linear
    with pytest.raises(RuntimeError, match="boom"):
        with intra_layer.auto_parallelize():
            assert nn.Linear is not serial
            assert isinstance(nn.Linear(2, 2), intra_layer.Linear)
            raise RuntimeError("boom")
    assert nn.Linear is serial
    assert type(nn.Linear(2, 2)) is serial


def test_user_errors():
    intra_layer.init()
    with pytest.raises(AtorchConfigError, match="by keyword"):
        create_dataloader(dataset(), 8, 4, 0, True)
    with pytest.raises(WorldSizeError, match="no 3D tensor-parallel grid|world size is 1"):
        intra_layer.init(G_data=2)
