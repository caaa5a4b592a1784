"""intra_layer.Linear against a serial nn.Linear holding the same full weight."""

import pytest
import torch
import torch.distributed as dist

from atorch import intra_layer
from atorch.errors import AtorchConfigError, WorldSizeError
from tests.helpers.dist import run_distributed

GRIDS = [(2, 2, 1), (2, 1, 2), (1, 2, 2), (4, 1, 1)]
VARIANTS = [dict(bias=b, transpose=t, skip_bias_add=s) for b in (True, False) for t in (False, True)
            for s in (False, True) if b or not s]
IN, OUT, BATCH = 8, 12, 4  # OUT divides by every (output group x depth) above; BATCH by depth


def _case(topology, bias, transpose, skip_bias_add) -> dict:
    """Max abs differences from the serial layer: output, input grad, weight grad, bias grad."""
    torch.manual_seed(1)
    serial = torch.nn.Linear(IN, OUT, bias=bias)
    full_x = torch.randn(BATCH * topology.size("depth"), IN)
    # ordinary activations: the batch split over depth, whole features on every rank
    depth = topology.coordinate("depth")
    x = full_x.chunk(topology.size("depth"))[depth].clone().requires_grad_()
    layer = intra_layer.Linear(IN, OUT, bias=bias, transpose=transpose, skip_bias_add=skip_bias_add,
                               topology=topology)
    layer.load_state_dict(serial.state_dict())
    out = layer(x)
    if skip_bias_add:
        out, returned_bias = out
        assert (returned_bias is None) == (not bias)
        if bias:
            out = out + returned_bias
    # A loss whose gradient differs per output element, summed over the global batch.
    weights = torch.arange(OUT * full_x.shape[0], dtype=torch.float32).reshape(full_x.shape[0], OUT) / 100
    (out * weights.chunk(topology.size("depth"))[depth]).sum().backward()

    ref_x = full_x.clone().requires_grad_()
    ref_out = serial(ref_x)
    (ref_out * weights).sum().backward()
    diffs = {
        "out": (out - ref_out.chunk(topology.size("depth"))[depth]).abs().max().item(),
        "x_grad": (x.grad - ref_x.grad.chunk(topology.size("depth"))[depth]).abs().max().item(),
        # the reduce-scatter over depth already summed the depth ranks' samples
        "w_grad": (layer.full_weight(layer.weight.grad) - serial.weight.grad).abs().max().item(),
        "w": (layer.full_weight() - serial.weight).abs().max().item(),
        "shard_numel": layer.weight.numel(),
    }
    # the layer's own (shard-shaped) state dict loads into a layer of the same grid
    twin = intra_layer.Linear(IN, OUT, bias=bias, transpose=transpose, topology=topology)
    twin.load_state_dict(layer.state_dict())
    diffs["reloaded"] = (twin.full_weight() - serial.weight).abs().max().item()
    if bias:
        grad = layer.bias.grad.clone()
        dist.all_reduce(grad, group=topology.group("depth"))  # bias is replicated: sum the depth shares
        diffs["b_grad"] = (grad - serial.bias.grad).abs().max().item()
    return diffs


def _all_grids() -> list:
    from benchmarks.intra_layer_comm import measure

    # the benchmark's counted bytes equal its formulas (toy sizes; benchmarks/intra_layer_comm.py)
    comm = [(r["algorithm"], r["grid"], r["block"], r["payload_bytes"], r["expected_bytes"])
            for r in measure(sizes=[(8, 16, 8)], grids=GRIDS)]
    results = []
    for r, c, d in GRIDS:
        topology = intra_layer.init(G_intra_r=r, G_intra_c=c, G_intra_d=d)
        groups = {name: dist.get_process_group_ranks(topology.group(name)) for name in ("row", "col", "depth")}
        for variant in VARIANTS:
            results.append(((r, c, d), variant, groups, topology.data_parallel_size, _case(topology, **variant)))
    return results, comm


def test_every_grid_and_variant_matches_serial_linear_on_4_ranks():
    per_rank = run_distributed(_all_grids, 4)
    comm = per_rank[0][1]
    assert len(comm) == 2 * (2 + len(GRIDS))  # Linear and MLP; 1D tensor 4, 1D tensor 2 x data 2, the grids
    for algorithm, grid, block, counted, formula in comm:
        assert counted == formula > 0, (algorithm, grid, block, counted, formula)
    per_rank = [results for results, _ in per_rank]
    for rank, results in enumerate(per_rank):
        for grid, variant, groups, dp_size, diffs in results:
            r, c, d = grid
            assert dp_size == d, (grid, dp_size)  # depth ranks split the batch
            # row innermost, then column, then depth
            assert groups["row"] == [rank // r * r + i for i in range(r)], (grid, groups)
            row, col, depth = rank % r, rank // r % c, rank // (r * c)
            assert groups["col"] == [row + r * (j + c * depth) for j in range(c)], (grid, groups)
            assert groups["depth"] == [row + r * (col + c * k) for k in range(d)], (grid, groups)
            assert diffs["shard_numel"] == IN * OUT // 4, (grid, diffs)
            for key in ("out", "x_grad", "w_grad", "w", "b_grad", "reloaded"):
                if key in diffs:
                    assert diffs[key] <= 1e-5, (rank, grid, variant, key, diffs[key])
    assert len(per_rank[0]) == len(GRIDS) * len(VARIANTS) == 24


def test_single_process_is_nn_linear_and_loads_either_state_dict():
    intra_layer.init()
    torch.manual_seed(0)
    serial = torch.nn.Linear(6, 3)
    torch.manual_seed(0)
    layer = intra_layer.Linear(6, 3)  # the same initialization as nn.Linear
    x = torch.randn(2, 6)
    torch.testing.assert_close(layer(x), serial(x), rtol=0, atol=0)
    other = intra_layer.Linear(6, 3)
    other.load_state_dict(layer.state_dict())  # its own (shard-shaped) state dict
    torch.testing.assert_close(other(x), serial(x), rtol=0, atol=0)
    out, bias = intra_layer.Linear(6, 3, skip_bias_add=True)(x)
    assert out.shape == (2, 3) and bias.shape == (3,)


def test_unknown_keyword_arguments_are_errors():
    intra_layer.init()
    with pytest.raises(AtorchConfigError, match=r"unknown keyword arguments \['expert_mode'\]"):
        intra_layer.Linear(4, 4, expert_mode=True)


def test_world_size_product_mismatch():
    with pytest.raises(WorldSizeError, match="= 4 processes, but the world size is 1"):
        intra_layer.init(G_intra_r=2, G_intra_d=2)
    with pytest.raises(WorldSizeError, match="integer >= 1"):
        intra_layer.init(G_data=0)
