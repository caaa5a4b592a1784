"""The steps of :func:`atorch.checkpoint.load`, each agreed by every rank before the next.

1. :func:`plan`: the metadata (read by :mod:`safe_pickle`), the keys and shapes this job needs,
   and new buffers for DCP to read into; nothing the job holds is touched.
2. DCP reads the tensors into those buffers (:class:`CheckedReader` hands it the metadata
   already checked, so torch's pickle-based reader never runs).
3. :func:`unpack`: the plain-data objects (``weights_only``).
4. :func:`apply_objects`: the dataloader (whose global batch must match), lr scheduler, loss
   scaler and random streams, each undone if any of them fails on any rank.
5. :func:`apply_tensors`: the buffers are copied into the model and optimizer.
"""

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from atorch.checkpoint import io, ranks, runtime, state
from atorch.errors import CheckpointError
from atorch.utils.log import logger

_OBJECTS = ("dataloader", "lr_scheduler", "amp_scaler")  # applied in this order, the likeliest to refuse first


class CheckedReader(FileSystemReader):
    """DCP's file reader, given metadata that :func:`io.read_metadata` already read and checked."""

    def __init__(self, directory: Path, metadata: Metadata):
        super().__init__(directory)
        self._checked = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._checked.storage_meta is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked


@dataclass
class Plan:
    directory: Path
    metadata: Metadata
    content: dict  # what DCP fills: new tensors, and b"" for each plain-data object
    finish: object  # state.targets' finish(content)
    optim: object
    scaler: object
    stateless: bool  # saved before the optimizer's first step: hyperparameters only
    held: dict = field(default_factory=dict)


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


def _read_tied_state_once(content: dict, stored: dict, aliases: dict[str, list[str]]) -> tuple[dict, set]:
    """Optimizer state this job wants under a tied weight's name the checkpoint saved under
    another (saved where the tie is one tensor, loaded into a pipeline that keeps a copy per
    stage): read under the saved name, copied to this one after. Returns ``{wanted: read}`` and
    the keys read only for such a copy (not this job's own)."""
    optim = content.get("optim")
    if not optim or not aliases:
        return {}, set()
    copies, added = {}, set()
    for key in [k for k in optim if f"optim.{k}" not in stored]:
        kind, _, rest = key.partition(".")  # "state" or "param_groups", then "<name>.<field>"
        name = next((n for n in aliases if rest.startswith(n + ".")), None)
        if name is None:
            continue
        field = rest[len(name) + 1:]
        source = next((f"{kind}.{alias}.{field}" for alias in aliases[name]
                       if f"optim.{kind}.{alias}.{field}" in stored), None)
        if source is not None:
            buffer = optim.pop(key)
            if source not in optim:
                optim[source] = buffer
                added.add(source)
            copies[key] = source
    return copies, added


def _copying(finish, copies: dict[str, str], added: set):
    """``finish`` after each copy of :func:`_read_tied_state_once` is made (and the keys read only
    for them dropped)."""
    def finish_with_copies(loaded: dict) -> None:
        optim = loaded["optim"]
        for key, source in copies.items():
            value = optim[source]
            optim[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for source in added:
            del optim[source]
        finish(loaded)

    return finish_with_copies


def plan(directory: Path, manifest: dict, model: torch.nn.Module, optim, lr_scheduler, dataloader) -> Plan:
    """Everything that can be checked before reading a tensor; the buffers to read into."""
    metadata = io.read_metadata(directory, manifest)
    stored = metadata.state_dict_metadata
    wanted = {"lr_scheduler": lr_scheduler, "dataloader": dataloader}
    for name, target in wanted.items():
        if target is not None and name not in stored:
            raise CheckpointError(f"checkpoint {directory} holds no {name} state (it was saved without one); "
                                  f"pass {name}=None")
        if target is not None and not hasattr(target, "load_state_dict"):
            raise CheckpointError(f"{name} {type(target).__name__} has no load_state_dict(); pass the one "
                                  f"auto_accelerate returned, or {name}=None")
    content, finish = state.targets(model, optim)
    stateless = optim is not None and not any(k.startswith("optim.state.") for k in stored)
    held = {k: v for k, v in content.get("optim", {}).items() if stateless and k.startswith("state.")}
    for key in held:
        del content["optim"][key]
    copies, added = _read_tied_state_once(content, stored, state.tied_aliases(model))
    finish = _copying(finish, copies, added) if copies else finish
    _check_keys(directory, content, stored)
    scaler = state.split_optimizer(optim)[2] if optim is not None else None
    objects = [name for name, target in wanted.items() if target is not None]
    objects += [name for name in ("extra",) + (("amp_scaler",) if scaler is not None else ()) if name in stored]
    content.update({name: b"" for name in objects})
    if f"rng.{ranks.rank()}" in stored:
        content["rng"] = {str(ranks.rank()): b""}
    return Plan(directory, metadata, content, finish, optim, scaler, stateless, held)


def unpack(plan: Plan) -> dict:
    """``{name: plain data}`` of the objects DCP read (``rng`` is this rank's random streams)."""
    names = [name for name in (*_OBJECTS, "extra") if name in plan.content]
    try:
        objects = {name: runtime.unpack(plan.content[name]) for name in names}
        if "rng" in plan.content:
            objects["rng"] = runtime.unpack(plan.content["rng"][str(ranks.rank())])
    except Exception as error:  # noqa: BLE001 - weights_only refuses anything but plain data
        raise CheckpointError(f"checkpoint {plan.directory} holds objects that cannot be read as plain data "
                              f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    return objects


def apply_objects(objects: dict, lr_scheduler, dataloader, scaler, undo: list, model=None) -> None:
    """Load the objects' states, each after recording in ``undo`` how to put the old one back
    (the random streams into those ``model`` draws from)."""
    targets = {"dataloader": dataloader, "lr_scheduler": lr_scheduler, "amp_scaler": scaler}
    for name in _OBJECTS:
        target = targets[name]
        if target is None or name not in objects:
            continue
        before = copy.deepcopy(target.state_dict())
        undo.append(lambda target=target, before=before: target.load_state_dict(before))
        try:
            target.load_state_dict(objects[name])
        except Exception as error:  # noqa: BLE001 - the job's own check (a global batch that differs, ...)
            raise CheckpointError(f"the saved {name} state does not fit this job: {error}; nothing was changed") from None
    if "rng" in objects:
        before = runtime.rng_state(model)
        undo.append(lambda: runtime.set_rng_state(before, model))
        runtime.set_rng_state(objects["rng"], model)


def run_undo(undo: list) -> None:
    """Put back what :func:`apply_objects` changed, newest first; a step that fails is logged."""
    for step in reversed(undo):
        try:
            step()
        except Exception as error:  # noqa: BLE001 - the error being raised matters more than this one
            logger.warning("checkpoint: could not restore a state after a refused load: %s", error)


def apply_tensors(plan: Plan) -> None:
    """Copy what DCP read into the model and optimizer (every check has passed)."""
    if plan.held:
        plan.content["optim"].update(plan.held)
    try:
        plan.finish(plan.content)
    except Exception as error:  # noqa: BLE001 - not expected once the shapes matched; said as it is
        raise CheckpointError(f"checkpoint {plan.directory}: copying the loaded tensors into the model failed "
                              f"({type(error).__name__}: {error}); the model and optimizer may be partly loaded") from None
    if plan.stateless:
        state.split_optimizer(plan.optim)[0].state.clear()
