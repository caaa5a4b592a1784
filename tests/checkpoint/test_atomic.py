"""A crash during save never loses the last good checkpoint; damaged checkpoints are refused."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import atorch.checkpoint as ckpt
from atorch.errors import CheckpointError
from tests.checkpoint.jobs import build, full_weights

ROOT = Path(__file__).resolve().parents[2]


def _crash(directory: Path, where: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.checkpoint.crash_job", str(directory), where], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


def _loaded_weights(path):
    result = build("single", seed=5)
    extra = ckpt.load(path, result.model, result.optim)
    return extra, full_weights(result)


def _assert_same(weights, expected):
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key


def test_killed_while_writing_keeps_the_previous_checkpoint(tmp_path):
    _crash(tmp_path, "writing")
    partial = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")]
    assert len(partial) == 1 and any(p.suffix == ".distcp" for p in partial[0].iterdir())
    extra, weights = _loaded_weights(tmp_path / "ckpt")
    assert extra == {"step": 2}
    _assert_same(weights, torch.load(tmp_path / "first.pt"))
    with pytest.raises(CheckpointError, match=r"ckpt\.tmp-.*not a complete atorch checkpoint.*atorch_checkpoint\.json is missing"):
        _loaded_weights(partial[0])
    # The next save clears what the crash left.
    result = build("single")
    ckpt.save(tmp_path / "ckpt", result.model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "first.pt", "second.pt"]


def test_killed_between_the_renames_loads_the_newest_complete_checkpoint(tmp_path):
    _crash(tmp_path, "publishing")
    assert not (tmp_path / "ckpt").exists()  # moved aside, the new one not yet in its place
    extra, weights = _loaded_weights(tmp_path / "ckpt")
    assert extra == {"step": 4}
    _assert_same(weights, torch.load(tmp_path / "second.pt"))
    assert ckpt.exists(tmp_path / "ckpt")
    result = build("single")
    ckpt.save(tmp_path / "ckpt", result.model)  # puts it back in place first, then replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "first.pt", "second.pt"]


def test_damaged_checkpoints_are_refused_before_anything_changes(tmp_path):
    result = build("single")
    ckpt.save(tmp_path / "good", result.model, result.optim)
    shard = next((tmp_path / "good").glob("*.distcp"))
    before = full_weights(result)

    target = build("single", seed=5)
    untouched = full_weights(target)
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=rf"good is damaged: truncated or altered files \['{shard.name}"):
        ckpt.load(tmp_path / "good", target.model, target.optim)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"good is damaged: missing files \['{shard.name}'\]"):
        ckpt.load(tmp_path / "good", target.model, target.optim)
    _assert_same(full_weights(target), untouched)
    assert not ckpt.exists(tmp_path / "good")

    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere"):
        ckpt.load(tmp_path / "nowhere", target.model)
    ckpt.save(tmp_path / "weights_only", result.model)
    with pytest.raises(CheckpointError, match="has no optimizer state .*pass optim=None"):
        ckpt.load(tmp_path / "weights_only", target.model, target.optim)
    with pytest.raises(CheckpointError, match="holds no lr_scheduler state"):
        ckpt.load(tmp_path / "weights_only", target.model, lr_scheduler=target.lr_scheduler)
    ckpt.load(tmp_path / "weights_only", target.model)
    _assert_same(full_weights(target), before)


def test_extra_must_be_plain_data(tmp_path):
    result = build("single")
    with pytest.raises(CheckpointError, match="extra holds objects other than tensors"):
        ckpt.save(tmp_path / "c", result.model, extra={"loss_func": torch.nn.MSELoss()})
    assert not (tmp_path / "c").exists()
