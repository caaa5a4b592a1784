"""intra_layer.Linear against a serial nn.Linear holding the same full weight, under both contracts:
whole features in and out (the default), and AxoNN's sliced one (expert_mode: each rank passes its
slice of the input features and gets its slice of the output features)."""

import functools

import pytest
import torch
import torch.distributed as dist

from atorch import intra_layer
from atorch.errors import AtorchConfigError, WorldSizeError
from tests.helpers.dist import run_distributed

GRIDS = [(2, 2, 1), (2, 1, 2), (1, 2, 2), (4, 1, 1)]
SLICED_GRIDS = GRIDS + [(1, 4, 1)]
VARIANTS = [dict(bias=b, transpose=t, skip_bias_add=s) for b in (True, False) for t in (False, True)
            for s in (False, True) if b or not s]
# (whole input, whole output): expert_mode=True is (False, False); the mixed ones are forward keywords
CONTRACTS = [(True, True), (False, False), (True, False), (False, True)]
IN, OUT, BATCH = 8, 12, 4  # OUT divides by every (output group x depth) above; BATCH by depth


def _cut(t: torch.Tensor, topology, name: str) -> torch.Tensor:
    """This rank's slice of the last dim over the grid dim ``name`` (what AxoNN's _drop hands a rank)."""
    return t.chunk(topology.size(name), -1)[topology.coordinate(name)]


