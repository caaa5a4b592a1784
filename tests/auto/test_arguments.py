"""Every bad argument of auto_accelerate is one AtorchConfigError naming the argument, the value and
the fix, raised before anything is built (issue 38: 23 of 69 gave raw errors, 12 were accepted).
The table in docs/reliability.md lists the same cases with their messages."""

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.errors import AtorchConfigError
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

CASES = {
    # argument=value: (overrides, what the message must say)
    "optim_func='adam'": ({"optim_func": "adam"}, r"optim_func='adam' \(str\): pass an optimizer class"),
    "dataset=5": ({"dataset": 5}, r"dataset=5 \(int\): pass a torch.utils.data.Dataset"),
    "dataset='data.txt'": ({"dataset": "data.txt"}, r"dataset='data.txt' \(str\)"),
    "loss_func='mse'": ({"loss_func": "mse"}, r"loss_func='mse' \(str\): pass a function loss_func\(batch, output\)"),
    "prepare_input=3": ({"prepare_input": 3}, r"prepare_input=3 \(int\): pass a function prepare_input\(batch, device\)"),
    "optim_param_func=1": ({"optim_param_func": 1}, r"optim_param_func=1 \(int\)"),
    "lr_scheduler_cls='x'": ({"lr_scheduler_cls": "x"}, r"lr_scheduler_cls='x' \(str\): pass a scheduler class"),
    "lr_scheduler_args without cls": ({"lr_scheduler_args": {"step_size": 2}}, "without lr_scheduler_cls"),
    "lr_scheduler_args=[1]": ({"lr_scheduler_cls": torch.optim.lr_scheduler.StepLR, "lr_scheduler_args": [1]},
                              r"lr_scheduler_args=\[1\] \(list\): pass a dict"),
    "optim_args=0.1": ({"optim_args": 0.1}, r"optim_args=0.1 \(float\): pass a dict of keyword arguments"),
    "dataloader_args=8": ({"dataloader_args": 8}, r"dataloader_args=8 \(int\): pass a dict"),
    "distributed_sampler_cls='x'": ({"distributed_sampler_cls": "x"}, r"distributed_sampler_cls='x' \(str\): pass a sampler class"),
    "distributed_sampler_cls=int": ({"distributed_sampler_cls": int}, r"distributed_sampler_cls=<class 'int'> "
                                    r"\(type\): pass a sampler class"),
    "optim_args={'lr': 'fast'}": ({"optim_args": {"lr": "fast"}}, r"optim_args=\{'lr': 'fast'\} \(dict\): SGD does not "
                                  r"take them"),
    "optim_args with a typo": ({"optim_args": {"lrr": 0.1}}, r"optim_args=\{'lrr': 0.1\} \(dict\): SGD does not take"),
    "dataloader_args with a typo": ({"dataloader_args": {"batch_size": 8, "shufle": True}},
                                    r"\['shufle'\] is not an argument of torch.utils.data.DataLoader; known: "),
    "loss_normalization='token'": ({"loss_normalization": "token"}, r"loss_normalization='token' \(str\): 'tokens' weighs"),
    "excluded='fsdp' list of ints": ({"excluded": [1]}, r"excluded=\[1\] \(list\): pass a list of method names"),
    "included=5": ({"included": 5}, r"included=5 \(int\)"),
    "finetune_strategy='yes'": ({"finetune_strategy": "yes"}, r"finetune_strategy='yes' \(str\): pass True or False"),
    "verbose='no'": ({"verbose": "no"}, r"verbose='no' \(str\): pass True or False"),
    "use_search_cache=0": ({"use_search_cache": 0}, r"use_search_cache=0 \(int\): pass True or False"),
    "sampler_seed='a'": ({"sampler_seed": "a"}, r"sampler_seed='a' \(str\): an int is needed"),
    "sampler_seed=-1": ({"sampler_seed": -1}, r"sampler_seed=-1 \(int\): must be >= 0"),
    "memory_budget='1e400GiB'": ({"memory_budget": "1e400GiB"}, r"memory_budget='1e400GiB' \(str\): a positive size"),
    "memory_budget=-1GiB": ({"memory_budget": "-1GiB"}, r"memory_budget='-1GiB' \(str\): a positive size"),
    "memory_budget=0": ({"memory_budget": 0}, r"memory_budget=0 \(int\): a positive size"),
    "memory_budget='lots'": ({"memory_budget": "lots"}, r"memory_budget='lots' \(str\): a positive size"),
    "max_dryruns=-1": ({"max_dryruns": -1}, r"max_dryruns=-1 \(int\): must be >= 1"),
    "max_dryruns=2.5": ({"max_dryruns": 2.5}, r"max_dryruns=2.5 \(float\): an int is needed"),
    "dryrun_timeout=-3": ({"dryrun_timeout": -3}, r"dryrun_timeout=-3 \(int\): must be > 0"),
    "dryrun_timeout=nan": ({"dryrun_timeout": float("nan")}, r"dryrun_timeout=nan \(float\): a number is needed"),
    "time_limit=-1": ({"time_limit": -1}, r"time_limit=-1 \(int\): must be > 0"),
    "dryrun_steps=0": ({"dryrun_steps": 0}, r"dryrun_steps=0 \(int\): must be >= 1"),
    "dryrun_warmup_steps=-2": ({"dryrun_warmup_steps": -2}, r"dryrun_warmup_steps=-2 \(int\): must be >= 0"),
    "save_strategy_to_file in a missing folder": ({"save_strategy_to_file": "/nonexistent-dir/s.json"},
                                                  r"its folder '/nonexistent-dir' does not exist; create it first"),
    "report_file in a missing folder": ({"report_file": "/nonexistent-dir/r.json"}, r"report_file=.*does not exist"),
    "save_strategy_to_file=a folder": ({"save_strategy_to_file": "/tmp"}, "is a directory; name a file in it"),
    "search_cache_dir=3": ({"search_cache_dir": 3}, r"search_cache_dir=3 \(int\): pass a folder path"),
    "model_input_format='bogus'": ({"model_input_format": "bogus"}, r"model_input_format 'bogus' is not one of"),
}


