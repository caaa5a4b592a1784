"""Hygiene: a test that leaks a process group or changes the environment fails."""

import logging
import os

import pytest
import torch.distributed as dist

# Set by pytest itself, or by torch the first time inductor is imported (a cache location).
_NOT_OURS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _env():
    return {k: v for k, v in os.environ.items() if k not in _NOT_OURS}


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Search results are cached under XDG_CACHE_HOME: keep the suite's out of the user's cache."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def _hygiene():
    env_before = _env()
    yield
    leaked_group = dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    env_after = _env()
    changed = {k for k in set(env_before) | set(env_after) if env_before.get(k) != env_after.get(k)}
    for key in changed:
        if key in env_before:
            os.environ[key] = env_before[key]
        else:
            del os.environ[key]
    assert not leaked_group, "the test left a process group initialized"
    assert not changed, f"the test changed environment variables {sorted(changed)}"


@pytest.fixture
def atorch_logs():
    """Records of the ``atorch`` logger (it does not propagate to the root logger)."""
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Collect(level=logging.DEBUG)
    logger = logging.getLogger("atorch")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def messages(records) -> str:
    return "\n".join(record.getMessage() for record in records)
