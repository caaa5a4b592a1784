"""Each tensor-parallel layer on 2 gloo processes against its serial twin (same seed)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _gather(t, dim):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _column(shape, gather_output, sequence_parallel):
    from atorch import parallel_state
    from atorch.parallel_layers import ColumnParallelLinear, scatter_to_sequence

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 8, gather_output=gather_output, sequence_parallel_enabled=sequence_parallel)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    inp = scatter_to_sequence(x, group) if sequence_parallel else x
    out = layer(inp)
    full_out = out if gather_output else _gather(out, -1)
    full_out.pow(2).sum().backward() if gather_output else out.pow(2).sum().backward()
    return {"out": full_out.detach(), "x_grad": x.grad, "w": _gather(layer.weight.detach(), 0),
            "w_grad": _gather(layer.weight.grad, 0), "b_grad": _gather(layer.bias.grad, 0)}


def _serial_linear(shape, in_f, out_f):
    torch.manual_seed(0)
    layer = nn.Linear(in_f, out_f)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(x)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "w": layer.weight.detach(), "w_grad": layer.weight.grad,
            "b_grad": layer.bias.grad}


@pytest.mark.parametrize("shape", [(2, 4, 16), (6, 16)], ids=["batch-seq-hidden", "tokens-hidden"])
@pytest.mark.parametrize("gather_output, sequence_parallel", [(True, False), (False, False), (True, True)])
def test_column_parallel_linear(shape, gather_output, sequence_parallel):
    results = run_distributed(_column, 2, shape, gather_output, sequence_parallel)
    serial = _serial_linear(shape, 16, 8)
    got = results[0]
    torch.testing.assert_close(got["w"], serial["w"])
    torch.testing.assert_close(got["out"], serial["out"], **TOL)
    x_grad = got["x_grad"]
    if sequence_parallel:  # each rank's x.grad covers its own sequence chunk
        x_grad = torch.cat([r["x_grad"].chunk(2, dim=-2)[i] for i, r in enumerate(results)], dim=-2)
    torch.testing.assert_close(x_grad, serial["x_grad"], **TOL)
    torch.testing.assert_close(got["w_grad"], serial["w_grad"], **TOL)
    torch.testing.assert_close(got["b_grad"], serial["b_grad"], **TOL)


def _row(shape, input_is_parallel):
    from atorch import parallel_state
    from atorch.parallel_layers import RowParallelLinear, scatter_to_region

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    layer = RowParallelLinear(16, 8, input_is_parallel=input_is_parallel)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(scatter_to_region(x, group) if input_is_parallel else x)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "w": _gather(layer.weight.detach(), 1),
            "w_grad": _gather(layer.weight.grad, 1), "b_grad": layer.bias.grad}


@pytest.mark.parametrize("shape", [(2, 4, 16), (6, 16)], ids=["batch-seq-hidden", "tokens-hidden"])
@pytest.mark.parametrize("input_is_parallel", [False, True])
def test_row_parallel_linear(shape, input_is_parallel):
    results = run_distributed(_row, 2, shape, input_is_parallel)
    serial = _serial_linear(shape, 16, 8)
    for got in results:
        torch.testing.assert_close(got["w"], serial["w"])
        for key in ("out", "x_grad", "w_grad", "b_grad"):
            torch.testing.assert_close(got[key], serial[key], **TOL)


def _embedding(across):
    from atorch import parallel_state
    from atorch.parallel_layers import ParallelEmbedding

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    layer = ParallelEmbedding(10, 8, shard_across_embedding=across)
    ids = torch.tensor([[0, 3, 9, 5], [7, 7, 1, 4]])
    out = layer(ids)
    out.pow(2).sum().backward()
    dim = 1 if across else 0
    return {"out": out.detach(), "w": _gather(layer.weight.detach(), dim), "w_grad": _gather(layer.weight.grad, dim)}


@pytest.mark.parametrize("across", [False, True], ids=["vocab-rows", "hidden-columns"])
def test_parallel_embedding(across):
    results = run_distributed(_embedding, 2, across)
    torch.manual_seed(0)
    weight = torch.empty(10, 8)
    nn.init.normal_(weight)  # the same draw ParallelEmbedding makes for the full table
    serial = nn.Embedding.from_pretrained(weight, freeze=False)
    ids = torch.tensor([[0, 3, 9, 5], [7, 7, 1, 4]])
    out = serial(ids)
    out.pow(2).sum().backward()
    for got in results:
        torch.testing.assert_close(got["w"], serial.weight.detach())
        torch.testing.assert_close(got["out"], out.detach(), **TOL)
        torch.testing.assert_close(got["w_grad"], serial.weight.grad, **TOL)


def _cross_entropy(smoothing):
    import torch.distributed as dist

    from atorch import parallel_state
    from atorch.parallel_layers import parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    full = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([[0, 11, 5, 6, -100], [3, 3, 8, 1, 10]])
    local = full.chunk(2, dim=-1)[dist.get_rank()].clone().requires_grad_(True)
    loss = parallel_cross_entropy(local, labels, label_smoothing=smoothing)
    (loss * torch.arange(10.0).reshape(2, 5)).sum().backward()
    return {"loss": loss.detach(), "grad": _gather(local.grad, -1)}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_parallel_cross_entropy_matches_full(smoothing):
    results = run_distributed(_cross_entropy, 2, smoothing)
    full = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    labels = torch.tensor([[0, 11, 5, 6, -100], [3, 3, 8, 1, 10]])
    loss = F.cross_entropy(full.reshape(-1, 12), labels.reshape(-1), reduction="none",
                           label_smoothing=smoothing).reshape(2, 5)
    (loss * torch.arange(10.0).reshape(2, 5)).sum().backward()
    for got in results:
        torch.testing.assert_close(got["loss"], loss.detach(), **TOL)
        torch.testing.assert_close(got["grad"], full.grad, **TOL)


def test_sizes_that_do_not_divide_are_refused():
    results = run_distributed(_bad_size, 2)
    assert all("pad it to a multiple of 2" in r for r in results)


def _bad_size():
    from atorch import parallel_state
    from atorch.parallel_layers import ColumnParallelLinear

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        ColumnParallelLinear(4, 7)
    except ValueError as error:
        return str(error)
    return "no error"