def _job(**overrides):
    job = {"model": TinyTransformer(), "optim_func": torch.optim.SGD, "dataset": TokenDataset(), "loss_func": lm_loss,
           "optim_args": {"lr": 0.1}, "dataloader_args": {"batch_size": 8}, "model_input_format": "unpack_dict"}
    job.update(overrides)
    return job


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("search", [False, True], ids=["load_strategy", "search"])
def test_a_bad_argument_is_refused_before_anything_is_built(name, search, monkeypatch):
    import atorch.auto.accelerate as accelerate

    def built(*args, **kwargs):
        raise AssertionError("the device was probed: the check came too late")

    monkeypatch.setattr(accelerate.DeviceContext, "detect", built)
    overrides, message = CASES[name]
    job = _job(**overrides)
    if not search:
        job["load_strategy"] = ["parallel_mode"]
    before = {k: v.clone() for k, v in job["model"].state_dict().items()}
    with pytest.raises(AtorchConfigError, match=message):
        auto_accelerate(**job)
    assert all(torch.equal(before[k], v) for k, v in job["model"].state_dict().items())


def test_good_arguments_still_pass(tmp_path):
    status, result, _ = auto_accelerate(**_job(
        load_strategy=[], sampler_seed=3, memory_budget="1GiB", max_dryruns=2, dryrun_timeout=30.5, time_limit=None,
        dryrun_steps=1, dryrun_warmup_steps=0, verbose=False, save_strategy_to_file=str(tmp_path / "s.json"),
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 2}, excluded=["fsdp"]))
    assert status and (tmp_path / "s.json").is_file()


def test_a_model_that_is_not_a_module_is_refused_before_anything_runs():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        auto_accelerate(5, torch.optim.SGD, load_strategy=[])
