"""save removes only the leftovers it can prove are its own: the ``.tmp-*``/``.old-*`` folders
whose marker names them. A user's folders beside the checkpoint are never deleted, moved or loaded."""

import shutil

import pytest
import torch

import atorch.checkpoint as ckpt
from atorch.checkpoint import io
from atorch.errors import CheckpointError


def _tree(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_save_removes_only_the_leftovers_it_marked(tmp_path):
    model = torch.nn.Linear(4, 4)
    path = tmp_path / "ck"
    ckpt.save(path, model)
    backup = tmp_path / "ck.old-manual-backup"  # a user's copy of the checkpoint, marker file included
    shutil.copytree(path, backup)
    notes = tmp_path / "ck.tmp-notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    killed = tmp_path / "ck.tmp-0123456789ab"  # what a save killed before its manifest leaves
    killed.mkdir()
    io.mark(killed, killed.name)
    kept = {"backup": _tree(backup), "notes": _tree(notes)}

    ckpt.save(path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.old-manual-backup", "ck.tmp-notes"]
    assert {"backup": _tree(backup), "notes": _tree(notes)} == kept
    # With ck gone, the user's complete copy is not taken for a checkpoint a crash left behind.
    shutil.rmtree(path)
    assert not ckpt.exists(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        ckpt.load(path, model)
    ckpt.save(path, model)
    assert _tree(backup) == kept["backup"] and ckpt.exists(path)


def test_save_does_not_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "table.csv").write_text("a,b\n")
    with pytest.raises(CheckpointError, match="results exists and is not an atorch checkpoint"):
        ckpt.save(tmp_path / "results", torch.nn.Linear(4, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert (tmp_path / "results" / "table.csv").read_text() == "a,b\n"
