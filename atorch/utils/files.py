"""Writing small files (strategies, reports) safely from every rank of a job at once."""

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one.

    The text goes to a temporary file with a unique name beside ``path`` (so ``os.replace`` stays
    on one file system) and then replaces ``path``. Every rank of a job may call this for the same
    path at the same time: each writes its own temporary file and the last replace wins. (A fixed
    ``path + ".tmp"`` name is shared by the ranks: one rank's replace moves the file another rank
    is about to replace, which fails with FileNotFoundError.)

    Example::

        write_text_atomic("strategy.json", strategy.to_json())
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); a strategy is meant to be read by others.
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