def _case(topology, bias, transpose, skip_bias_add, contract=(True, True)) -> dict:
    """Max abs differences from the serial layer: output, input grad, weight grad, bias grad."""
    whole_in, whole_out = contract
    in_dim, out_dim = ("row", "col") if transpose else ("col", "row")
    torch.manual_seed(1)
    serial = torch.nn.Linear(IN, OUT, bias=bias)
    full_x = torch.randn(BATCH * topology.size("depth"), IN)
    # the batch split over depth; whole features, or this rank's slice of them
    depth = topology.coordinate("depth")
    x = full_x.chunk(topology.size("depth"))[depth]
    x = (x if whole_in else _cut(x, topology, in_dim)).clone().requires_grad_()
    layer = intra_layer.Linear(IN, OUT, bias=bias, transpose=transpose, skip_bias_add=skip_bias_add,
                               expert_mode=contract == (False, False), topology=topology)
    assert (layer.local_in_features, layer.local_out_features) == (
        IN // topology.size(in_dim), OUT // topology.size(out_dim))
    layer.load_state_dict(serial.state_dict())
    out = layer(x) if contract in ((True, True), (False, False)) else layer(x, whole_in, whole_out)
    if skip_bias_add:
        out, returned_bias = out
        assert (returned_bias is None) == (not bias)
        if bias:
            out = out + returned_bias
    # A loss whose gradient differs per output element, summed over the global batch; under the
    # sliced output each rank gets the gradient of its slice.
    full_weights = torch.arange(OUT * full_x.shape[0], dtype=torch.float32).reshape(full_x.shape[0], OUT) / 100
    weights = full_weights.chunk(topology.size("depth"))[depth]
    (out * (weights if whole_out else _cut(weights, topology, out_dim))).sum().backward()

    ref_x = full_x.clone().requires_grad_()
    ref_out = serial(ref_x)
    (ref_out * full_weights).sum().backward()
    ref_out = ref_out.chunk(topology.size("depth"))[depth]
    ref_x_grad = ref_x.grad.chunk(topology.size("depth"))[depth]
    diffs = {
        "out": (out - (ref_out if whole_out else _cut(ref_out, topology, out_dim))).abs().max().item(),
        "x_grad": (x.grad - (ref_x_grad if whole_in else _cut(ref_x_grad, topology, in_dim))).abs().max().item(),
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


def _chain(topology) -> dict:
    """AxoNN's expert-mode MLP: drop the input once, chain two layers (the second transposed) on
    slices, gather the output once; against the serial MLP, output and input gradient."""
    torch.manual_seed(2)
    serial = torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.GELU(), torch.nn.Linear(OUT, IN))
    full_x = torch.randn(BATCH * topology.size("depth"), IN)
    x = full_x.chunk(topology.size("depth"))[topology.coordinate("depth")].clone().requires_grad_()
    first = intra_layer.Linear(IN, OUT, expert_mode=True, topology=topology)
    second = intra_layer.Linear(OUT, IN, transpose=True, expert_mode=True, topology=topology)
    first.load_state_dict(serial[0].state_dict())
    second.load_state_dict(serial[2].state_dict())
    hidden = first(intra_layer.drop(x, topology=topology))
    out = intra_layer.gather(second(torch.nn.functional.gelu(hidden)), topology=topology)
    out.sum().backward()
    ref_x = full_x.clone().requires_grad_()
    serial(ref_x).sum().backward()
    depth = topology.coordinate("depth")
    return {"out": (out - serial(full_x).chunk(topology.size("depth"))[depth]).abs().max().item(),
            "x_grad": (x.grad - ref_x.grad.chunk(topology.size("depth"))[depth]).abs().max().item(),
            "hidden_width": hidden.shape[-1]}


def _contract_errors(topology) -> list[str]:
    """The messages of the errors raised for an input of the wrong width, per contract."""
    messages = []
    whole = intra_layer.Linear(IN, OUT, topology=topology)
    sliced = intra_layer.Linear(IN, OUT, expert_mode=True, topology=topology)
    for layer, width in ((whole, IN // 2), (sliced, IN), (whole, 5), (sliced, 5)):
        with pytest.raises(AtorchConfigError) as error:
            layer(torch.randn(2, width))
        messages.append(str(error.value))
    return messages


def _sliced() -> list:
    results = []
    for r, c, d in SLICED_GRIDS:
        topology = intra_layer.init(G_intra_r=r, G_intra_c=c, G_intra_d=d)
        for contract in CONTRACTS[1:]:
            variants = VARIANTS if contract == (False, False) else VARIANTS[:3:2]  # mixed: bias, both transposes
            for variant in variants:
                results.append(((r, c, d), contract, variant, _case(topology, **variant, contract=contract)))
        results.append(((r, c, d), "chain", None, _chain(topology)))
    topology = intra_layer.init(G_intra_r=2, G_intra_c=2)
    return results, _contract_errors(topology)


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
    return results, comm, _sliced()


@functools.cache
def _four_ranks() -> list:
    """Both contracts' checks in one spawn of 4 gloo processes (spawning costs more than they do)."""
    return run_distributed(_all_grids, 4)


def test_every_grid_and_variant_matches_serial_linear_on_4_ranks():
    per_rank = _four_ranks()
    comm = per_rank[0][1]
    assert len(comm) == 2 * (2 + len(GRIDS))  # Linear and MLP; 1D tensor 4, 1D tensor 2 x data 2, the grids
    for algorithm, grid, block, counted, formula in comm:
        assert counted == formula > 0, (algorithm, grid, block, counted, formula)
    per_rank = [results for results, _, _ in per_rank]
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


def test_axonn_sliced_contract_matches_serial_linear_on_4_ranks():
    """expert_mode (sliced in, sliced out) and the mixed forward keywords: outputs, input gradients,
    weight and bias gradients equal the serial layer's slices, on every grid; two expert layers
    chain on slices (drop once, gather once)."""
    for rank, (_, _, (results, messages)) in enumerate(_four_ranks()):
        for grid, contract, variant, diffs in results:
            for key in ("out", "x_grad", "w_grad", "w", "b_grad", "reloaded"):
                if key in diffs:
                    assert diffs[key] <= 1e-5, (rank, grid, contract, variant, key, diffs[key])
            if contract == "chain":
                assert diffs["hidden_width"] == OUT // grid[0], (grid, diffs)  # the hidden stays sliced
        assert len(results) == len(SLICED_GRIDS) * (len(VARIANTS) + 2 * 2 + 1)
        assert "expects the whole input features (8)" in messages[0] and "which is this rank's slice" in messages[0]
        assert "expert_mode=True" in messages[0]
        assert "which is the whole input features (8)" in messages[1] and "intra_layer.drop" in messages[1]
        for message in messages[2:]:
            assert "last dim 5, which is neither the whole input features (8) nor this rank's slice (4)" in message


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
    with pytest.raises(AtorchConfigError, match=r"unknown keyword arguments \['tensor_parallel_dims'\]"):
        intra_layer.Linear(4, 4, tensor_parallel_dims=[0])


def test_world_size_product_mismatch():
    with pytest.raises(WorldSizeError, match="= 4 processes, but the world size is 1"):
        intra_layer.init(G_intra_r=2, G_intra_d=2)
    with pytest.raises(WorldSizeError, match="integer >= 1"):
        intra_layer.init(G_data=0)
