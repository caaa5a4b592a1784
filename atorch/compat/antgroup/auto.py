"""ATorch's ``auto_accelerate`` on atorch: ``from atorch.compat.antgroup import auto_accelerate``.

The arguments are ATorch's; what ATorch took in ``**kwargs`` and atorch does not is handled here:

- ``load_strategy`` may hold ``(name, config, tunable)`` items, an ATorch pickled strategy file or
  bytes (read as plain data, see :mod:`atorch.compat.antgroup.strategy_io`), ATorch's dim names
  (``"model"``, ``"pipe"``) and ATorch's FSDP1 keys (``limit_all_gathers``, ``use_orig_params``,
  ``sharding_strategy``, ``auto_wrap_policy``), mapped to FSDP2 or refused with the reason.
- ``batch_size``: the global batch (ATorch: batch size per process x data-parallel size), the
  same as ``dataloader_args["batch_size"]``.
- ``sample_batch`` (with no dataset): one batch of inputs for the search's dry runs, repeated to
  ``batch_size`` rows when ``expand_sample_batch`` (default True); the result then has no
  dataloader, as in ATorch.
- ``save_strategy_to_file`` writes JSON (ATorch wrote a pickle).
- The amp optimizer (``amp_native``) is ATorch's: ``grad_scaler`` and ``step_was_skipped`` (a
  BF16GradScaler under bf16 with ``skip_if_nonfinite``), the unwrapped optimizer under bf16
  without it (:mod:`atorch.compat.antgroup.amp`).
- ``("half", "bf16")`` without fsdp/zero2/ds_3d_parallel: the optimizer is wrapped in a
  :class:`~atorch.compat.antgroup.bf16_optimizer.BF16Optimizer` (fp32 master weights), as in
  ATorch; with zero1 it is refused (ATorch wraps its sharded optimizer, atorch's cannot be).
"""

from typing import Any

import torch

from atorch.amp.optimizer import AmpOptimizer
from atorch.auto import auto_accelerate as _auto_accelerate
from atorch.compat.antgroup.amp import atorch_amp_optimizer
from atorch.compat.antgroup.bf16_optimizer import BF16Optimizer
from atorch.compat.antgroup.strategy_io import to_strategy
from atorch.errors import AtorchConfigError, NotSupportedError


class _SampleBatchDataset(torch.utils.data.Dataset):
    """The rows of a sample batch (tensors, or a tuple/list/dict of them), cycled to ``length``."""

    def __init__(self, batch: Any, length: int | None):
        self.batch = batch
        self.rows = _rows(batch)
        self.length = self.rows if length is None else int(length)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return _row(self.batch, index % self.rows)


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch
    sizes = {_rows(v) for v in values if isinstance(v, (torch.Tensor, dict, list, tuple))}
    if len(sizes) != 1:
        raise AtorchConfigError("sample_batch must hold tensors with the same first (batch) dimension")
    return sizes.pop()


def _row(batch: Any, index: int):
    if isinstance(batch, torch.Tensor):
        return batch[index]
    if isinstance(batch, dict):
        return {k: _row(v, index) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_row(v, index) for v in batch)
    return batch


def auto_accelerate(model, optim_func=None, dataset=None, loss_func=None, prepare_input=None, model_input_format=None,
                    optim_args=None, optim_param_func=None, dataloader_args=None, distributed_sampler_cls=None,
                    excluded=None, included=None, load_strategy=None, lr_scheduler_cls=None, lr_scheduler_args=None,
                    finetune_strategy=False, save_strategy_to_file=None, **kwargs):
    """ATorch's ``auto_accelerate``: returns ``(status, result, best_strategy)`` (see the module)."""
    sample_batch = kwargs.pop("sample_batch", None)
    batch_size = kwargs.pop("batch_size", None)
    expand = kwargs.pop("expand_sample_batch", True)
    dataloader_args = dict(dataloader_args or {})
    if batch_size is not None:
        if dataloader_args.get("batch_size", batch_size) != batch_size:
            raise AtorchConfigError(
                f"batch_size={batch_size} and dataloader_args['batch_size']={dataloader_args['batch_size']} differ; "
                "both are the global batch: give one")
        dataloader_args["batch_size"] = batch_size
    from_sample = dataset is None and sample_batch is not None
    if from_sample:
        dataset = _SampleBatchDataset(sample_batch, batch_size if expand else None)
        dataloader_args.setdefault("batch_size", len(dataset))
    if load_strategy is not None:
        load_strategy = to_strategy(load_strategy)
    status, result, strategy = _auto_accelerate(
        model, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args, optim_param_func,
        dataloader_args, distributed_sampler_cls, excluded, included, load_strategy, lr_scheduler_cls,
        lr_scheduler_args, finetune_strategy, save_strategy_to_file, **kwargs)
    if status and from_sample:
        result = result._replace(dataloader=None)  # the sample only fed the dry runs
    if status and isinstance(result.optim, AmpOptimizer):
        result = result._replace(optim=atorch_amp_optimizer(result.optim))
    if status and _bf16_master_weights(strategy, result.optim):
        result = result._replace(optim=BF16Optimizer(result.optim))
    return status, result, strategy


# methods under which ATorch does not wrap a half-bf16 optimizer (they keep their own precision)
_OWN_PRECISION = ("fsdp", "zero2", "ds_3d_parallel")


def _bf16_master_weights(strategy, optim) -> bool:
    """ATorch wraps the optimizer in a BF16Optimizer under ("half", "bf16") without fsdp/ZeRO."""
    half = strategy.get("half") if strategy is not None else None
    if half is None or half.dtype != torch.bfloat16 or optim is None:
        return False
    if any(name in strategy for name in _OWN_PRECISION):
        return False
    if "zero1" in strategy:
        raise NotSupportedError(
            "half (bf16) with zero1: ATorch keeps fp32 master weights here (BF16Optimizer over its sharded "
            "optimizer); atorch's zero1 cannot hold them. Use amp_native with bf16 (fp32 weights, bf16 compute) "
            "with zero1, or fsdp with half")
    return isinstance(optim, torch.optim.Optimizer)
