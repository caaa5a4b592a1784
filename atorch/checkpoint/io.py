"""Checkpoint directories on disk: written aside, published by a rename, validated before reading.

A save writes into ``<path>.tmp-<id>``, which rank 0 first claims with a marker file naming it.
Once every rank's files and DCP's ``.metadata`` are there, rank 0 writes the manifest
(``atorch_checkpoint.json``: every file with its size and SHA-256, and a checksum of the manifest
itself), moves the previous checkpoint aside (``<path>.old-<id>``, marked first), renames the new
one into place and only then deletes the old one. A crash at any point leaves at least one
complete checkpoint: ``<path>`` itself, or (in the instant between the two renames) a complete
sibling that :func:`resolve` finds and the next save moves back into place. A save removes only
the leftovers whose marker names them: a folder a user made beside the checkpoint is never touched.
"""

import datetime
import json
import os
import shutil
import stat
from pathlib import Path

from atorch.checkpoint import integrity, safe_pickle
from atorch.errors import CheckpointError
from atorch.utils.log import logger

MANIFEST = "atorch_checkpoint.json"
MARKER = ".atorch_save"
FORMAT = "atorch-checkpoint"
VERSION = 2  # 2: files carry a sha256 and the manifest checks itself; 1: sizes only
SELF_CHECK = "manifest_sha256"
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


def list_files(directory: Path) -> dict[str, int]:
    """``{name: size}`` of the files a finished save wrote into ``directory`` (rank 0)."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in _NOT_LISTED
    }
    if ".metadata" not in files:
        raise CheckpointError(f"{directory}: torch.distributed.checkpoint wrote no .metadata; the save did not finish")
    return files


def _self_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_CHECK}
    return integrity.digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(directory: Path, info: dict, files: dict[str, dict]) -> None:
    """Record every file of the finished checkpoint in ``directory`` with its size and checksum (rank 0)."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **info,
        "files": files,
    }
    manifest[SELF_CHECK] = _self_digest(manifest)
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
    """The manifest of ``directory``; :class:`CheckpointError` when it is absent, unreadable or altered.

    Version 1 manifests (sizes only) are read as ``{"files": {name: {"size": n}}}``;
    :func:`require_checksums` refuses them unless the caller allows it.
    """
    file = directory / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{directory} is not a complete atorch checkpoint: {MANIFEST} is missing (a save that did not "
            "finish, or a directory written by something else); load the previous checkpoint instead"
        )
    try:
        manifest = json.loads(file.read_bytes().decode())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} cannot be read ({error}); the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{file} is not an atorch checkpoint manifest")
    version = manifest.get("version", 0)
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{directory} has format version {version}; this atorch reads up to {VERSION}, upgrade atorch")
    if version >= 2 and manifest.get(SELF_CHECK) != _self_digest(manifest):
        raise CheckpointError(f"{file} was altered after the save (its checksum does not match); the checkpoint is corrupt")
    files = {}
    for name, entry in manifest["files"].items():
        entry = {"size": entry} if version < 2 else entry
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or Path(name).is_absolute()
                or ".." in Path(name).parts or name in _NOT_LISTED):
            raise CheckpointError(f"{file} lists {name!r} as {entry!r}; the checkpoint is corrupt")
        checksum = entry.get(integrity.ALGORITHM)
        if checksum is not None and not (isinstance(checksum, str) and len(checksum) == 64):
            raise CheckpointError(f"{file} lists {name!r} with checksum {checksum!r}; the checkpoint is corrupt")
        files[name] = entry
    return {**manifest, "files": files}


def validate(directory: Path) -> dict:
    """Check that every file the manifest lists is present with its recorded size; return the manifest.

    The contents are checked against their checksums by :func:`integrity.verify`, which reads them.
    """
    manifest = read_manifest(directory)
    missing, wrong, linked = [], [], []
    for name, entry in manifest["files"].items():
        file = directory / name
        if _linked(directory, name):
            linked.append(name)
        elif not file.is_file():
            missing.append(name)
        elif file.stat().st_size != entry["size"]:
            wrong.append(f"{name} ({file.stat().st_size} bytes, expected {entry['size']})")
    if missing or wrong or linked:
        parts = ([f"missing files {missing}"] if missing else []) + ([f"truncated or altered files {wrong}"] if wrong else [])
        parts += [f"parts that are links, not regular files inside the checkpoint folder {linked} (a save never "
                  "writes one; copy the files themselves)"] if linked else []
        raise CheckpointError(f"checkpoint {directory} is damaged: {'; '.join(parts)}; it will not be loaded")
    return manifest


def _linked(directory: Path, name: str) -> bool:
    """Whether part ``name`` is a symlink, or lies under one, inside ``directory`` (the checkpoint
    folder itself may be a link: ``ckpt/latest -> step_100``): a part must be a regular file there."""
    path = directory
    for part in Path(name).parts:
        path = path / part
        if path.is_symlink():
            return True
    return path.exists() and not stat.S_ISREG(path.lstat().st_mode)


def unverified(manifest: dict) -> list[str]:
    """The files ``manifest`` holds no checksum for (every file of a version-1 manifest)."""
    return sorted(name for name, entry in manifest["files"].items() if integrity.ALGORITHM not in entry)


def require_checksums(directory: Path, manifest: dict, allow_unverified: bool) -> None:
    """Refuse a checkpoint whose files are not all checksummed, unless the caller said to read it anyway."""
    names = unverified(manifest)
    if not names:
        return
    what = (f"was saved by an earlier atorch without checksums (manifest version {manifest.get('version', 0)})"
            if manifest.get("version", 0) < 2 else f"lists files without a checksum {names[:5]}")
    if not allow_unverified:
        raise CheckpointError(f"checkpoint {directory} {what}: a changed byte in those files would go unnoticed. "
                              "Pass allow_unverified=True to atorch.checkpoint.load to read it with sizes checked only, "
                              "then save it again to get checksums")
    logger.warning("checkpoint: %s %s; reading it with sizes checked only (allow_unverified=True): save it again to "
                   "get checksums", directory, what)


def read_metadata(directory: Path, manifest: dict):
    """DCP's metadata of ``directory``, checked against its checksum and read without running code
    (:mod:`safe_pickle`); every file it points at must be one the manifest lists."""
    file = directory / ".metadata"
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"checkpoint {directory} lists no .metadata in its manifest; it is corrupt")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{file} cannot be read ({error})") from None
    wrong = integrity.mismatch(directory, ".metadata", manifest["files"][".metadata"], data)
    if wrong is not None:
        raise CheckpointError(f"checkpoint {directory} is damaged: files whose content changed since the save "
                              f"[{wrong!r}]; it will not be loaded")
    metadata = safe_pickle.loads(data, str(file))
    unknown = sorted(safe_pickle.referenced_files(metadata) - set(manifest["files"]))
    if unknown:
        raise CheckpointError(f"{file} points at files the manifest does not list {unknown[:5]}; the checkpoint is corrupt")
    return metadata


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
    """Whether a complete checkpoint can be loaded from ``path`` (for resume-if-present logic).

    Checks the manifest, every file's presence and size, and the metadata (its checksum, and that
    it reads without running code); :func:`atorch.checkpoint.load` also verifies every file's
    checksum, which reads the whole checkpoint.
    """
    try:
        read_metadata(*resolve(Path(path).absolute()))
    except CheckpointError:
        return False
    return True
