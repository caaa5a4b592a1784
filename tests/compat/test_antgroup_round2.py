"""ATorch code shapes, round 2 (issue 39): the parallel-group getters after auto_accelerate's
parallel_mode, ATorch's ColumnParallelLinear contract (output split), the amp optimizer's
BF16GradScaler and unwrapped bf16 optimizer, is_coworker; on 2 gloo ranks against one process
(4 ranks: test_antgroup_4_ranks.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from atorch.compat import antgroup as atorch
from atorch.compat.antgroup import distributed as atd
from atorch.compat.antgroup.amp import BF16GradScaler
from atorch.compat.antgroup.layers import ColumnParallelLinear, RowParallelLinear
from atorch.errors import NotSupportedError
from tests.compat.test_antgroup import LR, Block, Net, Rows, _loss
from tests.helpers.dist import run_distributed


def _mlp():
    torch.manual_seed(0)
    return ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)


def _inputs():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _amp(config: dict):
    torch.manual_seed(0)
    status, result, strategy = atorch.auto_accelerate(
        Net(), torch.optim.SGD, Rows(), _loss, optim_args={"lr": LR}, dataloader_args={"batch_size": 8},
        model_input_format="unpack_dict",  # ATorch's Strategy object as load_strategy (item 4)
        load_strategy=atorch.Strategy([("parallel_mode", ([("data", dist.get_world_size())], None), False),
                                       ("amp_native", config, False)]))
    assert status
    return result, strategy


def _round2() -> dict:
    out, world = {}, dist.get_world_size()
    # item 5: the getters after auto_accelerate applied parallel_mode (no create_parallel_group)
    result, strategy = _amp({"dtype": torch.bfloat16, "skip_if_nonfinite": True})
    out["best"] = (strategy.opt_names(), strategy.get_parallel_mode())  # ATorch's calls on best_strategy
    out["getters"] = (atorch.parallel_instance_num(), atorch.parallel_instance_index(),
                      atorch.parallel_group_size("data"), atorch.parallel_rank("data"),
                      dist.get_process_group_ranks(atorch.parallel_group("data")),
                      atorch.parallel_group_size("model"), atd.parallel_config())
    # item 3: bf16 with skip_if_nonfinite: ATorch's BF16GradScaler, skipping agreed over the ranks
    optim, scaler = result.optim, result.optim.grad_scaler
    out["scaler"] = (type(scaler).__name__, scaler._init_scale, scaler._growth_factor, scaler._backoff_factor)
    before = [p.detach().clone() for p in result.model.parameters()]
    flags = []
    for step, batch in zip(range(2), result.dataloader):
        batch = result.prepare_input(batch, atorch.device())
        optim.zero_grad()
        scale = float("inf") if step == 0 and dist.get_rank() == 0 else 1.0  # inf on rank 0 only
        (result.loss_func(batch, result.model(**batch)) * scale).backward()
        optim.step()
        flags.append((optim.step_was_skipped, scaler.has_overflow()))
        if step == 0:
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, result.model.parameters()))
    out["flags"] = flags
    atd.destroy_parallel_group()
    # item 3: bf16 without skip_if_nonfinite: ATorch leaves the optimizer unwrapped; item 8: is_coworker
    plain = _amp({"dtype": torch.bfloat16})[0].optim
    out["unwrapped"] = (type(plain).__name__, hasattr(plain, "grad_scaler"), hasattr(plain, "step_was_skipped"),
                        atorch.is_coworker())
    atd.destroy_parallel_group()
    # item 8: ATorch's ColumnParallelLinear keeps its output split
    atorch.create_parallel_group(([("model", world)], None))
    up, down = _mlp()
    x = _inputs()
    hidden = up(x)
    y = down(F.gelu(hidden))
    y.square().sum().backward()
    out["mlp"] = {"hidden": hidden.detach(), "y": y.detach(), "up_grad": up.weight.grad, "down_grad": down.weight.grad,
                  "up_bias": up.bias.detach()}
    atd.destroy_parallel_group()
    # item 7: ATorch's FSDP1 count of wrapped blocks, written for FSDP2 (docs/migrating.md)
    _, fsdp, _ = atorch.auto_accelerate(
        Net(), torch.optim.SGD, Rows(), _loss, optim_args={"lr": LR}, dataloader_args={"batch_size": 8},
        model_input_format="unpack_dict", load_strategy=[("fsdp", {"atorch_wrap_cls": (Block,)}, False)])
    out["fsdp_units"] = (sum(isinstance(m, FSDPModule) and isinstance(m, Block) for m in fsdp.model.modules()),
                         sum(isinstance(m, FSDPModule) for m in fsdp.model.modules()))
    atd.destroy_parallel_group()
    # item 6: half bf16 with zero1: ATorch wraps its sharded optimizer, atorch's zero1 cannot be
    try:
        atorch.auto_accelerate(Net(), torch.optim.SGD, Rows(), _loss, optim_args={"lr": LR},
                               dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                               load_strategy=[("half", "bf16"), "zero1"])
    except NotSupportedError as error:
        out["zero1"] = str(error)
    atd.destroy_parallel_group()
    return out


def test_atorch_round2_on_2_ranks_matches_one_process():
    check_round2(run_distributed(_round2, 2))


def check_round2(results: list) -> None:
    """Each rank's _round2 against the whole layers in one process."""
    up, down = _mlp()  # no groups: the whole layers, under the same seed
    x = _inputs()
    hidden = up(x)
    y = down(F.gelu(hidden))
    y.square().sum().backward()
    world = len(results)
    for rank, result in enumerate(results):
        assert result["getters"] == (1, 0, world, rank, list(range(world)), None, ([("data", world)], None)), result
        assert result["best"] == (["parallel_mode", "amp_native"], (True, ([("data", world)], None))), result["best"]
        assert result["scaler"] == ("BF16GradScaler", 1.0, 1.0, 1.0)
        assert result["unchanged"] and result["flags"] == [(True, True), (False, False)], result["flags"]
        assert result["unwrapped"] == ("SGD", False, False, False), result["unwrapped"]
        width = 16 // world
        mlp, part = result["mlp"], slice(rank * width, (rank + 1) * width)
        assert mlp["hidden"].shape == (4, width)  # split output, as in ATorch (atorch's default gathers: 16)
        assert (mlp["hidden"] - hidden[:, part]).abs().max().item() <= 1e-5
        assert (mlp["y"] - y).abs().max().item() <= 1e-5 * y.abs().max().item()
        assert (mlp["up_grad"] - up.weight.grad[part]).abs().max().item() <= 1e-5 * up.weight.grad.abs().max().item()
        assert (mlp["down_grad"] - down.weight.grad[:, part]).abs().max().item() <= 1e-5 * down.weight.grad.abs().max()
        assert torch.equal(mlp["up_bias"], torch.zeros(width))  # ATorch starts biases at zero
        assert "master weights" in result.get("zero1", ""), result.get("zero1")
        assert result["fsdp_units"] == (2, 3)  # the two blocks, and the root


