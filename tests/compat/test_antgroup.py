"""The original ATorch's code shapes with the imports changed (``atorch.compat.antgroup``):
init_distributed and the parallel-group getters, semi-automatic lists with (name, config, tunable)
items and ATorch's FSDP1 keys, and an ATorch pickled strategy file read as plain data, trained on
4 gloo ranks against a serial run."""

import functools
import os
import pickle
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from atorch import parallel_state
from atorch.auto.strategy import Strategy
from atorch.compat import antgroup as atorch
from atorch.compat.antgroup import distributed as atd
from atorch.compat.antgroup.auto import _SampleBatchDataset
from atorch.errors import MethodConfigError, NotSupportedError, StrategyFileError
from tests.helpers.dist import run_distributed

GLOBAL_BATCH, STEPS, LR = 8, 3, 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(4, 8), nn.Sequential(Block(), Block()), nn.Linear(8, 3)

    def forward(self, x, y=None):
        return self.out(self.blocks(self.inp(x)))


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _loss(batch, out):
    return F.cross_entropy(out, batch["y"])


def _serial():
    torch.manual_seed(0)
    model, data = Net(), Rows()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = data[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        optim.zero_grad()
        loss = _loss(batch, model(batch["x"]))
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def atorch_pickle(opt_list, protocol: int = 4) -> bytes:
    """What ATorch's save_strategy writes: a pickled atorch.auto.strategy.Strategy (built here under a
    stand-in module of the same name length, renamed in the bytes)."""
    stand_in = "zzzzzz.zzzz.zzzzzzzz"  # len("atorch.auto.strategy")
    for name in ("zzzzzz", "zzzzzz.zzzz", stand_in):
        sys.modules.setdefault(name, types.ModuleType(name))
    cls = type("Strategy", (), {"__module__": stand_in})
    sys.modules[stand_in].Strategy = cls
    obj = cls.__new__(cls)
    obj.opt_list = opt_list
    return pickle.dumps(obj, protocol=protocol).replace(stand_in.encode(), b"atorch.auto.strategy")


def _groups() -> dict:
    out = {"init": atorch.init_distributed("gloo", set_cuda_device_using_local_rank=True)}
    atorch.create_parallel_group(([("model", 2), ("data", 2)], None))
    out["sizes"] = (atorch.parallel_group_size("model"), atorch.parallel_group_size("tensor"),
                    atorch.parallel_group_size("data"), atorch.parallel_group_size("pipe"))
    out["ranks"] = (atorch.parallel_rank("model"), atorch.parallel_rank("data"))
    out["model_group"] = dist.get_process_group_ranks(atorch.parallel_group("model"))
    out["data_group"] = dist.get_process_group_ranks(atorch.parallel_group("data"))
    out["and_ranks"] = atd.parallel_group_and_ranks("model")[1]
    out["instances"] = (atorch.parallel_instance_num(), atorch.parallel_instance_index())
    out["parallel_state_tp"] = parallel_state.get_tensor_model_parallel_size()
    atd.destroy_parallel_group()
    out["after"] = (atorch.parallel_group_size("model"), parallel_state.current_topology())
    return out


def _train(load_strategy, dataset=None, **kwargs) -> dict:
    torch.manual_seed(0)
    status, result, strategy = atorch.auto_accelerate(
        Net(), torch.optim.SGD, Rows() if dataset is None else dataset, _loss, optim_args={"lr": LR}, dataloader_args={"shuffle": False},
        batch_size=GLOBAL_BATCH, model_input_format="unpack_dict", load_strategy=load_strategy, **kwargs)
    model, optim, losses = result.model, result.optim, []
    for _, batch in zip(range(STEPS), result.dataloader):
        batch = result.prepare_input(batch, atorch.device())
        optim.zero_grad()
        loss = result.loss_func(batch, model(**batch))
        loss.backward()
        optim.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    weights = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        weights[name.removeprefix("module.")] = value.detach().clone()
    return {"status": status, "losses": losses, "weights": weights, "strategy": strategy.opt_names,
            "fsdp": strategy.get("fsdp"), "best": strategy, "optim": type(optim).__name__,
            "masters": getattr(optim, "master_params", None)}


def _all(pickled_path: str) -> dict:
    semi_auto = [("parallel_mode", ([("data", 4)], None), False),
                 ("fsdp", {"sync_module_states": True, "limit_all_gathers": True, "use_orig_params": True,
                           "auto_wrap_policy": functools.partial(transformer_auto_wrap_policy,
                                                                 transformer_layer_cls={Block})}, True)]
    return {"groups": _groups(), "semi_auto": _train(semi_auto), "pickled": _train(pickled_path)}


def test_atorch_code_shapes_on_4_ranks_match_serial(tmp_path):
    path = tmp_path / "strategy.pkl"  # what an ATorch user has on disk
    path.write_bytes(atorch_pickle([("parallel_mode", ([("data", 4)], None), False), ("zero1", None, False)]))
    ref_losses, ref_weights = _serial()
    for rank, result in enumerate(run_distributed(_all, 4, str(path))):
        groups = result["groups"]
        assert groups["init"] is True
        assert groups["sizes"] == (2, 2, 2, None) and groups["ranks"] == (rank % 2, rank // 2)
        assert groups["model_group"] == [rank // 2 * 2, rank // 2 * 2 + 1] == groups["and_ranks"]
        assert groups["data_group"] == [rank % 2, rank % 2 + 2]
        assert groups["instances"] == (1, 0) and groups["parallel_state_tp"] == 2
        assert groups["after"] == (None, None)
        for name in ("semi_auto", "pickled"):
            run = result[name]
            assert run["status"] is True
            for got, want in zip(run["losses"], ref_losses, strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (rank, name, run["losses"], ref_losses)
            for key, want in ref_weights.items():
                diff = (run["weights"][key] - want).abs().max().item()
                assert diff <= 1e-5 * max(1.0, want.abs().max().item()), (rank, name, key, diff)
        assert result["semi_auto"]["strategy"] == ["parallel_mode", "fsdp"]
        assert result["semi_auto"]["fsdp"].atorch_wrap_cls == [f"{Block.__module__}.Block"]  # from auto_wrap_policy
        assert result["pickled"]["strategy"] == ["parallel_mode", "zero1"]
    moved = max((_serial()[1][k] - Net().state_dict()[k]).abs().max().item() for k in ref_weights)
    assert moved > 1e-3  # control: training moved the weights, so equal weights mean equal training


def test_pickled_atorch_strategy_is_read_as_plain_data(tmp_path):
    items = [("parallel_mode", ([("model", 1), ("data", 1)], None), False),
             ("amp_native", {"dtype": torch.bfloat16}, False),
             ("fsdp", {"atorch_wrap_cls": (Block,), "use_orig_params": True}, True)]
    for protocol in (0, 2, 4):
        status, strategy = atorch.get_strategy(atorch_pickle(items, protocol))
        assert status, protocol
        assert strategy.opt_names == ["parallel_mode", "amp_native", "fsdp"]
        assert strategy.get("parallel_mode").dims == [("tensor", 1), ("data", 1)]  # ATorch's "model"
        assert strategy.get("amp_native").dtype == torch.bfloat16
        assert strategy.get("fsdp").atorch_wrap_cls == [f"{Block.__module__}.Block"]
    path = tmp_path / "strategy.pkl"
    path.write_bytes(atorch_pickle(items))
    assert atorch.get_strategy(str(path))[1] == strategy
    atorch.save_strategy(strategy, tmp_path / "strategy.json")  # JSON, never a pickle
    assert (tmp_path / "strategy.json").read_text().lstrip().startswith("{")
    assert atorch.get_strategy(str(tmp_path / "strategy.json")) == (True, strategy)


class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    target = str(tmp_path / "ran")
    for payload in (pickle.dumps(_Evil(target)), pickle.dumps([("fsdp", _Evil(target), False)], protocol=0),
                    atorch_pickle([("fsdp", {"x": _Evil(target)}, False)])):
        with pytest.raises(StrategyFileError, match="never runs code"):
            atorch.read_pickled_strategy(payload)
        assert atorch.get_strategy(payload) == (False, None)
    assert not os.path.exists(target)
    # control: the same payload through the standard unpickler does run code
    pickle.loads(pickle.dumps(_Evil(target)))
    assert os.path.exists(target)


def test_atorch_fsdp_keys_are_mapped_or_refused_with_the_reason():
    # before: every documented FSDP1 key was a bare unknown-field error
    with pytest.raises(MethodConfigError, match="unknown field 'limit_all_gathers'"):
        Strategy([("fsdp", {"limit_all_gathers": True})])
    status, strategy = atorch.get_strategy([("fsdp", {"limit_all_gathers": True, "use_orig_params": True,
                                                      "sync_module_states": False,
                                                      "sharding_strategy": "SHARD_GRAD_OP"}, None)])
    assert status and strategy.get("fsdp").sync_module_states is False
    assert strategy.get("fsdp").reshard_after_forward is False
    size_policy = {"auto_wrap_policy": functools.partial(
        torch.distributed.fsdp.wrap.size_based_auto_wrap_policy, min_num_params=1000)}
    assert atorch.get_strategy([("fsdp", size_policy)])[1].get("fsdp").atorch_size_based_min_num_params == 1000
    for config, reason in (({"limit_all_gathers": False}, "no unlimited mode"),
                           ({"use_orig_params": False}, "no flat parameters"),
                           ({"sharding_strategy": "NO_SHARD"}, "parallel_mode"),
                           ({"auto_wrap_policy": lambda *a, **k: True}, "atorch_wrap_cls")):
        with pytest.raises(NotSupportedError, match=reason):
            atorch.auto_accelerate(Net(), load_strategy=[("fsdp", config)])
    with pytest.raises(NotSupportedError, match="Ulysses"):
        atorch.auto_accelerate(Net(), load_strategy=[("sequence_parallel", {"sp_size": 2})])


def test_single_process_init_and_sample_batch():
    assert atorch.init_distributed("gloo") is True  # ATorch returns True in a plain process too
    assert atorch.parallel_group_size("data") is None
    sample = {"x": torch.randn(4, 4), "y": torch.randint(0, 3, (4,))}
    status, result, _ = atorch.auto_accelerate(
        Net(), torch.optim.SGD, None, _loss, optim_args={"lr": LR}, model_input_format="unpack_dict",
        load_strategy=["parallel_mode"], sample_batch=sample, batch_size=8, ignore_dryrun_on_load_strategy=False)
    assert status and result.dataloader is None  # the sample fed the dry run only, as in ATorch
    rows = _SampleBatchDataset(sample, 8)  # expand_sample_batch: the 4 rows cycled to the global batch
    assert len(rows) == 8 and torch.equal(rows[5]["x"], sample["x"][1])
    with pytest.raises(NotSupportedError, match="coworker"):
        atorch.init_distributed("gloo", coworker_num_per_node=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='gloo'"):
            atorch.init_distributed("nccl")
    atorch.reset_distributed()
    assert not dist.is_initialized()


def test_amp_optimizer_has_atorch_grad_scaler_and_step_was_skipped():
    for config, scaler_type in (({"dtype": torch.float16}, "GradScaler"),
                                ({"dtype": torch.bfloat16, "skip_if_nonfinite": True}, "BF16GradScaler")):
        torch.manual_seed(0)
        status, result, _ = atorch.auto_accelerate(
            Net(), torch.optim.SGD, Rows(), _loss, optim_args={"lr": LR}, dataloader_args={"batch_size": 8},
            model_input_format="unpack_dict", load_strategy=[("amp_native", config)])
        optim = result.optim
        assert status and type(optim.grad_scaler).__name__ == scaler_type
        assert not hasattr(optim._inner, "step_was_skipped")  # control: atorch's own optimizer lacks the name
        skipped = []
        for scale, batch in zip((float("inf"), 1.0, 1.0), result.dataloader):
            batch = result.prepare_input(batch, atorch.device())
            optim.zero_grad()
            (result.loss_func(batch, result.model(**batch)) * scale).backward()
            optim.step()
            skipped.append(optim.step_was_skipped)
        # an inf loss skips its step; under fp16 the first finite step may also skip while the scale falls
        assert skipped[0] is True and skipped[-1] is False, skipped
        assert optim.skipped_steps == sum(skipped)


def test_atorchs_module_path_imports_unchanged():
    import atorch.compat.antgroup.distributed as compat
    from atorch.distributed.distributed import create_parallel_group, init_distributed, parallel_rank

    assert (create_parallel_group, init_distributed, parallel_rank) == (
        compat.create_parallel_group, compat.init_distributed, compat.parallel_rank)
