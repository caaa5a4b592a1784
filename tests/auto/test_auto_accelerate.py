import json

import pytest
import torch

import atorch
from atorch.auto import AutoAccelerateResult, Strategy, auto_accelerate, run_model
from atorch.errors import NotSupportedError, StrategyFileError, WorldSizeError
from tests.conftest import messages
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss, train_losses


def test_public_names():
    assert atorch.auto_accelerate is atorch.auto.auto_accelerate
    for name in ("init_distributed", "rank", "world_size", "local_rank", "device"):
        assert callable(getattr(atorch, name))


def test_only_a_model():
    status, result, strategy = auto_accelerate(TinyTransformer(), load_strategy=[])
    assert status is True and isinstance(result, AutoAccelerateResult)
    assert result.optim is None and result.dataloader is None and result.loss_func is None
    assert result.lr_scheduler is None
    assert result.args == {"use_optim_backward": False, "requires_set_gradient_accumulation_boundary": False}
    assert strategy == Strategy()


def test_full_result_with_param_groups_and_scheduler(tmp_path):
    def param_groups(model):
        assert isinstance(model, TinyTransformer)
        decay = [p for n, p in model.named_parameters() if p.ndim > 1]
        rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    path = tmp_path / "applied.json"
    _, result, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, model_input_format="unpack_dict",
        optim_args={"lr": 1e-3}, optim_param_func=param_groups, dataloader_args={"batch_size": 4},
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": 0.5},
        load_strategy=[("amp_native", "bf16")], save_strategy_to_file=str(path), verbose=True,
    )
    assert [g["weight_decay"] for g in result.optim.param_groups] == [0.1, 0.0]
    batch = result.prepare_input(next(iter(result.dataloader)), atorch.device())
    loss = result.loss_func(batch, run_model(result.model, batch, "unpack_dict"))
    loss.backward()
    result.optim.step()
    result.lr_scheduler.step()
    assert result.optim.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert Strategy.load(path) == strategy
    assert json.loads(path.read_text())["methods"][0]["name"] == "amp_native"


def test_run_model_formats():
    model = lambda *args, **kwargs: (args, kwargs)  # noqa: E731
    assert run_model(model, 1, None) == ((1,), {})
    assert run_model(model, (1, 2), "unpack_sequence") == ((1, 2), {})
    assert run_model(model, {"a": 1}, "unpack_dict") == ((), {"a": 1})
    with pytest.raises(ValueError, match="unpack_dict"):
        run_model(model, 1, "unpack")


def test_custom_prepare_input_is_used():
    seen = []
    _, result, _ = auto_accelerate(TinyTransformer(), prepare_input=lambda d, dev: seen.append(dev) or d, load_strategy=[])
    result.prepare_input({}, torch.device("cpu"))
    assert seen == [torch.device("cpu")]


def test_strategy_kinds_are_accepted(tmp_path):
    s = Strategy([("amp_native", "bf16")])
    path = tmp_path / "s.json"
    s.save(path)
    for value in (s, s.items(), ["amp_native"], s.to_json(), s.to_json().encode(), str(path), path):
        _, _, applied = auto_accelerate(TinyTransformer(), load_strategy=value)
        assert applied.opt_names == ["amp_native"]


def test_drops_are_logged_and_absent_from_the_result(atorch_logs):
    _, _, strategy = auto_accelerate(TinyTransformer(), load_strategy=["parallel_mode", "amp_native", "half"])
    assert strategy.opt_names == ["half"]
    text = messages(atorch_logs)
    assert "parallel_mode: dropped" in text and "amp_native: dropped because half" in text


def test_bad_input_is_refused_clearly(tmp_path):
    with pytest.raises(TypeError, match="unknown keyword arguments \\['verbos'\\]"):
        auto_accelerate(TinyTransformer(), load_strategy=[], verbos=True)
    with pytest.raises(StrategyFileError, match="missing.json"):
        auto_accelerate(TinyTransformer(), load_strategy=str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="nn.Module"):
        auto_accelerate("model", load_strategy=[])


def test_features_that_need_the_search_say_what_they_need():
    for kwargs in ({}, {"load_strategy": [], "finetune_strategy": True},
                   {"load_strategy": [], "ignore_dryrun_on_load_strategy": False}):
        with pytest.raises(NotSupportedError, match="optim_func.*dataset.*loss_func.*load_strategy"):
            auto_accelerate(TinyTransformer(), **kwargs)


def test_a_loaded_strategy_can_be_dry_run_first(tmp_path):
    from atorch.auto.search.report import SearchReport

    path = tmp_path / "r.json"
    status, result, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.SGD, TokenDataset(), lm_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 4}, model_input_format="unpack_dict", load_strategy=[("amp_native", "bf16")],
        ignore_dryrun_on_load_strategy=False, report_file=str(path), dryrun_steps=1,
    )
    assert status and strategy.opt_names == ["amp_native"]
    report = SearchReport.load(path)
    assert [c.status for c in report.candidates] == ["measured"]


def _indivisible_batch():
    with pytest.raises(WorldSizeError, match="global batch size 3"):
        train_losses(["parallel_mode"], batch_size=3)
    return "raised"


def test_global_batch_must_divide_over_ranks():
    assert run_distributed(_indivisible_batch, 2) == ["raised", "raised"]


def _no_strategy_on_two_ranks():
    return train_losses([], steps=5)


def test_two_ranks_without_parallel_mode_get_data_parallel():
    reference = train_losses([])
    results = run_distributed(_no_strategy_on_two_ranks, 2)
    assert Strategy.from_json(results[0]["strategy"]).opt_names == ["parallel_mode"]
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
