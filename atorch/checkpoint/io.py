"""Checkpoint directories on disk: written aside, published by a rename, validated before reading.

A save writes into ``<path>.tmp-<id>``, which rank 0 first claims with a marker file naming it.
Once every rank's files and DCP's ``.metadata`` are there, rank 0 writes the manifest
(``atorch_checkpoint.json``: every file and its size), then moves the previous checkpoint aside
(``<path>.old-<id>``, marked first), renames the new one into place and only then deletes the old
one. A crash at any point leaves at least one complete checkpoint: ``<path>`` itself, or (in the
instant between the two renames) a complete sibling that :func:`resolve` finds and the next save
moves back into place. A save removes only the leftovers whose marker names them: a folder a user
made beside the checkpoint is never touched.
"""

import datetime
import json
import os
import shutil
from pathlib import Path

from atorch.errors import CheckpointError
from atorch.utils.log import logger

MANIFEST = "atorch_checkpoint.json"
MARKER = ".atorch_save"
FORMAT = "atorch-checkpoint"
VERSION = 1
_SIDE = (".tmp-", ".old-")
_NOT_LISTED = (MANIFEST, MANIFEST + ".partial", MARKER, MARKER + ".partial")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_dir(path: Path, save_id: str) -> Path:
    """Where a save under ``save_id`` writes before it is published."""
    return path.with_name(f"{path.name}.tmp-{save_id}")


def _siblings(path: Path) -> list[Path]:
    """Directories named like leftovers of saves to ``path`` (``.tmp-*``, ``.old-*``): ours or a user's."""
    if not path.parent.is_dir():
        return []
    prefixes = tuple(path.name + side for side in _SIDE)
    return [p for p in path.parent.iterdir() if p.name.startswith(prefixes) and p.is_dir()]


def mark(folder: Path, name: str) -> None:
    """Claim ``folder`` for a save: a marker inside names the folder name it is valid under."""
    partial = folder / (MARKER + ".partial")
    partial.write_text(json.dumps({"made_by": "atorch.checkpoint.save", "folder": name}))
    os.replace(partial, folder / MARKER)


def _own(folder: Path) -> bool:
    """Whether ``folder`` is a leftover of a save: its marker names it. A copy a user made of a
    checkpoint (``ck.old-manual-backup``) carries the marker of another name, and is kept."""
    try:
        return json.loads((folder / MARKER).read_text()).get("folder") == folder.name
    except (OSError, ValueError, AttributeError):
        return False


def write_manifest(directory: Path, info: dict) -> None:
    """Record every file of the finished checkpoint in ``directory`` with its size (rank 0)."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in _NOT_LISTED
    }
    if ".metadata" not in files:
        raise CheckpointError(f"{directory}: torch.distributed.checkpoint wrote no .metadata; the save did not finish")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **info,
        "files": files,
    }
    partial = directory / (MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, directory / MANIFEST)
    _fsync_dir(directory)


def publish(tmp: Path, path: Path, save_id: str) -> None:
    """Put the complete checkpoint ``tmp`` at ``path``; the previous one is removed last (rank 0)."""
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}.old-{save_id}")
        mark(path, old.name)  # so that a crash right after the rename leaves a folder provably ours
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare(path: Path, tmp: Path) -> None:
    """Before a save (rank 0): recover a checkpoint a crash left beside ``path``, drop the other
    leftovers of earlier saves, and create ``tmp`` with its marker."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; atorch checkpoints are directories, pick another path")
    if path.is_dir() and not (path / MANIFEST).is_file() and any(path.iterdir()):
        raise CheckpointError(f"{path} exists and is not an atorch checkpoint (it has no {MANIFEST}); save would "
                              "replace it: pick another path, or move that directory away")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        found = _complete_siblings(path)
        if found:
            logger.warning("checkpoint: %s was missing; restoring %s left by an interrupted save", path, found[0])
            os.rename(found[0], path)
    for leftover in _siblings(path):
        if _own(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            logger.info("checkpoint: keeping %s: it is named like a leftover of a save but was not made by one", leftover)
    tmp.mkdir()
    mark(tmp, tmp.name)


def read_manifest(directory: Path) -> dict:
    """The manifest of ``directory``; :class:`CheckpointError` when it is absent or unreadable."""
    file = directory / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{directory} is not a complete atorch checkpoint: {MANIFEST} is missing (a save that did not "
            "finish, or a directory written by something else); load the previous checkpoint instead"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} cannot be read ({error}); the checkpoint is corrupt") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{file} is not an atorch checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{directory} has format version {manifest['version']}; this atorch reads up to {VERSION}, upgrade atorch")
    return manifest


def validate(directory: Path) -> dict:
    """Check that every file the manifest lists is present with its recorded size; return the manifest."""
    manifest = read_manifest(directory)
    missing, wrong = [], []
    for name, size in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            missing.append(name)
        elif file.stat().st_size != size:
            wrong.append(f"{name} ({file.stat().st_size} bytes, expected {size})")
    if missing or wrong:
        parts = ([f"missing files {missing}"] if missing else []) + ([f"truncated or altered files {wrong}"] if wrong else [])
        raise CheckpointError(f"checkpoint {directory} is damaged: {'; '.join(parts)}; it will not be loaded")
    return manifest


def _complete_siblings(path: Path) -> list[Path]:
    """Complete leftovers of interrupted saves (only those marked as such), newest first."""
    found = []
    for candidate in _siblings(path):
        if not _own(candidate):
            continue
        try:
            found.append((validate(candidate)["saved_at"], candidate))
        except CheckpointError:
            continue
    return [p for _, p in sorted(found, reverse=True)]


def resolve(path: Path) -> tuple[Path, dict]:
    """The directory to load for ``path`` and its manifest, after validation.

    ``path`` itself when it exists; otherwise the newest complete checkpoint that a save
    interrupted between its two renames left beside it.
    """
    if path.is_dir():
        return path, validate(path)
    if path.exists():
        raise CheckpointError(f"{path} is not a directory; atorch checkpoints are directories written by atorch.checkpoint.save")
    found = _complete_siblings(path)
    if found:
        logger.warning("checkpoint: %s is missing; loading %s, left complete by an interrupted save", path, found[0])
        return found[0], validate(found[0])
    raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")


def exists(path: str | os.PathLike) -> bool:
    """Whether a complete checkpoint can be loaded from ``path`` (for resume-if-present logic)."""
    try:
        resolve(Path(path))
    except CheckpointError:
        return False
    return True
