"""ModelContext: everything a method may read or replace while a strategy is applied.

The engine fills it from the user's arguments, then each method's stage hooks transform it:
the model, the optimizer, the dataloader, the loss function and the input preparation.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atorch.auto.environment import DeviceContext
from atorch.distributed.topology import Topology
from atorch.errors import AtorchConfigError


def map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor in ``data`` (also inside dicts, lists, tuples, namedtuples);
    the structure and everything else stay as they are."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)((key, map_tensors(value, fn)) for key, value in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(value, fn) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(value, fn) for value in data)
    return data


def move_to_device(data: Any, device: torch.device) -> Any:
    """The default ``prepare_input``: tensors (also inside dicts, lists and tuples) to ``device``."""
    return map_tensors(data, lambda t: t.to(device, non_blocking=True))


# How a batch feeds the model (see run_model).
MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict", "input_target")


def check_input_format(model_input_format: Any) -> None:
    """Refuse an unknown ``model_input_format`` before anything is built."""
    if model_input_format not in MODEL_INPUT_FORMATS:
        raise AtorchConfigError(
            f"model_input_format {model_input_format!r} is not one of {list(MODEL_INPUT_FORMATS)}: None calls "
            "model(batch), 'unpack_sequence' model(*batch), 'unpack_dict' model(**batch), 'input_target' "
            "model(batch[0]) for (input, target) batches")


def run_model(model: torch.nn.Module, data: Any, model_input_format: str | None) -> Any:
    """Call ``model`` on one prepared batch the way ``model_input_format`` says.

    ``None``: ``model(data)``; ``"unpack_sequence"``: ``model(*data)``; ``"unpack_dict"``:
    ``model(**data)``; ``"input_target"``: ``model(data[0])`` (plain PyTorch's ``(input,
    target)`` pairs, e.g. an image dataset; ``loss_func(batch, output)`` reads the target as
    ``batch[1]``).
    """
    if model_input_format is None:
        return model(data)
    if model_input_format == "unpack_sequence":
        return model(*data)
    if model_input_format == "unpack_dict":
        return model(**data)
    if model_input_format == "input_target":
        if not isinstance(data, (list, tuple)) or len(data) < 1:
            raise AtorchConfigError(
                f"model_input_format 'input_target' takes (input, target) batches; got a {type(data).__name__}: use "
                "None (model(batch)) or 'unpack_dict' (model(**batch)) for this dataset")
        return model(data[0])
    check_input_format(model_input_format)
    raise AssertionError("unreachable: every format is handled above")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DistributedDataParallel wrapper (other modules unchanged)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@dataclass
class ModelContext:
    model: torch.nn.Module
    device_ctx: DeviceContext
    optim_func: Callable | None = None
    optim_args: dict = field(default_factory=dict)
    optim_param_func: Callable | None = None
    dataset: Any = None
    loss_func: Callable | None = None
    prepare_input: Callable | None = None
    model_input_format: str | None = None
    dataloader_args: dict = field(default_factory=dict)
    distributed_sampler_cls: type | None = None
    sampler_seed: int = 0
    lr_scheduler_cls: type | None = None
    lr_scheduler_args: dict = field(default_factory=dict)
    find_unused_parameters: bool = False
    topology: Topology = field(default_factory=Topology.single)
    # Filled while applying.
    strategy: Any = None
    # A method that builds the optimizer itself (ZeRO) sets this before the OPTIMIZER stage:
    # ``factory(ctx) -> optimizer``.
    optim_factory: Callable | None = None
    optim: Any = None
    base_optim: torch.optim.Optimizer | None = None
    dataloader: Any = None
    lr_scheduler: Any = None
    # The name of the method that wrapped the model for data parallelism (ddp, fsdp, zero2...).
    wrapped_by: str | None = None
    # How result.backward weighs each part of a split batch (atorch/loss/step.py), set once the
    # strategy is applied (its data group is known then).
    loss_tokens: Any = None
    args: dict = field(
        default_factory=lambda: {"use_optim_backward": False, "requires_set_gradient_accumulation_boundary": False}
    )

    @property
    def device(self) -> torch.device:
        return self.device_ctx.device

    def build_optimizer(self) -> None:
        """Create the optimizer the user asked for, over the model as it is now (wrapped)."""
        if self.optim_func is None:
            return
        self.base_optim = self.optim_factory(self) if self.optim_factory else self.optim_func(self.optim_params(), **self.optim_args)
        self.optim = self.base_optim

    def optim_params(self) -> Any:
        """Parameter groups from ``optim_param_func``, else the trainable parameters.

        ``optim_param_func`` sees the user's module (parameter names without wrapper prefixes).
        Frozen parameters (LoRA's base weights) get no optimizer state.
        """
        if self.optim_param_func is not None:
            return self.optim_param_func(unwrap(self.model))
        return [p for p in self.model.parameters() if p.requires_grad]

    def build_dataloader(self) -> None:
        from atorch.data.loader import build_dataloader

        self.dataloader = build_dataloader(
            self.dataset,
            self.dataloader_args,
            self.topology.data_parallel_size,
            self.topology.data_parallel_rank,
            self.distributed_sampler_cls,
            self.sampler_seed,
        )

    def build_lr_scheduler(self) -> None:
        if self.lr_scheduler_cls is None or self.base_optim is None:
            return
        # Schedulers need the torch optimizer itself, not a wrapper around it.
        self.lr_scheduler = self.lr_scheduler_cls(self.base_optim, **self.lr_scheduler_args)
