"""The ``atorch`` logger: standard :mod:`logging`, records from rank 0 only by default.

Applications configure it like any logger (``logging.getLogger("atorch")``). Call
:func:`log_on_all_ranks` to see every rank's records, which helps when one rank misbehaves.
"""

import contextlib
import logging
import os

logger = logging.getLogger("atorch")

_ALL_RANKS = False


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _ALL_RANKS:
            record.msg = f"[rank {_current_rank()}] {record.msg}"
            return True
        return _current_rank() == 0


def log_on_all_ranks(enabled: bool = True) -> None:
    """Let records from every rank through (prefixed with the rank), or only rank 0's again."""
    global _ALL_RANKS
    _ALL_RANKS = enabled


_QUIET: list[int] = []  # the levels of the quiet() blocks we are in


class _QuietFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _QUIET or record.levelno >= max(_QUIET)


@contextlib.contextmanager
def quiet(level: int = logging.WARNING):
    """Only records at ``level`` or above while inside (the search's trial applications). A filter
    on the logger, not its level: ``setLevel`` clears every logger's cache, and a plan enters this
    block thousands of times."""
    _QUIET.append(level)
    try:
        yield
    finally:
        _QUIET.pop()


def _install_default_handler() -> None:
    # A library normally leaves handlers to the application; we add one (only if nobody has
    # configured the atorch logger) because dropped or adjusted methods must never be invisible.
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[atorch %(levelname)s] %(message)s"))
    handler.addFilter(_RankZeroFilter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_install_default_handler()
logger.addFilter(_QuietFilter())
