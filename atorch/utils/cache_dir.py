"""Where atorch keeps what it remembers between runs (search results, calibrated rates)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """``$ATORCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/atorch``, else ``~/.cache/atorch``.

    ``ATORCH_CACHE_DIR`` moves only atorch's own files: XDG_CACHE_HOME also moves torch's
    (its compiled extensions among them), which then rebuild.
    """
    own = os.environ.get("ATORCH_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "atorch"
