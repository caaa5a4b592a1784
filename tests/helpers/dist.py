"""Run a function on N real processes over gloo and collect each rank's return value."""

from atorch.distributed.local import LocalRunError, run_local

DEFAULT_TIMEOUT_S = 180


def run_distributed(fn, world_size: int = 2, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo processes (one CPU thread each);
    return results by rank.

    ``fn`` must be a module-level function (the processes are spawned). A failure on any rank
    fails the test with that rank's traceback; a hang past ``timeout_s`` kills every rank and
    fails it too.
    """
    try:
        return run_local(fn, world_size, args, kwargs, timeout_s=timeout_s)
    except LocalRunError as error:
        raise AssertionError(str(error)) from None
