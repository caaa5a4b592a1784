"""AxoNN's default ``Linear`` contract on atorch.compat.axonn: every rank passes its own samples
(whole features) and gets their whole output, on row-2, column-2, 2x2 and depth grids, against a
serial ``nn.Linear`` on the whole batch, on 4 ranks and on 2; the same batch fed to atorch's default contract is an
error, never a wrong output."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atorch import intra_layer
from atorch.compat import axonn as ax
from atorch.errors import AtorchConfigError
from tests.helpers.dist import run_distributed

IN, OUT = 8, 12
# AxoNN's order: (G_inter, G_data, G_intra_r, G_intra_c, G_intra_d), by world size
GRIDS = {4: {"row-2": (1, 2, 2, 1, 1), "column-2": (1, 2, 1, 2, 1), "2x2x1": (1, 1, 2, 2, 1),
             "depth-2 x row-2": (1, 1, 2, 1, 2)},
         2: {"row-2": (1, 1, 2, 1, 1), "column-2": (1, 1, 1, 2, 1)}}
ROWS = [3, 1, 4, 2]  # every rank its own number of samples (the last batch of an epoch)


def _rows() -> list[int]:
    return ROWS[:dist.get_world_size()]


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(_rows()), IN, generator=gen) * 0.1
    grad_weights = torch.randn(sum(_rows()), OUT, generator=gen)  # d loss / d output, different per element
    return x, grad_weights


def _mine(t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return t[sum(ROWS[:rank]):sum(ROWS[:rank + 1])]


def _serial(bias: bool) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    serial = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        if bias:
            serial.bias.uniform_(-1, 1)  # not the compat layer's zeros, so loading it matters
    x, grad_weights = _global_batch()
    x = x.clone().requires_grad_()
    (serial(x) * grad_weights).sum().backward()
    return serial, serial(x).detach(), x.grad


def _layer_case(grid, bias: bool, transpose: bool) -> dict:
    ax.init(*grid)
    serial, ref_out, ref_x_grad = _serial(bias)
    layer = ax.Linear(IN, OUT, bias=bias, transpose=transpose)
    layer.load_state_dict(serial.state_dict())
    x_all, grad_weights = _global_batch()
    x = _mine(x_all).clone().requires_grad_()
    out = layer(x)
    (out * _mine(grad_weights)).sum().backward()
    ax.sync_gradients(layer)  # sums: the per-rank sums make the serial sum over the whole batch
    diffs = {"output": (out - _mine(ref_out)).abs().max().item(),
             "input grad": (x.grad - _mine(ref_x_grad)).abs().max().item(),
             "weight grad": (layer.full_weight(layer.weight.grad) - serial.weight.grad).abs().max().item()}
    if bias:
        diffs["bias grad"] = (layer.bias.grad - serial.bias.grad).abs().max().item()
    return diffs


def _same_samples_still_right(grid) -> float:
    """AxoNN's contract also takes the same samples on every rank (its regrouping is a superset)."""
    ax.init(*grid)
    serial, ref_out, _ = _serial(True)
    layer = ax.Linear(IN, OUT)
    layer.load_state_dict(serial.state_dict())
    return (layer(_global_batch()[0]) - ref_out).abs().max().item()


def _atorch_default_refuses(grid) -> str:
    """The per-rank batch fed to atorch's own default contract: the error, on every rank."""
    ax.init(*grid)
    layer = intra_layer.Linear(IN, OUT)
    try:
        layer(_mine(_global_batch()[0])[:1])
    except AtorchConfigError as error:
        return str(error)
    return "no error"