def test_bf16_without_skip_if_nonfinite_leaves_the_optimizer_unwrapped():
    """ATorch's amp_test: no grad_scaler, no step_was_skipped (before: the compat view had both)."""
    status, result, _ = atorch.auto_accelerate(
        Net(), torch.optim.SGD, Rows(), _loss, optim_args={"lr": LR}, dataloader_args={"batch_size": 8},
        model_input_format="unpack_dict", load_strategy=[("amp_native", {"dtype": torch.bfloat16}, False)])
    assert status and type(result.optim) is torch.optim.SGD
    assert not hasattr(result.optim, "grad_scaler") and not hasattr(result.optim, "step_was_skipped")


def test_bf16_grad_scaler_skips_a_nonfinite_step_of_a_plain_optimizer():
    param = torch.nn.Parameter(torch.ones(2))
    optim, scaler = torch.optim.SGD([param], lr=1.0), BF16GradScaler()
    assert scaler.scale(torch.tensor(3.0)).item() == 3.0 and scaler.get_scale() == 1.0
    param.grad = torch.tensor([float("inf"), 1.0])
    scaler.step(optim)
    assert scaler.has_overflow() and torch.equal(param.detach(), torch.ones(2))
    param.grad = torch.tensor([1.0, 1.0])
    scaler.step(optim)
    assert not scaler.has_overflow() and torch.equal(param.detach(), torch.zeros(2))


def test_is_coworker_and_what_atorch_layers_refuse():
    from atorch.distributed.distributed import is_coworker

    assert is_coworker() is False and atorch.is_coworker() is False  # before: AttributeError
    with pytest.raises(NotSupportedError, match="defer_init"):
        ColumnParallelLinear(4, 4, defer_init=True)
    with pytest.raises(NotSupportedError, match="ranks"):
        RowParallelLinear(4, 4, ranks=[0, 1])
    linear = torch.nn.Linear(4, 6)
    layer = ColumnParallelLinear(orig_module=linear)  # one rank: the whole nn.Linear
    assert torch.equal(layer.weight, linear.weight) and torch.equal(layer.bias, linear.bias)


