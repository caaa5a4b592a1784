"""One pair of 2-process runs shared by the checkpoint tests (each spawn costs about 10 s here)."""

import pytest

from tests.checkpoint import runs
from tests.helpers.dist import run_distributed


@pytest.fixture(scope="package")
def two_ranks(tmp_path_factory):
    """``(directory, first, second)``: every rank's results of :func:`runs.first` (train and save
    under each strategy) and, in new processes, of :func:`runs.second` (load and continue)."""
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("checkpoints")
    first = run_distributed(runs.first, 2, str(directory), timeout_s=400)
    second = run_distributed(runs.second, 2, str(directory), first[0], timeout_s=400)
    return directory, first, second
