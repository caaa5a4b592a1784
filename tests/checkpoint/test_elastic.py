"""examples/elastic_train.py under torchrun: a rank killed mid-run, the job restarts from the
last checkpoint and ends exactly where an uninterrupted run of the same job ends."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]


def _run(ckpt_dir: Path, *flags: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = TORCHRUN + ["examples/elastic_train.py", "--ckpt-dir", str(ckpt_dir), "--steps", "12", "--save-every", "4",
                       "--timeout", "60", *flags]
    # Its own session, so a timeout ends torchrun's workers too, not only torchrun.
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish in 400 s:\n{out}") from None
    assert proc.returncode == 0, out
    return out


def _losses(out: str) -> dict[int, str]:
    """The loss printed for each step (the last attempt's, where a step ran twice)."""
    return {int(step): loss for step, loss in re.findall(r"step +(\d+) loss (\d+\.\d+)", out)}


def test_killed_rank_restarts_from_the_last_checkpoint_and_finishes_the_same(tmp_path, two_ranks):
    interrupted = _run(tmp_path / "interrupted", "--kill-at-step", "6")
    assert "exitcode: -9" in interrupted  # rank 1 really died by SIGKILL
    assert re.search(r"attempt 1: resumed from step 4", interrupted), interrupted
    assert len(re.findall(r"step +5 loss", interrupted)) == 2  # steps 5 and 6 ran again after the restart
    # The same job run straight through, on 2 processes (in the shared runs of conftest.py).
    straight = {step: f"{loss:.7f}" for step, loss in two_ranks[1][0]["elastic"].items()}
    assert _losses(interrupted) == straight and len(straight) == 12
    assert re.search(r"final loss (\d+\.\d+)", interrupted).group(1) == straight[12]
