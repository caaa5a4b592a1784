"""auto_accelerate's arguments, checked before anything runs.

Each error names the argument, the value given and the fix; torch's own messages would name a
per-rank value (a batch of 0 after the split) or come from deep inside a dry run, where the
search would only record them in its report.
"""

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from atorch.errors import AtorchConfigError


def check_job(model: torch.nn.Module, dataset: Any, dataloader_args: dict | None, optim_func: Any) -> None:
    """Refuse a job that cannot train: no parameters to optimize, an empty dataset, a bad batch size."""
    if optim_func is not None and not any(True for _ in model.parameters()):
        raise AtorchConfigError(
            f"model {type(model).__name__} has no parameters, so optim_func has nothing to optimize; pass the "
            "model that holds the weights (or leave optim_func=None to only wrap the model)")
    if dataset is not None and hasattr(dataset, "__len__") and not isinstance(dataset, torch.utils.data.IterableDataset):
        if len(dataset) == 0:
            raise AtorchConfigError(f"dataset {type(dataset).__name__} is empty (len 0): there is nothing to train on; "
                                    "check the path or the filter that built it")
    if dataloader_args is not None and "batch_size" in dataloader_args:
        batch = dataloader_args["batch_size"]
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise AtorchConfigError(
                f"dataloader_args['batch_size'] must be a positive int (the global batch, split over the data-parallel "
                f"ranks), got {batch!r}")


def check_loss(loss: Any) -> torch.Tensor:
    """The loss a backward can start from: a scalar tensor (or a sequence whose first item is one)."""
    if not torch.is_tensor(loss):
        raise AtorchConfigError(f"loss_func must return a tensor (or a sequence whose first item is the loss), got "
                                f"{type(loss).__name__}")
    if loss.dim() != 0:
        raise AtorchConfigError(
            f"loss_func must return a scalar loss, got a tensor of shape {tuple(loss.shape)}; reduce it in loss_func "
            "(e.g. loss.mean())")
    return loss


def _fail(name: str, value: Any, accepted: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise AtorchConfigError(f"{name}={shown} ({type(value).__name__}): {accepted}")


def _callable(name: str, value: Any, accepted: str) -> None:
    if value is not None and not callable(value):
        _fail(name, value, accepted)


def _mapping(name: str, value: Any, example: str) -> None:
    if value is not None and not isinstance(value, Mapping):
        _fail(name, value, f"pass a dict of keyword arguments or None, e.g. {example}")


def _number(name: str, value: Any, *, integer: bool, minimum: float, inclusive: bool, fix: str,
            optional: bool = False) -> None:
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        _fail(name, value, f"{'an int' if integer else 'a number'} is needed; {fix}")
    if value < minimum or (value == minimum and not inclusive):
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        _fail(name, value, f"must be {bound}; {fix}")


def _output_file(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)).strip():
        _fail(name, value, "pass a file path (str or pathlib.Path) or None")
    path = Path(value)
    if path.is_dir():
        _fail(name, value, "is a directory; name a file in it")
    folder = path.parent
    if not folder.is_dir():
        _fail(name, value, f"its folder {str(folder)!r} does not exist; create it first (every rank checks it)")


def _memory_budget(value: Any) -> None:
    if value is None:
        return
    from atorch.utils.sizes import parse_bytes

    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        _fail("memory_budget", value, "pass bytes (an int) or a size such as '70GiB' or '512MB'")
    try:
        size = parse_bytes(value)
    except (ValueError, OverflowError):
        size = None
    if size is None or size <= 0:
        _fail("memory_budget", value, "a positive size is needed: bytes (an int) or e.g. '70GiB', '512MB'; leave "
              "it out to use each device's memory")


def _names(name: str, value: Any) -> None:
    if value is None:
        return
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not all(isinstance(item, str) for item in items):
        _fail(name, value, "pass a list of method names (e.g. ['fsdp', 'checkpoint']) or None")


