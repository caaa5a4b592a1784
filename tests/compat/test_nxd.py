"""NxD code shapes with the import prefix changed (``neuronx_distributed`` -> ``atorch.compat.nxd``):
parallel_state's getters (NxD's and Megatron's spellings) and a tensor x data parallel model of
NxD layers (positional dtype, init_method) trained against a serial model built with the same seed."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atorch.compat.nxd.parallel_layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    parallel_cross_entropy,
    parallel_state,
)
from atorch.errors import NotSupportedError
from tests.helpers.dist import run_distributed

VOCAB, DIM, HIDDEN, BATCH, SEQ, STEPS, LR = 16, 8, 16, 4, 3, 3, 0.5


def _data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(STEPS)]


class NxdModel(nn.Module):
    """As NxD users write it: dtype positionally (5th), an init_method on the first projection."""

    def __init__(self):
        super().__init__()
        self.embed = ParallelEmbedding(VOCAB, DIM)
        self.up = ColumnParallelLinear(DIM, HIDDEN, True, False, torch.float32, init_method=nn.init.xavier_normal_)
        self.down = RowParallelLinear(HIDDEN, DIM, True, True, torch.float32)
        self.head = ColumnParallelLinear(DIM, VOCAB, bias=True, gather_output=False)

    def forward(self, ids):
        return self.head(self.down(F.gelu(self.up(self.embed(ids)))))


def _serial() -> tuple[list, dict]:
    """The same model unsharded, in NxD's initialization order (init_method, then the bias)."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    up_w = torch.empty(HIDDEN, DIM)
    nn.init.xavier_normal_(up_w)
    up_b = torch.empty(HIDDEN).uniform_(-1 / math.sqrt(DIM), 1 / math.sqrt(DIM))
    down, head = nn.Linear(HIDDEN, DIM), nn.Linear(DIM, VOCAB)
    params = {"embed.weight": embed.weight, "up.weight": nn.Parameter(up_w), "up.bias": nn.Parameter(up_b),
              "down.weight": down.weight, "down.bias": down.bias, "head.weight": head.weight, "head.bias": head.bias}
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    losses = []
    for ids, labels in _data():
        optimizer.zero_grad()
        hidden = F.gelu(F.linear(embed(ids), params["up.weight"], params["up.bias"]))
        loss = F.cross_entropy(head(down(hidden)).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in params.items()}


def _full(model: nn.Module) -> dict:
    """Every parameter gathered over the tensor group (split ones on their partition dim)."""
    group, world = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            pieces = [torch.empty_like(param) for _ in range(world)]
            dist.all_gather(pieces, param.detach().contiguous(), group=group)
            out[name] = torch.cat(pieces, dim=param.partition_dim)
        else:
            out[name] = param.detach().clone()
    return out


