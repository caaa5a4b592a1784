"""A finished job exits 0: examples/elastic_train.py run to its end, and started again after it
finished (torchrun restarts a job whose rank failed late; a user reruns a command).

Before: a restart of a finished run failed with ``KeyError: 12`` (no step ran, and the last
line read the loss of the last step), and about 3 runs in 16 ended with SIGABRT ("terminate
called without an active exception") because ranks destroyed their process group while a peer
was still finishing; torchrun then reported the finished job as failed. atorch.shutdown() meets
the other ranks first. With that alone about 1 run in 90 still aborted: the group, held by default
arguments of torch modules imported after it started, outlived destroy_process_group with its
gloo threads; shutdown() now releases it (tests/distributed/test_shutdown.py). Run the slow test
in batches with ATORCH_CLEAN_EXIT_RUNS=10 where a machine is shared.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _run(ckpt_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = TORCHRUN + ["examples/elastic_train.py", "--ckpt-dir", str(ckpt_dir), "--steps", "8", "--save-every", "4",
                       "--strategy", "ddp", "--timeout", "60"]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the default suite stays under 15 minutes; run with -m slow
def test_a_finished_job_started_again_exits_0(tmp_path):
    first = _run(tmp_path / "ck")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "done: 8 steps" in first.stdout
    again = _run(tmp_path / "ck")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 8" in again.stdout and "nothing to train" in again.stdout
    assert "step    1" not in again.stdout  # it trained nothing


RUNS = int(os.environ.get("ATORCH_CLEAN_EXIT_RUNS", "50"))


@pytest.mark.slow
def test_consecutive_runs_all_exit_0(tmp_path):
    """``ATORCH_CLEAN_EXIT_RUNS`` (default 50) runs in a row, each saving twice; every one exits 0."""
    failures = []
    for i in range(RUNS):
        proc = _run(tmp_path / f"ck{i}")
        if proc.returncode != 0:
            failures.append((i, proc.returncode, (proc.stdout + proc.stderr)[-2000:]))
    assert not failures, f"{len(failures)} of {RUNS} runs failed; first: {failures[0]}"
