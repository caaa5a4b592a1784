"""save / load: one checkpoint format for every strategy, written atomically."""

import contextlib
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from atorch.checkpoint import integrity, io, loading, ranks, runtime, state
from atorch.errors import CheckpointError
from atorch.utils.log import logger
from atorch.utils.optim import unwrap_optimizer


def _size(value: int) -> str:
    from atorch.utils.sizes import size_text

    return size_text(value)


@contextlib.contextmanager
def _single_process_is_fine():
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _failed(what: str, error: CheckpointException, outcome: str) -> CheckpointError:
    """torch's CheckpointException (a BaseException, which ``except Exception`` misses) as atorch's error."""
    reasons = "; ".join(f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        for rank, (exc, _) in sorted(error.failures.items()))
    return CheckpointError(f"checkpoint: {what} failed ({reasons}); {outcome}")


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
        kinds.append(type(zero or unwrap_optimizer(optim)).__name__)
    return kinds


def _plain_objects(optim, lr_scheduler, dataloader, extra) -> dict:
    """What a save stores besides tensors, packed as plain data (:class:`CheckpointError` if it is not)."""
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
    return objects


def save(path: str | os.PathLike, model: torch.nn.Module, optim: Any = None, lr_scheduler: Any = None,
         dataloader: Any = None, extra: Any = None, timeout: float | None = None) -> Path:
    """Save a training job's state to the directory ``path``; call it on every rank.

    ``model`` and ``optim`` are what ``auto_accelerate`` returned, under any strategy (DDP,
    zero1, zero2/fsdp on FSDP2, tensor_parallel, and combinations); each rank writes its own
    shards in parallel (torch.distributed.checkpoint). ``lr_scheduler`` and ``dataloader`` (its
    epoch and position) are saved when given, and every rank's random streams always are, so
    :func:`load` continues the run exactly. ``extra``: plain data of your own (step counters, ...),
    returned by :func:`load`.

    The write is atomic: the checkpoint goes to ``<path>.tmp-<id>`` and replaces ``path`` only
    once complete, so a crash mid-save leaves the previous checkpoint at ``path``. Every file's
    SHA-256 goes into the manifest. Beside ``path``, a save removes only the ``.tmp-*``/``.old-*``
    folders an earlier save marked as its own. A failure on any rank raises
    :class:`atorch.errors.CheckpointError` on every rank. ``timeout``: seconds the save's own
    collectives wait for a rank (default: the process group's, 30 minutes unless set); a rank
    that stops answering (a frozen filesystem, a stopped process) then ends the others' save with
    a CheckpointError naming the timeout, shortly after it (tested at 3 s: within 3 s more).

    Example::

        atorch.checkpoint.save("ckpt/latest", result.model, result.optim, result.lr_scheduler,
                               result.dataloader, extra={"step": step})
    """
    with ranks.deadline(timeout):
        return _save(Path(path).absolute(), model, optim, lr_scheduler, dataloader, extra)


def _save(path: Path, model, optim, lr_scheduler, dataloader, extra) -> Path:
    start = time.perf_counter()
    logger.info("checkpoint: saving %s ...", path)
    # Agreed before the first collective: an object refused on one rank only (an extra that differs
    # by rank) raises on every rank, instead of leaving the others waiting in the save's collectives.
    objects = ranks.agree(lambda: _plain_objects(optim, lr_scheduler, dataloader, extra))
    content = state.gather(model, optim)
    if ranks.rank() == 0:
        content.update(objects)  # one copy is enough: every rank holds the same
    content["rng"] = {str(ranks.rank()): runtime.pack(runtime.rng_state(model), "the random state")}

    save_id = ranks.from_rank0(uuid.uuid4().hex[:12])
    tmp = io.temporary_dir(path, save_id)
    info = {
        "world_size": ranks.world_size(),
        "saved_from": _strategy_of(model, optim),
        "contents": sorted(["model"] + (["optim"] if optim is not None else []) + list(objects)),
    }
    try:
        ranks.on_rank0(lambda: io.prepare(path, tmp))
        try:
            with _single_process_is_fine():
                dcp.save(content, storage_writer=FileSystemWriter(tmp), no_dist=not ranks.distributed(),
                         process_group=ranks.group())
        except CheckpointException as error:
            raise _failed(f"saving {path}", error, f"{path} is as it was") from error
        # dcp.save returns once every rank's files and the metadata are written.
        files = integrity.record(tmp, ranks.on_rank0(lambda: io.list_files(tmp)))
        ranks.on_rank0(lambda: (io.write_manifest(tmp, info, files), io.publish(tmp, path, save_id)))
    except BaseException as error:
        # What the failed save wrote goes now, not at the next save: after a disk-full error it
        # kept the disk full. Every rank removes it (a filesystem that is not shared has one per node).
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, RuntimeError) and not isinstance(error, CheckpointError):
            raise ranks.peer_failure(f"saving {path}", error, f"{path} is as it was") from error
        raise
    logger.info("checkpoint saved to %s: %d files, %s, %.1fs", path, len(files),
                _size(sum(entry["size"] for entry in files.values())), time.perf_counter() - start)
    return path


