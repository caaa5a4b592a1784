"""Hygiene: a test that leaks a process group or changes the environment fails."""

import logging
import os

import pytest
import torch.distributed as dist

# Set by pytest itself, or by a library as it is first imported or first compiles: torch's
# inductor (its cache folders; the ptxas it found, for Triton, seen on an H200 with torch 2.11)
# and scikit-learn (its OpenMP settings, imported by transformers where it is installed: seen on
# the GPU machine's image). None of them is atorch's to restore.
_NOT_OURS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH",
             "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")


def _env():
    return {k: v for k, v in os.environ.items() if k not in _NOT_OURS}


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """atorch's search results and calibrations go to a folder of the suite's own, out of the
    user's cache; torch's cache (compiled extensions: DeepSpeed's ops) stays where it is, so a run
    does not rebuild them."""
    before = os.environ.get("ATORCH_CACHE_DIR")
    os.environ["ATORCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["ATORCH_CACHE_DIR"]
    else:
        os.environ["ATORCH_CACHE_DIR"] = before


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
