"""Run a function on N real processes over gloo and collect each rank's return value."""

from atorch.distributed.local import LocalRunError, run_local
from tests.helpers.pool import pooled, run_pooled

DEFAULT_TIMEOUT_S = 180


def run_distributed(fn, world_size: int = 2, *args, timeout_s: float = DEFAULT_TIMEOUT_S, fresh: bool = False,
                    **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo processes (one CPU thread each);
    return results by rank.

    ``fn`` must be a module-level function (the processes are spawned). A failure on any rank
    fails the test with that rank's traceback; a hang past ``timeout_s`` kills every rank and
    fails it too. The ranks of a world of 1-4 are kept between runs (tests/helpers/pool.py);
    ``fresh=True`` spawns new ones for a test that needs a process nothing ran in before.
    """
    try:
        if pooled(world_size) and not fresh:
            return run_pooled(fn, world_size, args, kwargs, timeout_s)
        return run_local(fn, world_size, args, kwargs, timeout_s=timeout_s)
    except LocalRunError as error:
        raise AssertionError(str(error)) from None
