"""auto_accelerate's arguments, checked before anything runs.

Each error names the argument, the value given and the fix; torch's own messages would name a
per-rank value (a batch of 0 after the split) or come from deep inside a dry run, where the
search would only record them in its report.
"""

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