def check_arguments(model: Any, optim_func: Any, dataset: Any, loss_func: Any, prepare_input: Any,
                    optim_args: Any, optim_param_func: Any, dataloader_args: Any, distributed_sampler_cls: Any,
                    excluded: Any, included: Any, lr_scheduler_cls: Any, lr_scheduler_args: Any,
                    finetune_strategy: Any, save_strategy_to_file: Any, kwargs: dict) -> None:
    """Every argument of ``auto_accelerate`` checked before anything is built: one
    :class:`AtorchConfigError` naming the argument, the value given and what is accepted.

    Example::

        check_arguments(model, "adam", ...)  # AtorchConfigError: optim_func='adam' (str): pass an optimizer class ...
    """
    _callable("optim_func", optim_func, "pass an optimizer class or function called as optim_func(params, "
              "**optim_args), e.g. torch.optim.AdamW, not its name")
    _callable("loss_func", loss_func, "pass a function loss_func(batch, output) that returns the loss tensor, e.g. "
              "lambda batch, out: torch.nn.functional.mse_loss(out, batch[1]), not its name")
    _callable("prepare_input", prepare_input, "pass a function prepare_input(batch, device) that returns the batch "
              "on the device, or None to move its tensors to this rank's device")
    _callable("optim_param_func", optim_param_func, "pass a function optim_param_func(model) that returns the "
              "parameters or parameter groups, or None for model.parameters()")
    _callable("lr_scheduler_cls", lr_scheduler_cls, "pass a scheduler class called as lr_scheduler_cls(optim, "
              "**lr_scheduler_args), e.g. torch.optim.lr_scheduler.StepLR, or None")
    if distributed_sampler_cls is not None and not (isinstance(distributed_sampler_cls, type)
                                                    and hasattr(distributed_sampler_cls, "__iter__")):
        _fail("distributed_sampler_cls", distributed_sampler_cls, "pass a sampler class, called as cls(dataset, "
              "num_replicas=, rank=, shuffle=, seed=, drop_last=) (e.g. "
              "torch.utils.data.distributed.DistributedSampler), or None for atorch's")
    _mapping("optim_args", optim_args, "{'lr': 1e-3}")
    _mapping("lr_scheduler_args", lr_scheduler_args, "{'step_size': 10}")
    _mapping("dataloader_args", dataloader_args, "{'batch_size': 32, 'shuffle': True}")
    _optimizer_accepts(optim_func, optim_args)
    _dataloader_keys(dataloader_args)
    if dataset is not None and (isinstance(dataset, (str, bytes)) or not isinstance(dataset, torch.utils.data.Dataset) and not (
            hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) and not hasattr(dataset, "__iter__")):
        _fail("dataset", dataset, "pass a torch.utils.data.Dataset (or anything with __getitem__ and __len__, or an "
              "iterable of batches' samples), or None to wrap the model only")
    if lr_scheduler_args and lr_scheduler_cls is None:
        _fail("lr_scheduler_args", lr_scheduler_args, "is given without lr_scheduler_cls; pass the scheduler class too")
    _names("excluded", excluded)
    _names("included", included)
    for name, value in (("finetune_strategy", finetune_strategy),
                        *((key, kwargs[key]) for key in _FLAGS if key in kwargs)):
        if not isinstance(value, bool):
            _fail(name, value, "pass True or False")
    _output_file("save_strategy_to_file", save_strategy_to_file)
    _output_file("report_file", kwargs.get("report_file"))
    cache_dir = kwargs.get("search_cache_dir")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        _fail("search_cache_dir", cache_dir, "pass a folder path (str or pathlib.Path) or None for ~/.cache/atorch/search")
    if "sampler_seed" in kwargs:
        _number("sampler_seed", kwargs["sampler_seed"], integer=True, minimum=0, inclusive=True,
                fix="the shuffling seed, e.g. 0 (the default)")
    _memory_budget(kwargs.get("memory_budget"))
    if "loss_normalization" in kwargs and kwargs["loss_normalization"] not in ("tokens", "per_part_mean"):
        _fail("loss_normalization", kwargs["loss_normalization"], "'tokens' weighs each part of a split batch by what "
              "its loss counts (the default), 'per_part_mean' each part as one (docs/loss_normalization.md)")
    for name, integer, minimum, inclusive, fix in _LIMITS:
        if name in kwargs:
            _number(name, kwargs[name], integer=integer, minimum=minimum, inclusive=inclusive, fix=fix,
                    optional=name == "time_limit")
    check_job(model, dataset, dataloader_args, optim_func)


def _optimizer_accepts(optim_func: Any, optim_args: Any) -> None:
    """A torch optimizer class built once on a one-element parameter with ``optim_args``: a wrong
    key or value (``{"lr": "fast"}``) is named here, not raised from deep inside the strategy."""
    if not optim_args or not (isinstance(optim_func, type) and issubclass(optim_func, torch.optim.Optimizer)):
        return
    # options that depend on the device the parameters end up on are left to the real build
    portable = {k: v for k, v in optim_args.items() if k not in ("fused", "capturable", "foreach")}
    try:
        optim_func([torch.zeros(1, requires_grad=True)], **portable)
    except (TypeError, ValueError) as error:
        _fail("optim_args", dict(optim_args), f"{optim_func.__name__} does not take them: {error}; fix the key or "
              "the value (a number for lr, betas a pair of numbers...)")
    except Exception:  # noqa: BLE001 - anything else is the real build's to report, on its device
        return


# What atorch's dataloader takes besides DataLoader's own arguments (atorch/data/loader.py).
_ATORCH_LOADER_KEYS = {"batch_size", "shuffle", "drop_last"}


def _dataloader_keys(dataloader_args: Any) -> None:
    """Every key of ``dataloader_args`` is one DataLoader (or atorch's loader) takes."""
    import inspect

    if not dataloader_args:
        return
    known = set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters) - {"self", "dataset"}
    known |= _ATORCH_LOADER_KEYS
    unknown = sorted(set(dataloader_args) - known)
    if unknown:
        _fail("dataloader_args", dict(dataloader_args), f"{unknown} {'is' if len(unknown) == 1 else 'are'} not an "
              f"argument of torch.utils.data.DataLoader; known: {sorted(known)}")


# Boolean keyword arguments of auto_accelerate.
_FLAGS = ("verbose", "find_unused_parameters", "ignore_dryrun_on_load_strategy", "use_search_cache", "search_only")
# The search's limits: (name, integer, minimum, minimum allowed, what to write instead).
_LIMITS = (
    ("time_limit", False, 0, False, "seconds the search may take, or None for no limit"),
    ("max_dryruns", True, 1, True, "how many candidates to dry-run, at least 1 (default 8)"),
    ("dryrun_steps", True, 1, True, "timed steps per dry run, at least 1 (default 3)"),
    ("dryrun_warmup_steps", True, 0, True, "untimed steps before them, 0 or more"),
    ("planned_steps", True, 1, True, "optimizer steps the job will train, at least 1 (default 1000)"),
    ("dryrun_timeout", False, 0, False, "seconds a dry run may take before it counts as hung (default 300)"),
)
