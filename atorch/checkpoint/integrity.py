"""Checksums of a checkpoint's files: recorded in the manifest by ``save``, checked before ``load`` uses them.

Sizes alone miss a flipped byte (a same-size file loads silently, with optimizer state off by
1e6); a SHA-256 per file does not. The work is shared: every rank hashes a part of the files,
balanced by size, and the ranks agree on the outcome (:func:`atorch.checkpoint.ranks.agree`), so
the cost of a save or a load grows with the checkpoint's size divided by the number of ranks.
The checksum guards against damage, not against an attacker, who can rewrite the manifest too:
what keeps a hostile checkpoint from running code is the restricted reading (safe_pickle.py,
``weights_only``), not this.
"""

import hashlib
from pathlib import Path

from atorch.checkpoint import ranks
from atorch.errors import CheckpointError

ALGORITHM = "sha256"


def digest(data: bytes) -> str:
    return hashlib.new(ALGORITHM, data).hexdigest()


def digest_file(file: Path) -> str:
    hasher, buffer = hashlib.new(ALGORITHM), bytearray(1 << 22)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:  # hashlib.file_digest is Python 3.11+
        while size := f.readinto(buffer):
            hasher.update(view[:size])
    return hasher.hexdigest()


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files each rank hashes: largest first, each to the rank with the fewest bytes so far."""
    load, parts = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = load.index(min(load))
        parts[least].append(name)
        load[least] += sizes[name]
    return parts


def record(directory: Path, sizes: dict[str, int]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` for the files ``sizes`` names (the same on every rank), each
    hashed by one rank (collective)."""
    mine = shares(sizes, ranks.world_size())[ranks.rank()]
    digests = ranks.agree(lambda: {name: digest_file(directory / name) for name in mine})
    found = {name: value for part in ranks.gather(digests) for name, value in part.items()}
    return {name: {"size": size, ALGORITHM: found[name]} for name, size in sizes.items()}


def mismatch(directory: Path, name: str, entry: dict, data: bytes | None = None) -> str | None:
    """Why ``name`` does not match its manifest ``entry`` (None when it does, or has no checksum)."""
    expected = entry.get(ALGORITHM)
    if expected is None:
        return None
    actual = digest(data) if data is not None else digest_file(directory / name)
    return None if actual == expected else f"{name} ({ALGORITHM} {actual[:12]}..., expected {expected[:12]}...)"


def verify(directory: Path, manifest: dict) -> None:
    """Every file of ``directory`` against its checksum; :class:`CheckpointError` on every rank if
    any differs (collective)."""
    files = manifest["files"]
    mine = shares({name: entry["size"] for name, entry in files.items()}, ranks.world_size())[ranks.rank()]

    def check():
        wrong = [m for m in (mismatch(directory, name, files[name]) for name in mine) if m is not None]
        if wrong:
            raise CheckpointError(f"checkpoint {directory} is damaged: files whose content changed since the save "
                                  f"{wrong}; it will not be loaded")

    ranks.agree(check)
