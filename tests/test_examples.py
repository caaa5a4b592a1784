"""The README's main job, run the way users run it (torchrun, gloo)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atorch.auto import Strategy
from atorch.auto.search.report import SearchReport

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _run(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _losses(out):
    losses = [float(x) for x in re.findall(r"step +\d+ +loss (\d+\.\d+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3, out
    return losses


def test_main_job_searches_then_trains_on_2_processes(tmp_path):
    pytest.importorskip("transformers")
    saved, report = tmp_path / "best.json", tmp_path / "report.json"
    out = _run(TORCHRUN + ["--nproc_per_node", "2", "examples/train_llama.py", "--steps", "12",
                           "--save-strategy", str(saved), "--report", str(report)])
    _losses(out)
    assert "atorch search:" in out and "measured" in out
    applied = Strategy.load(saved)
    assert applied.opt_names[0] == "parallel_mode"
    loaded = SearchReport.load(report)
    assert loaded.candidates[loaded.winner].names == applied.opt_names


@pytest.mark.slow  # -m slow; by default: tests/methods/test_expert_parallel.py trains expert_parallel
def test_moe_example_spreads_the_experts_and_trains():
    pytest.importorskip("transformers")
    out = _run(TORCHRUN + ["--nproc_per_node", "2", "examples/train_moe.py", "--steps", "12"])
    _losses(out)
    assert out.count("2 of 4 experts a block") == 2, out  # each rank holds its half


def test_strategy_file_on_one_process(tmp_path):
    pytest.importorskip("transformers")
    saved = tmp_path / "applied.json"
    out = _run(TORCHRUN + ["--nproc_per_node", "1", "examples/train_llama.py", "--steps", "12",
                           "--strategy", "strategies/ddp_bf16_checkpoint.json", "--save-strategy", str(saved)])
    _losses(out)
    assert Strategy.load(saved).opt_names == ["amp_native", "checkpoint"]
    assert "world size 1" in out


@pytest.mark.slow  # the default suite stays under 15 minutes; run with -m slow
def test_gpt2_walkthrough_accumulates_logs_and_resumes(tmp_path):
    """examples/finetune_gpt2.py, the job docs/user_guide.md walks: a ready strategy file, gradient
    accumulation, the step line, a checkpoint the next run resumes from."""
    pytest.importorskip("transformers")
    job = TORCHRUN + ["--nproc_per_node", "2", "examples/finetune_gpt2.py", "--strategy",
                      "strategies/fsdp_bf16_checkpoint.json", "--accumulation", "2", "--log-every", "2",
                      "--ckpt-dir", str(tmp_path / "ck")]
    out = _run(job + ["--steps", "10"])
    _losses(out)
    assert re.search(r"step +10  loss \d+\.\d+  [\d.]+ samples/s  peak [\d.]+[GMK]iB", out), out
    assert "checkpoint saved to" in out
    resumed = _run(job + ["--steps", "12"])
    steps = [int(s) for s in re.findall(r"step +(\d+)  loss", resumed)]
    assert steps == [12], resumed  # steps 11 and 12 only: it went on from the checkpoint
