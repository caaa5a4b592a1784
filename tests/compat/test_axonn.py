"""AxoNN code shapes with the import changed (``from atorch.compat import axonn as ax``): ax.init's
positional order, comm_handle's groups, and the training flow (create_dataloader,
register_model_and_optimizer, register_loss_fn, run_batch) against a serial run."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atorch import intra_layer
from atorch.compat import axonn as ax
from atorch.errors import AtorchConfigError, NotSupportedError
from tests.helpers.dist import run_distributed

GLOBAL_BATCH, MICRO_BATCH, STEPS, LR = 16, 2, 4, 0.5
# AxoNN's positional order: (G_inter, G_data, G_intra_r, G_intra_c, G_intra_d), on 4 ranks
GRIDS = [(1, 2, 2), (1, 1, 1, 2, 2)]


def mlp() -> nn.Module:
    # 16 -> 3 does not divide a grid of 2: it stays an nn.Linear
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def dataset():
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(128, 8, generator=gen), torch.randint(0, 3, (128,), generator=gen))


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


def _flow(grid, mixed_precision: bool, axonn_layers: bool = False) -> dict:
    """The AxoNN guide's training flow; global losses and the full weights after STEPS steps.
    ``axonn_layers``: ax.auto_parallelize (AxoNN's per-rank batch contract) in place of atorch's."""
    ax.init(*grid, mixed_precision=mixed_precision)
    torch.manual_seed(123)
    with (ax.auto_parallelize() if axonn_layers else intra_layer.auto_parallelize()):
        model = mlp()
    torch.manual_seed(0)
    model.load_state_dict(mlp().state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = ax.register_model_and_optimizer(model, optimizer)
    ax.register_loss_fn(nn.CrossEntropyLoss())
    loader = ax.create_dataloader(dataset(), GLOBAL_BATCH, MICRO_BATCH)
    losses = []
    for _, (x, y) in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss = torch.tensor(ax.run_batch(x, y))
        optimizer.step()
        dist.all_reduce(loss)  # the row x column ranks hold the same samples: the world mean is the global one
        losses.append(loss.item() / dist.get_world_size())
    weights = {}
    for name, param in model.state_dict().items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        full = module.full_weight() if isinstance(module, intra_layer.Linear) and name.endswith("weight") else param
        weights[name] = full.float()
    dtypes = ({p.dtype for p in model.parameters()}, {p.dtype for g in optimizer.param_groups for p in g["params"]})
    return {"losses": losses, "weights": weights, "dtypes": dtypes, "per_rank": loader.batch_size,
            "micro": loader.num_micro_batches}


def _handles() -> dict:
    out = {}
    ax.init(1, 2, 2)  # G_inter=1, G_data=2, G_intra_r=2
    h = ax.comm_handle
    groups = ("inner_intra_layer_parallel_group", "outer_intra_layer_parallel_group",
              "depth_intra_layer_parallel_group", "intra_layer_group", "data_parallel_group")
    out["groups"] = {name: dist.get_process_group_ranks(getattr(h, name)) for name in groups}
    out["sizes"] = (h.G_inter, h.G_data, h.G_intra_r, h.G_intra_c, h.G_intra_d, h.G_intra)
    out["ranks"] = (h.world_rank, h.data_parallel_rank, h.intra_layer_row_parallel_rank,
                    h.intra_layer_column_parallel_rank, h.intra_layer_depth_parallel_rank)
    out["layer_groups"] = [dist.get_process_group_ranks(g) for g in h.get_intra_layer_groups()]
    ax.init(1, 4)
    out["data_4"] = (ax.comm_handle.G_data, ax.comm_handle.topology.data_parallel_size)
    out["intra_layer_init"] = intra_layer.init(1, 4).data_parallel_size  # AxoNN's order here too
    return out


def _all() -> dict:
    flows = {(grid, mixed): _flow(grid, mixed) for grid in GRIDS for mixed in (False, True)}
    # AxoNN's layers fed by ax.create_dataloader (the same samples on a row group): still the serial numbers
    flows[(GRIDS[0], False, "axonn layers")] = _flow(GRIDS[0], False, axonn_layers=True)
    return {"handles": _handles(), "flows": flows}


def test_axonn_code_shapes_on_4_ranks():
    ref_losses, ref_weights = _serial()
    for rank, result in enumerate(run_distributed(_all, 4)):
        handles = result["handles"]
        # atorch numbers ranks row fastest: rows [0, 1], [2, 3]; data [0, 2], [1, 3]
        assert handles["sizes"] == (1, 2, 2, 1, 1, 2)
        assert handles["groups"]["outer_intra_layer_parallel_group"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert handles["groups"]["intra_layer_group"] == handles["groups"]["outer_intra_layer_parallel_group"]
        assert handles["groups"]["inner_intra_layer_parallel_group"] == [rank]
        assert handles["groups"]["depth_intra_layer_parallel_group"] == [rank]
        assert handles["groups"]["data_parallel_group"] == [rank % 2, rank % 2 + 2]
        assert handles["ranks"] == (rank, rank // 2, rank % 2, 0, 0)
        assert handles["layer_groups"] == [[rank], handles["groups"]["outer_intra_layer_parallel_group"], [rank]]
        assert handles["data_4"] == (4, 4) and handles["intra_layer_init"] == 4
        for (grid, mixed, *_), flow in result["flows"].items():
            assert (flow["per_rank"], flow["micro"]) == (GLOBAL_BATCH // 2, GLOBAL_BATCH // 2 // MICRO_BATCH)
            if mixed:
                assert flow["dtypes"] == ({torch.float16}, {torch.float32}), (grid, flow["dtypes"])
                tolerance = 1e-3  # fp16 compute: measured 1.7e-4 (losses) and 2.8e-4 (weights) off fp32
            else:
                assert flow["dtypes"] == ({torch.float32}, {torch.float32})
                tolerance = 1e-5
            for got, want in zip(flow["losses"], ref_losses):
                assert abs(got - want) <= tolerance * abs(want), (rank, grid, mixed, flow["losses"], ref_losses)
            for name, want in ref_weights.items():
                diff = (flow["weights"][name] - want).abs().max().item()
                assert diff <= tolerance * max(1.0, want.abs().max().item()), (rank, grid, mixed, name, diff)


def test_what_is_not_ported_says_so():
    with pytest.raises(NotSupportedError, match="MPI pipeline"):
        ax.init(2, 1)
    with pytest.raises(NotSupportedError, match="CPU offload"):
        ax.init(1, 1, cpu_offload=True)
    ax.init(1, 1)
    with pytest.raises(AtorchConfigError, match="register_model_and_optimizer"):
        ax.run_batch(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(NotSupportedError, match="tensor_parallel_dims"):
        ax.comm_handle.get_intra_layer_groups([0])