def _getters() -> dict:
    ps = parallel_state
    return {"tp": (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_size(),
                   ps.get_tensor_model_parallel_rank()),
            "dp": (ps.get_data_parallel_world_size(), ps.get_data_parallel_size(), ps.get_data_parallel_rank()),
            "pp": (ps.get_pipeline_model_parallel_world_size(), ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
            "src": (ps.get_tensor_model_parallel_src_rank(), ps.get_data_parallel_src_rank())}


def _train() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {"getters": _getters()}
    torch.manual_seed(0)
    model = NxdModel()
    out["initial"] = _full(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    dp_group, share = parallel_state.get_data_parallel_group(), BATCH // dp
    losses = []
    for ids, labels in _data():
        ids, labels = ids[dp_rank * share:(dp_rank + 1) * share], labels[dp_rank * share:(dp_rank + 1) * share]
        optimizer.zero_grad()
        loss = parallel_cross_entropy(model(ids), labels).mean()
        loss.backward()
        for param in model.parameters():  # NxD users average gradients over the data group
            dist.all_reduce(param.grad, group=dp_group)
            param.grad.div_(dp)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_group)
        losses.append(global_loss.item() / dp)
    out["losses"], out["final"] = losses, _full(model)
    # Control: without init_method the first projection is nn.Linear's kaiming init, not xavier.
    torch.manual_seed(0)
    ParallelEmbedding(VOCAB, DIM)
    plain = ColumnParallelLinear(DIM, HIDDEN, True, False, torch.float32)
    out["plain_up"] = _full(nn.ModuleDict({"up": plain}))["up.weight"]
    out["float64"] = ColumnParallelLinear(DIM, HIDDEN, True, False, torch.float64).weight.dtype
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_nxd_model_on_tensor_x_data_ranks_matches_serial(world):
    ref_losses, ref_final = _serial()
    results = run_distributed(_train, world)
    dp = world // 2
    for rank, result in enumerate(results):
        # tensor groups [0, 1] (and [2, 3]); on 4 ranks data groups [0, 2], [1, 3]
        assert result["getters"] == {"tp": (2, 2, rank % 2), "dp": (dp, dp, rank // 2), "pp": (1, True, True),
                                     "src": (rank // 2 * 2, rank % 2)}, (rank, result["getters"])
        assert result["float64"] == torch.float64  # dtype taken positionally, as NxD orders it
        for got, want in zip(result["losses"], ref_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, result["losses"], ref_losses)
        for name, want in ref_final.items():
            diff = (result["final"][name] - want).abs().max().item()
            assert diff <= 1e-5 * max(1.0, want.abs().max().item()), (rank, name, diff)
        # the comparison is not vacuous: training moved the weights, and init_method mattered
        moved = (result["initial"]["up.weight"] - result["final"]["up.weight"]).abs().max().item()
        assert moved > 1e-3, moved
        assert (result["plain_up"] - result["initial"]["up.weight"]).abs().max().item() > 1e-2


def test_nxd_initial_weights_equal_the_one_rank_layer():
    """tp=1 (no process group): the layer holds the serial weights exactly."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(DIM, HIDDEN, init_method=nn.init.xavier_normal_, use_cpu_initialization=True)
    torch.manual_seed(0)
    want = torch.empty(HIDDEN, DIM)
    nn.init.xavier_normal_(want)
    assert torch.equal(layer.weight, want)
    assert layer.bias.shape == (HIDDEN,) and layer.bias.abs().max() <= 1 / math.sqrt(DIM)


def test_what_nxd_has_and_atorch_refuses_says_so():
    with pytest.raises(NotSupportedError, match="pad_model"):
        ColumnParallelLinear(DIM, HIDDEN, pad=True)
    with pytest.raises(NotSupportedError, match="XLA"):
        RowParallelLinear(DIM, HIDDEN, device="xla")
    with pytest.raises(NotSupportedError, match="max_norm"):
        ParallelEmbedding(VOCAB, DIM, max_norm=1.0)
    with pytest.raises(NotSupportedError, match="expert parallelism"):
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    with pytest.raises(NotSupportedError, match="lnc_size"):
        parallel_state.initialize_model_parallel(1, lnc_size=2)


def _embedding_2023() -> dict:
    """NxD's 2023 test_parallel_embedding, with the import prefix changed and cuda -> cpu."""
    from torch.nn import init

    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(world)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(123)
    ids = torch.LongTensor(size=(5, 7)).random_(0, 48)
    loss_weight = torch.randn(5, 7, 16)
    torch.manual_seed(1234)
    table = ParallelEmbedding(48, 16, init_method=init.normal_, use_cpu_initialization=True)
    loss = torch.mul(table(ids), loss_weight).sum()
    loss.backward()
    torch.manual_seed(1234)
    positional = ParallelEmbedding(48, 16, init.normal_, params_dtype=torch.float64)  # init_method third
    out = {"loss": loss.item(), "grad": table.weight.grad.clone(), "tp": world, "rank": tp_rank,
           "positional": (positional.weight.dtype, positional.weight.double() - table.weight.double())}
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_nxd_2023_parallel_embedding_signature_matches_nn_embedding(world):
    """Before: TypeError on use_cpu_initialization (only today's signature was accepted)."""
    torch.manual_seed(123)
    ids = torch.LongTensor(size=(5, 7)).random_(0, 48)
    loss_weight = torch.randn(5, 7, 16)
    torch.manual_seed(1234)
    serial = nn.Embedding(48, 16)
    loss = torch.mul(serial(ids), loss_weight).sum()
    loss.backward()
    for result in run_distributed(_embedding_2023, world):
        assert abs(result["loss"] - loss.item()) <= 1e-5 * abs(loss.item())
        want = serial.weight.grad.split(48 // world)[result["rank"]]
        assert (result["grad"] - want).abs().max().item() <= 1e-5
        dtype, diff = result["positional"]
        assert dtype == torch.float64 and diff.abs().max().item() < 1e-6  # the same draws, in float64


def test_nxd_embedding_generations_conflicts_are_refused():
    with pytest.raises(NotSupportedError, match="init_method twice"):
        ParallelEmbedding(VOCAB, DIM, nn.init.normal_, init_method=nn.init.xavier_normal_)
    with pytest.raises(NotSupportedError, match="two dtypes"):
        ParallelEmbedding(VOCAB, DIM, dtype=torch.float64, params_dtype=torch.bfloat16)
    assert ParallelEmbedding(VOCAB, DIM, 3).padding_idx == 3  # today's third positional: padding_idx


def _gathered_column() -> dict:
    """NxD's ColumnParallelLinear(gather_output=True) at tp=2: its output, the input's gradient,
    and its weight (and weight gradient) gathered whole."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(DIM, HIDDEN, gather_output=True)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = layer(x)
    (out * torch.linspace(-1, 1, HIDDEN)).square().sum().backward()  # every output feature weighs differently
    pieces = [torch.empty_like(layer.weight.grad) for _ in range(2)]
    dist.all_gather(pieces, layer.weight.grad, group=parallel_state.get_tensor_model_parallel_group())
    result = {"out": out.detach(), "x_grad": x.grad, "weight": _full(layer)["weight"], "bias": layer.bias.detach(),
              "weight_grad": torch.cat(pieces), "bias_grad": layer.bias.grad}
    parallel_state.destroy_model_parallel()
    return result


def test_nxd_column_gather_output_at_tp2_equals_a_serial_linear():
    """(Negative control: returning each rank's own slice repeated instead of gathering it, in
    atorch/compat/nxd/parallel_layers/layers.py, fails the output check.)"""
    for result in run_distributed(_gathered_column, 2):
        serial = nn.Linear(DIM, HIDDEN)
        with torch.no_grad():
            serial.weight.copy_(result["weight"])
            serial.bias.copy_(result["bias"])
        x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = serial(x)
        (out * torch.linspace(-1, 1, HIDDEN)).square().sum().backward()
        assert result["out"].shape == out.shape == (BATCH, SEQ, HIDDEN)
        for name, got, want in (("output", result["out"], out), ("input grad", result["x_grad"], x.grad),
                                ("weight grad", result["weight_grad"], serial.weight.grad),
                                ("bias grad", result["bias_grad"], serial.bias.grad)):
            diff = (got - want).abs().max().item()
            assert diff <= 1e-5 * max(1.0, want.abs().max().item()), (name, diff)
