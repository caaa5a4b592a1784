"""export: the trained weights as one plain file that a serial model loads directly."""

import importlib.util
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from atorch.checkpoint import state
from atorch.utils.log import logger


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the serial model, whole, on the CPU (collective: every rank calls it)."""
    full = {}
    for key, value in state.gather(model, None)["model"].items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        full[key] = value.detach().to("cpu", copy=True)
    if state.holder(model)[1]:  # pipeline: each rank holds its stages; every rank gets them all
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, full)
        full = {k: v for part in parts for k, v in part.items()}
    return full


def export(path: str | os.PathLike, model: torch.nn.Module) -> Path:
    """Write the model's full weights into the directory ``path``; call it on every rank.

    Whatever the strategy (DDP, FSDP2, tensor parallel, ...), the result is the serial model's
    state dict: ``model.safetensors`` when safetensors is installed, ``model.pt`` otherwise. For a
    transformers model, ``save_pretrained`` writes it with ``config.json``, so
    ``AutoModel.from_pretrained(path)`` loads it. Returns the weights file's path.

    Example::

        atorch.checkpoint.export("out/final", result.model)
        serial = MyModel(); serial.load_state_dict(safetensors.torch.load_file("out/final/model.safetensors"))
    """
    path = Path(path).absolute()
    weights = _full_state(model)
    user = state._user_module(state.holder(model)[0])
    safetensors = importlib.util.find_spec("safetensors") is not None
    target = path / ("model.safetensors" if safetensors else "model.pt")
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        count = len(weights)  # save_pretrained may empty the dict it is given
        if hasattr(user, "save_pretrained") and hasattr(user, "config"):
            # transformers drops tied copies and writes config.json beside the weights.
            user.save_pretrained(path, state_dict=weights, safe_serialization=safetensors)
        else:
            partial = target.with_name(target.name + ".partial")
            # _full_state made independent copies: safetensors refuses tensors that share memory.
            plain = {k: v.contiguous() for k, v in weights.items()}
            if safetensors:
                from safetensors.torch import save_file

                save_file(plain, partial)
            else:
                torch.save(plain, partial)
            os.replace(partial, target)
        logger.info("exported %d tensors to %s", count, target)
    if dist.is_initialized():
        dist.barrier()
    return target
