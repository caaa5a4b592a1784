"""save / load: one checkpoint format for every strategy, written atomically."""

import contextlib
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from atorch.checkpoint import io, runtime, state
from atorch.errors import CheckpointError
from atorch.utils.log import logger


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@contextlib.contextmanager
def _single_process_is_fine():
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _from_rank0(value):
    """Rank 0's ``value`` on every rank (a string id, or an error message to raise everywhere)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0(action) -> None:
    """Run ``action`` on rank 0; every rank raises if it failed there (no rank is left waiting)."""
    error = None
    if _rank() == 0:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    error = _from_rank0(error)
    if error is not None:
        raise CheckpointError(f"checkpoint: rank 0 failed: {error}")


def _strategy_of(model: torch.nn.Module, optim) -> list[str]:
    """A readable note of how the model was held when saved (for the manifest, not used to load)."""
    from torch.distributed.tensor import DTensor

    kinds = [type(model).__name__]
    if any(isinstance(p, DTensor) for p in model.parameters()):
        kinds.append("fsdp2")
    if state.tensor_parallel_shards(model):
        kinds.append("tensor_parallel")
    if optim is not None:
        _, zero, _ = state.split_optimizer(optim)
        kinds.append(type(zero or getattr(optim, "optimizer", optim)).__name__)
    return kinds


def save(path: str | os.PathLike, model: torch.nn.Module, optim: Any = None, lr_scheduler: Any = None,
         dataloader: Any = None, extra: Any = None) -> Path:
    """Save a training job's state to the directory ``path``; call it on every rank.

    ``model`` and ``optim`` are what ``auto_accelerate`` returned, under any strategy (DDP,
    zero1, zero2/fsdp on FSDP2, tensor_parallel, and combinations); each rank writes its own
    shards in parallel (torch.distributed.checkpoint). ``lr_scheduler`` and ``dataloader`` (its
    epoch and position) are saved when given, and every rank's random streams always are, so
    :func:`load` continues the run exactly. ``extra``: plain data of your own (step counters, ...),
    returned by :func:`load`.

    The write is atomic: the checkpoint goes to ``<path>.tmp-<id>`` and replaces ``path`` only
    once complete, so a crash mid-save leaves the previous checkpoint at ``path``.

    Example::

        atorch.checkpoint.save("ckpt/latest", result.model, result.optim, result.lr_scheduler,
                               result.dataloader, extra={"step": step})
    """
    path = Path(path).absolute()
    content = state.gather(model, optim)
    objects = {}
    if lr_scheduler is not None:
        objects["lr_scheduler"] = runtime.pack(lr_scheduler.state_dict(), "the lr scheduler's state")
    if dataloader is not None:
        if not hasattr(dataloader, "state_dict"):
            raise CheckpointError(
                f"dataloader {type(dataloader).__name__} has no state_dict(); pass the dataloader auto_accelerate "
                "returned (it knows its position), or leave dataloader=None and keep the position in extra"
            )
        objects["dataloader"] = runtime.pack(dataloader.state_dict(), "the dataloader's state")
    if extra is not None:
        objects["extra"] = runtime.pack(extra, "extra")
    _, _, scaler = state.split_optimizer(optim) if optim is not None else (None, None, None)
    if scaler is not None:
        objects["amp_scaler"] = runtime.pack(scaler.state_dict(), "the loss scaler's state")
    if _rank() == 0:
        content.update(objects)  # one copy is enough: every rank holds the same
    content["rng"] = {str(_rank()): runtime.pack(runtime.rng_state(), "the random state")}

    save_id = _from_rank0(uuid.uuid4().hex[:12])
    tmp = io.temporary_dir(path, save_id)
    _on_rank0(lambda: io.prepare(path, tmp))
    with _single_process_is_fine():
        dcp.save(content, storage_writer=FileSystemWriter(tmp), no_dist=not _distributed())
    info = {
        "world_size": dist.get_world_size() if _distributed() else 1,
        "saved_from": _strategy_of(model, optim),
        "contents": sorted(["model"] + (["optim"] if optim is not None else []) + list(objects)),
    }
    # dcp.save returns once every rank's files and the metadata are written.
    _on_rank0(lambda: (io.write_manifest(tmp, info), io.publish(tmp, path, save_id)))
    logger.info("checkpoint saved to %s", path)
    return path


def _check_keys(directory: Path, wanted: dict, stored: dict) -> None:
    """Refuse before reading anything when the checkpoint lacks a tensor or its shape differs."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(wanted)
    missing = sorted(k for k in flat if k not in stored)
    if missing:
        section = "optimizer state" if all(k.startswith("optim.") for k in missing) else "entries"
        hint = (" (it was saved without an optimizer, or with another optimizer class; pass optim=None to load the "
                "weights only)" if section == "optimizer state" else " (it was saved from another model)")
        raise CheckpointError(f"checkpoint {directory} has no {section} {missing[:5]}"
                              f"{' and %d more' % (len(missing) - 5) if len(missing) > 5 else ''}{hint}")
    wrong = [f"{k}: checkpoint {tuple(stored[k].size)}, model {tuple(v.shape)}" for k, v in flat.items()
             if isinstance(v, torch.Tensor) and not isinstance(stored[k], BytesStorageMetadata)
             and tuple(stored[k].size) != tuple(v.shape)]
    if wrong:
        raise CheckpointError(f"checkpoint {directory} does not fit this model: {wrong[:5]}")


