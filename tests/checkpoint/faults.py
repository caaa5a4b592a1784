"""Damaged and hostile checkpoints, and what a refused load must leave as it was (shared by the
one-process tests and the 2-rank run of test_refused_load.py)."""

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import atorch.checkpoint as ckpt
from atorch.checkpoint import integrity, io, ranks, state
from tests.checkpoint.jobs import build, train


def forge_manifest(directory: Path) -> None:
    """Rewrite the manifest to match the files as they are now, as someone sharing a hostile or
    damaged checkpoint could (collective: every rank calls it)."""
    directory = Path(directory)
    manifest = json.loads((directory / io.MANIFEST).read_text())
    info = {key: manifest[key] for key in ("world_size", "saved_from", "contents")}
    files = integrity.record(directory, ranks.on_rank0(lambda: io.list_files(directory)))
    ranks.on_rank0(lambda: io.write_manifest(directory, info, files))


def flip(file: Path, start: int, count: int = 1) -> None:
    """Invert ``count`` bytes of ``file`` from ``start``: same size, other content."""
    data = bytearray(Path(file).read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    Path(file).write_bytes(bytes(data))


def _local(value):
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return _local(value)


def snapshot(result) -> dict:
    """What this rank holds of the job: parameters, optimizer state and hyperparameters, lr
    scheduler, dataloader position and the random stream (copies)."""
    optimizer = state.split_optimizer(result.optim)[0]
    return {"model": _copy(dict(result.model.state_dict())), "optim": _copy(optimizer.state_dict()),
            "lr_scheduler": _copy(result.lr_scheduler.state_dict()), "dataloader": result.dataloader.state_dict(),
            "rng": torch.get_rng_state()}


def differences(before, after, where: str = "") -> list[str]:
    """Where ``after`` differs from ``before`` (empty when equal)."""
    if isinstance(before, dict):
        if before.keys() != after.keys():
            return [f"{where}: keys"]
        return [d for k in before for d in differences(before[k], after[k], f"{where}.{k}")]
    if isinstance(before, (list, tuple)):
        if len(before) != len(after):
            return [f"{where}: length"]
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in differences(b, a, f"{where}[{i}]")]
    if isinstance(before, torch.Tensor):
        return [] if torch.equal(before, after) else [where]
    return [] if before == after else [where]


def refusal(action) -> str:
    """``"Type: message"`` of what ``action`` raised (an Exception), or ``"loaded"``."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - a CheckpointException (BaseException) would escape: that is a failure
        return f"{type(error).__name__}: {error}"
    return "loaded"


def _load(path, result):
    return lambda: ckpt.load(path, result.model, result.optim, result.lr_scheduler, result.dataloader)


def refused_loads(directory: str, strategies=("fsdp", "tp")) -> dict:
    """Per strategy: a load refused for a global batch of 4 instead of 8, and one of a .distcp
    damaged near its start (refused by its checksum, then, with a forged manifest, while DCP reads);
    each with what changed in the job."""
    out = {}
    for name in strategies:
        saved = build(name)
        train(saved, 2)
        path = Path(directory) / name
        ckpt.save(path, saved.model, saved.optim, saved.lr_scheduler, saved.dataloader, extra={"step": 2})
        cases = {}
        other_batch = build(name, seed=5, batch_size=4)
        train(other_batch, 1)
        before = snapshot(other_batch)
        cases["batch"] = (refusal(_load(path, other_batch)), differences(before, snapshot(other_batch)))

        target = build(name, seed=5)
        train(target, 1)
        before = snapshot(target)
        ranks.on_rank0(lambda: flip(path / "__0_0.distcp", 8, 64))
        cases["damaged"] = (refusal(_load(path, target)), differences(before, snapshot(target)))
        forge_manifest(path)
        cases["damaged_forged"] = (refusal(_load(path, target)), differences(before, snapshot(target)))
        out[name] = cases
    return out
