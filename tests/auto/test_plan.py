"""Rules as data: what plan_strategy drops, adds, rescales and refuses."""

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.config_types import MethodConfig
from atorch.auto.environment import DeviceContext
from atorch.auto.plan import plan_strategy
from atorch.auto.registry import MethodSpec, Stage, register_method, unregister_method
from atorch.errors import StrategyConflictError, UnknownMethodError, WorldSizeError


def device_ctx(world_size=1, device="cpu"):
    return DeviceContext(world_size, world_size, torch.device(device), None, 2**30)


def test_half_overrides_amp_native():
    strategy, notes = plan_strategy(Strategy(["amp_native", "half"]), device_ctx())
    assert strategy.opt_names == ["half"]
    assert any("amp_native: dropped because half" in note for note in notes)


def test_distributed_only_methods_dropped_on_one_process():
    strategy, notes = plan_strategy(Strategy(["parallel_mode", "amp_native"]), device_ctx(1))
    assert strategy.opt_names == ["amp_native"]
    assert any("parallel_mode: dropped" in note and "one" in note for note in notes)


def test_parallel_mode_added_when_distributed():
    strategy, notes = plan_strategy(Strategy(["amp_native"]), device_ctx(4))
    assert strategy.opt_names == ["parallel_mode", "amp_native"]
    assert strategy.get("parallel_mode").dims == [("data", 4)]
    assert any("parallel_mode: added" in note for note in notes)


def test_data_dim_rescaled_to_world():
    strategy, notes = plan_strategy(Strategy([("parallel_mode", ([("data", 8)], None))]), device_ctx(2))
    assert strategy.get("parallel_mode").dims == [("data", 2)]
    assert any("rescaled to 2" in note for note in notes)


def test_zero_dim_kept_and_data_fills_the_rest():
    strategy, _ = plan_strategy(Strategy([("parallel_mode", ([("zero", 2)], None))]), device_ctx(4))
    assert strategy.get("parallel_mode").dims == [("zero", 2), ("data", 2)]


def test_dims_that_cannot_fit_raise():
    with pytest.raises(WorldSizeError, match="multiple of 3"):
        plan_strategy(Strategy([("parallel_mode", ([("zero", 3), ("data", 1)], None))]), device_ctx(4))
    with pytest.raises(WorldSizeError, match="unknown parallel dim 'dta'"):
        plan_strategy(Strategy([("parallel_mode", ([("dta", 2)], None))]), device_ctx(2))
    with pytest.raises(WorldSizeError, match="permutation"):
        plan_strategy(Strategy([("parallel_mode", ([("data", 2)], [0, 0]))]), device_ctx(2))


def test_dim_no_method_uses_is_refused():
    with pytest.raises(StrategyConflictError, match="'tensor' dim of size 2"):
        plan_strategy(Strategy([("parallel_mode", ([("tensor", 2), ("data", 1)], None))]), device_ctx(2))


def test_excluded_and_included():
    strategy, notes = plan_strategy(Strategy(["amp_native", "checkpoint"]), device_ctx(), excluded=["checkpoint"],
                                    included=["native_dynamo"])
    assert strategy.opt_names == ["amp_native", "native_dynamo"]
    assert len(notes) == 2
    with pytest.raises(UnknownMethodError):
        plan_strategy(Strategy(), device_ctx(), excluded=["nope"])
    with pytest.raises(StrategyConflictError, match="both excluded and included"):
        plan_strategy(Strategy(), device_ctx(), excluded=["half"], included=["half"])


class _Cfg(MethodConfig):
    pass


@pytest.fixture
def fake_methods():
    specs = [
        MethodSpec("_needs_gpu", _Cfg, {}, "test", unsupported=lambda d, c: None if d.device_type == "cuda" else "it needs a GPU"),
        MethodSpec("_clashes", _Cfg, {Stage.REWRITE: lambda ctx, c: None}, "test", conflicts=("half",)),
        MethodSpec("_needs_half", _Cfg, {}, "test", requires=("half",)),
    ]
    for spec in specs:
        register_method(spec)
    yield
    for spec in specs:
        unregister_method(spec.name)


def test_device_unsupported_dropped(fake_methods):
    strategy, notes = plan_strategy(Strategy(["_needs_gpu"]), device_ctx())
    assert strategy.opt_names == []
    assert notes == ["_needs_gpu: dropped because it needs a GPU"]


def test_conflicts_and_requirements(fake_methods):
    with pytest.raises(StrategyConflictError, match="cannot be used together"):
        plan_strategy(Strategy(["_clashes", "half"]), device_ctx())
    with pytest.raises(StrategyConflictError, match="needs"):
        plan_strategy(Strategy(["_needs_half"]), device_ctx())


def test_duplicate_registration_is_an_error(fake_methods):
    with pytest.raises(ValueError, match="already registered"):
        register_method(MethodSpec("_clashes", _Cfg, {}, "again"))


def test_zero_methods_need_more_than_one_data_parallel_rank(fake_methods):
    register_method(MethodSpec("_uses_tensor", _Cfg, {}, "test", uses_dims=("tensor",)))
    try:
        for name in ("zero1", "fsdp"):  # one at a time: together they conflict at any world size
            requested = Strategy([("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "_uses_tensor", name])
            strategy, notes = plan_strategy(requested, device_ctx(2))
            assert strategy.opt_names == ["parallel_mode", "_uses_tensor"]
            assert any(f"{name}: dropped because it shards over data-parallel ranks" in n for n in notes)
    finally:
        unregister_method("_uses_tensor")


def test_sharding_methods_conflict_with_each_other():
    for pair in (["zero1", "zero2"], ["zero2", "fsdp"], ["zero1", "fsdp"]):
        with pytest.raises(StrategyConflictError):
            plan_strategy(Strategy(["parallel_mode", *pair]), device_ctx(2))


def test_a_conflict_is_refused_even_where_both_methods_would_be_dropped():
    # On one process zero2 and fsdp are both dropped (they need data-parallel ranks); before,
    # the pair passed there and failed only when the job was scaled out.
    with pytest.raises(StrategyConflictError, match="'fsdp' and 'zero2' cannot be used together"):
        plan_strategy(Strategy(["zero2", "fsdp"]), device_ctx(1))
    assert plan_strategy(Strategy(["zero2"]), device_ctx(1))[0].opt_names == []


BACKENDS = [("deepspeed", ("zero1", {"use_ds_zero": True})), ("fairscale", ("zero2", {"not_use_fsdp": True}))]


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "missing"])
@pytest.mark.parametrize("package, method", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_optional_backends_are_kept_when_installed_and_dropped_with_the_install_hint_when_not(
        package, method, installed, monkeypatch):
    """Both branches run whatever this machine has: find_spec is made to answer either way."""
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == package or name.startswith(package + "."):
            return real_find_spec("json") if installed else None  # any spec stands for "installed"
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    strategy, notes = plan_strategy(Strategy(["parallel_mode", method]), device_ctx(2))
    if installed:
        assert strategy.opt_names == ["parallel_mode", method[0]]
        assert not any(f"atorch[{package}]" in n for n in notes), notes
    else:
        assert strategy.opt_names == ["parallel_mode"]
        assert any(f"{method[0]}: dropped" in n and f"atorch[{package}]" in n for n in notes), notes