def load(path: str | os.PathLike, model: torch.nn.Module, optim: Any = None, lr_scheduler: Any = None,
         dataloader: Any = None) -> Any:
    """Load a checkpoint written by :func:`save` into this job (call it on every rank); return its ``extra``.

    The model (and optimizer, lr scheduler, dataloader when given) may be held under another
    strategy and world size than at save time: each rank reads the pieces of the full tensors it
    holds now. Random streams are restored when this rank's were saved (same world size).
    A missing, partial or damaged checkpoint raises :class:`atorch.errors.CheckpointError`
    before anything is changed.

    Example::

        if atorch.checkpoint.exists("ckpt/latest"):
            step = atorch.checkpoint.load("ckpt/latest", result.model, result.optim,
                                          result.lr_scheduler, result.dataloader)["step"]
    """
    directory, manifest = io.resolve(Path(path).absolute())
    reader = FileSystemReader(directory)
    stored = reader.read_metadata().state_dict_metadata
    content, finish = state.targets(model, optim)
    # Saved before the optimizer's first step: hyperparameters only, and no state after loading.
    stateless = optim is not None and not any(k.startswith("optim.state.") for k in stored)
    held = {k: v for k, v in content.get("optim", {}).items() if stateless and k.startswith("state.")}
    for key in held:
        del content["optim"][key]
    _check_keys(directory, content, stored)
    wanted = {"lr_scheduler": lr_scheduler, "dataloader": dataloader}
    for name, target in wanted.items():
        if target is not None and name not in stored:
            raise CheckpointError(f"checkpoint {directory} holds no {name} state (it was saved without one); "
                                  f"pass {name}=None")
    objects = [name for name, target in wanted.items() if target is not None]
    _, _, scaler = state.split_optimizer(optim) if optim is not None else (None, None, None)
    objects += [name for name in ("extra",) + (("amp_scaler",) if scaler is not None else ()) if name in stored]
    content.update({name: b"" for name in objects})
    rng_key = f"rng.{_rank()}"
    if rng_key in stored:
        content["rng"] = {str(_rank()): b""}
    with _single_process_is_fine():
        dcp.load(content, storage_reader=reader, planner=runtime.PlainDataLoadPlanner(), no_dist=not _distributed())
    if held:
        content["optim"].update(held)
    finish(content)
    if stateless:
        state.split_optimizer(optim)[0].state.clear()
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(runtime.unpack(content["lr_scheduler"]))
    if dataloader is not None:
        dataloader.load_state_dict(runtime.unpack(content["dataloader"]))
    if "amp_scaler" in content:
        scaler.load_state_dict(runtime.unpack(content["amp_scaler"]))
    if "rng" in content:
        runtime.set_rng_state(runtime.unpack(content["rng"][str(_rank())]))
    else:
        logger.info("checkpoint: %s holds no random state for rank %d (saved by %d ranks); random streams "
                    "continue as they are", directory, _rank(), manifest.get("world_size", 0))
    logger.info("checkpoint loaded from %s", directory)
    return runtime.unpack(content["extra"]) if "extra" in content else None