def _half_bf16_serial(master_weights: bool) -> list:
    """("half", "bf16") by hand: the model and inputs in bf16, SGD on fp32 masters (ATorch's
    BF16Optimizer) or on the bf16 parameters themselves."""
    torch.manual_seed(0)
    model, data = Net().to(torch.bfloat16), Rows()
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    for step in range(3):
        batch = data[step * 8:(step + 1) * 8]
        loss = _loss(batch, model(batch["x"].to(torch.bfloat16)))
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for param, master, grad in zip(params, masters, grads):
                if master_weights:
                    master -= LR * grad.float()
                    param.copy_(master)
                else:
                    param -= LR * grad
    return [p.detach().clone() for p in params]


def test_half_bf16_keeps_fp32_master_weights_as_atorch_does():
    """Before: plain SGD over the bf16 parameters, while ATorch wraps it in a BF16Optimizer."""
    torch.manual_seed(0)
    status, result, _ = atorch.auto_accelerate(
        Net(), torch.optim.SGD, Rows(), _loss, optim_args={"lr": LR}, dataloader_args={"batch_size": 8, "shuffle": False},
        model_input_format="unpack_dict", load_strategy=[("half", "bf16", False)])
    optim = result.optim
    assert status and type(optim).__name__ == "BF16Optimizer"
    assert {p.dtype for p in optim.master_params} == {torch.float32}
    for _, batch in zip(range(3), result.dataloader):
        batch = result.prepare_input(batch, atorch.device())
        optim.zero_grad()
        result.loss_func(batch, result.model(**batch)).backward()
        optim.step()
    got = [p.detach() for p in result.model.parameters()]
    want, plain = _half_bf16_serial(True), _half_bf16_serial(False)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # control: without master weights the bf16 weights come out different
    assert max((w.float() - p.float()).abs().max().item() for w, p in zip(want, plain)) > 0


def test_atorch_load_save_strategy_round_trips(tmp_path):
    """ATorch's test_load_save_strategy with `from atorch.compat.antgroup import Strategy, ...`
    (before: atorch's Strategy refused (name, config, tunable) items, and a pickle of it was refused)."""
    import pickle

    from tests.compat.test_antgroup import atorch_pickle

    strategy = atorch.Strategy([("parallel_mode", ([("data", 2)], None), False), ("amp_native", None, False)])
    filename = str(tmp_path / "strategy.st")
    atorch.save_strategy(strategy, filename)
    assert open(filename).read().lstrip().startswith("{")  # JSON, never a pickle
    status, loaded = atorch.get_strategy(filename)
    assert status and loaded == strategy
    status, loaded = atorch.get_strategy(pickle.dumps(strategy))  # read by the restricted unpickler
    assert status and loaded == strategy
    assert atorch.get_strategy("_bad_filename.st") == (False, None)
    assert len(strategy.convert_strategy_to_easydl_format()) == 2
    # bytes in ATorch's own format (a pickled atorch.auto.strategy.Strategy) load equal too
    assert atorch.get_strategy(atorch_pickle(strategy.opt_list)) == (True, strategy.to_atorch())
    assert strategy != atorch.Strategy([("parallel_mode", ([("data", 2)], None), False)])  # control
    assert strategy.opt_names() == ["parallel_mode", "amp_native"] and not strategy.is_tunable()


def test_atorch_strategy_methods_on_atorchs_own_strategy():
    """ATorch code calls strategy.opt_names() and get_parallel_mode() on what get_strategy and
    auto_accelerate return, atorch's Strategy (before: 'list' object is not callable, no
    get_parallel_mode); atorch's own reads of opt_names as a list still hold."""
    from atorch.auto.strategy import Strategy

    items = [("parallel_mode", ([("model", 2), ("data", 4)], [7, 6, 5, 4, 3, 2, 1, 0]), False),
             ("amp_native", None, False)]
    status, loaded = atorch.get_strategy(items)
    assert status and isinstance(loaded, Strategy)
    assert loaded.opt_names() == loaded.opt_names == ["parallel_mode", "amp_native"]
    assert type(loaded.opt_names()) is list and "amp_native" in loaded.opt_names
    found, p_mode = loaded.get_parallel_mode()  # ATorch's adjust_strategy reads it this way
    assert found and p_mode == ([("model", 2), ("data", 4)], [7, 6, 5, 4, 3, 2, 1, 0])  # ATorch's dim names
    assert dict(p_mode[0])["data"] == 4 and Strategy([("parallel_mode", p_mode)]) == Strategy([items[0]])
    assert Strategy(["parallel_mode"]).get_parallel_mode() == (True, None)  # ATorch: ("parallel_mode", None, _)
    assert Strategy(["amp_native"]).get_parallel_mode() == (False, None)
    # ATorch's own record keeps the config as given
    assert atorch.Strategy(items).get_parallel_mode() == (True, items[0][1])
    assert atorch.Strategy(items[1:]).get_parallel_mode() == (False, None)
