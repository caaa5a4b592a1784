"""The README's main job, run the way users run it (torchrun, 2 gloo processes)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atorch.auto import Strategy

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _run(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_llama_example(tmp_path, nproc):
    pytest.importorskip("transformers")
    saved = tmp_path / "applied.json"
    out = _run(
        TORCHRUN + ["--nproc_per_node", str(nproc), "--standalone", "examples/train_llama.py",
                    "--steps", "12", "--save-strategy", str(saved)],
        tmp_path,
    )
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3, out
    applied = Strategy.load(saved)
    expected = ["parallel_mode", "amp_native", "checkpoint"] if nproc == 2 else ["amp_native", "checkpoint"]
    assert applied.opt_names == expected
    assert f"world size {nproc}" in out