def load(path: str | os.PathLike, model: torch.nn.Module, optim: Any = None, lr_scheduler: Any = None,
         dataloader: Any = None, allow_unverified: bool = False, timeout: float | None = None) -> Any:
    """Load a checkpoint written by :func:`save` into this job (call it on every rank); return its ``extra``.

    The model (and optimizer, lr scheduler, dataloader when given) may be held under another
    strategy and world size than at save time: each rank reads the pieces of the full tensors it
    holds now. Random streams are restored when this rank's were saved (same world size).

    Nothing is changed until everything checked out: the manifest, every file's checksum, the
    metadata (read without running code), that the checkpoint holds what this job needs with the
    right shapes, and the saved lr scheduler, dataloader (its global batch size), loss scaler and
    ``extra``. Tensors are read into new buffers first. Any failure, on any rank, raises
    :class:`atorch.errors.CheckpointError` on every rank, with the model, optimizer, scheduler,
    dataloader and random streams as they were.

    A checkpoint whose files carry no checksum (saved by atorch before checksums, manifest
    version 1) is refused unless ``allow_unverified=True``, which reads it with sizes checked
    only (logged at WARNING); save it again to get checksums. ``timeout``: as for :func:`save`.

    Example::

        if atorch.checkpoint.exists("ckpt/latest"):
            step = atorch.checkpoint.load("ckpt/latest", result.model, result.optim,
                                          result.lr_scheduler, result.dataloader)["step"]
    """
    path = Path(path).absolute()
    with ranks.deadline(timeout):
        try:
            return _load(path, model, optim, lr_scheduler, dataloader, allow_unverified)
        except RuntimeError as error:
            if isinstance(error, CheckpointError):
                raise
            raise ranks.peer_failure(f"loading {path}", error, "the model and optimizer may be partly loaded") from error


def _load(path: Path, model, optim, lr_scheduler, dataloader, allow_unverified: bool) -> Any:
    start = time.perf_counter()
    logger.info("checkpoint: loading %s ...", path)
    state.check_supported(model, optim)
    directory, manifest = ranks.agree(lambda: io.resolve(path))
    ranks.agree(lambda: io.require_checksums(directory, manifest, allow_unverified))
    if len(set(ranks.gather(str(directory)))) > 1:
        raise CheckpointError(f"checkpoint: the ranks see different checkpoints at {path}; it must be on a "
                              "filesystem every rank sees")
    integrity.verify(directory, manifest)
    plan = ranks.agree(lambda: loading.plan(directory, manifest, model, optim, lr_scheduler, dataloader))
    try:
        with _single_process_is_fine():
            dcp.load(plan.content, storage_reader=loading.CheckedReader(directory, plan.metadata),
                     planner=runtime.PlainDataLoadPlanner(), no_dist=not ranks.distributed(),
                     process_group=ranks.group())
    except CheckpointException as error:
        raise _failed(f"reading {directory}", error, "nothing was changed") from error
    objects = ranks.agree(lambda: loading.unpack(plan))
    undo = []
    ranks.agree(lambda: loading.apply_objects(objects, lr_scheduler, dataloader, plan.scaler, undo, model),
                on_failure=lambda: loading.run_undo(undo))
    ranks.agree(lambda: loading.apply_tensors(plan), on_failure=lambda: loading.run_undo(undo))
    if "rng" not in objects:
        logger.info("checkpoint: %s holds no random state for rank %d (saved by %d ranks); random streams "
                    "continue as they are", directory, ranks.rank(), manifest.get("world_size", 0))
    logger.info("checkpoint loaded from %s: %d files checked, %s, %.1fs", directory, len(manifest.get("files", {})),
                _size(sum(entry.get("size", 0) for entry in manifest.get("files", {}).values())),
                time.perf_counter() - start)
    return objects.get("extra")