def _model_case(grid) -> dict:
    """AxoNN's auto_parallelize on an MLP with a LayerNorm between its layers; a mean loss per
    rank and sync_gradients(mean=True) give the serial model's gradients on the global batch."""
    ax.init(*grid)

    def mlp():
        return nn.Sequential(nn.Linear(IN, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, OUT))

    torch.manual_seed(0)
    serial = mlp()
    with ax.auto_parallelize():
        model = mlp()
    model.load_state_dict(serial.state_dict())
    x_all, target_all = _global_batch()
    rank, rows = dist.get_rank(), 2 * dist.get_world_size()
    x_all, target_all = x_all[:rows], target_all[:rows]  # 2 rows a rank: equal shares, so the mean of means is the mean
    nn.functional.mse_loss(serial(x_all), target_all).backward()
    nn.functional.mse_loss(model(x_all[2 * rank:2 * rank + 2]), target_all[2 * rank:2 * rank + 2]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    with ax.no_grad_sync():  # AxoNN's: sync_gradients does nothing inside
        ax.sync_gradients(model, mean=True)
    kept = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), local))
    ax.sync_gradients(model, mean=True)
    moved = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), local))
    diffs = {"no_grad_sync kept the local gradients": kept, "sync moved": moved}
    for (name, param), ref in zip(model.named_parameters(), serial.parameters()):
        module = model.get_submodule(name.rsplit(".", 1)[0])
        sharded = isinstance(module, intra_layer.Linear) and name.endswith("weight")
        grad = module.full_weight(param.grad) if sharded else param.grad
        diffs[name] = (grad - ref.grad).abs().max().item()
    return diffs


def _all(names) -> dict:
    out, grids = {}, GRIDS[dist.get_world_size()]
    for name, grid in ((n, grids[n]) for n in names):
        for bias in (True, False):
            for transpose in (False, True):
                out[(name, bias, transpose)] = _layer_case(grid, bias, transpose)
        out[(name, "same samples")] = _same_samples_still_right(grid)
        out[(name, "model")] = _model_case(grid)
    out["refused"] = _atorch_default_refuses(grids["row-2"])
    out["refused column"] = _atorch_default_refuses(grids["column-2"])
    return out


def test_axonn_default_linear_on_a_2x2_grid():
    """The default run's subset: row 2 x column 2 (both regroupings at once)."""
    _assert_matches(run_distributed(_all, 4, ["2x2x1"]))


@pytest.mark.slow
def test_axonn_default_linear_takes_each_ranks_own_samples_on_4_ranks():
    _assert_matches(run_distributed(_all, 4, list(GRIDS[4])))


def test_axonn_default_linear_on_2_ranks_row_2_and_column_2():
    _assert_matches(run_distributed(_all, 2, list(GRIDS[2])))


def _assert_matches(results: list) -> None:
    for rank, result in enumerate(results):
        for key, value in result.items():
            if key in ("refused", "refused column"):
                group = "row" if key == "refused" else "column"
                assert f"different inputs on the ranks of its {group} group" in value, (rank, value)
                assert "batch_per_rank=True" in value and "atorch.compat.axonn.Linear" in value
            elif isinstance(value, dict):
                for what, diff in value.items():
                    if what == "sync moved":  # control: the sync after no_grad_sync changed the gradients
                        assert diff > 1e-4, (rank, key, diff)
                    else:
                        assert diff <= 1e-5, (rank, key, what, diff)
            else:
                assert value <= 1e-5, (rank, key, value)


def test_contract_arguments():
    ax.init(1, 1)
    assert ax.Linear(4, 6).batch_per_rank and not ax.Linear(4, 6).expert_mode
    assert ax.Linear(4, 6, expert_mode=True).expert_mode and not ax.Linear(4, 6, expert_mode=True).batch_per_rank
    assert ax.Linear(4, 6, use_easy_api=False).expert_mode and ax.Linear(4, 6, use_easy_api=True).batch_per_rank
    assert torch.equal(ax.Linear(4, 6).bias, torch.zeros(6))  # AxoNN starts the bias at zero
    layer = ax.Linear(4, 6, init_method=lambda w: nn.init.constant_(w, 0.5))
    assert torch.equal(layer.weight, torch.full((6, 4), 0.5))
    with pytest.raises(AtorchConfigError, match="contradict"):
        ax.Linear(4, 6, expert_mode=True, use_easy_api=True)
    with pytest.raises(AtorchConfigError, match="positionally"):
        ax.Linear(4, 6, False)
    with pytest.raises(AtorchConfigError, match="pass one of the two"):
        intra_layer.Linear(4, 6, expert_mode=True, batch_per_rank=True)
    with pytest.raises(AtorchConfigError, match="mixes"):
        intra_layer.sync_gradients(nn.Sequential(intra_layer.Linear(4, 4), intra_layer.Linear(4, 4, batch_per_rank=True)))
