"""Reading a checkpoint cannot run code, and a byte changed anywhere is refused (one process)."""

import json
import os
import pickle
import shutil

import pytest
from torch.distributed.checkpoint.metadata import Metadata

import atorch.checkpoint as ckpt
from atorch.checkpoint import io, safe_pickle
from atorch.errors import CheckpointError
from tests.checkpoint.faults import differences, flip, forge_manifest, snapshot
from tests.checkpoint.jobs import build, train


class _Payload:
    """Unpickles as ``call(arg)``."""

    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return self.call, (self.arg,)


PAYLOADS = {
    "os.system": lambda marker: _Payload(os.system, f"touch {marker}"),
    "exec": lambda marker: _Payload(exec, f"open({str(marker)!r}, 'w').write('ran')"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    result = build("single")
    train(result, 2)
    path = tmp_path_factory.mktemp("saved") / "ck"
    ckpt.save(path, result.model, result.optim, result.lr_scheduler, result.dataloader, extra={"step": 2})
    return path


@pytest.fixture(scope="module")
def target():
    result = build("single", seed=5)
    train(result, 1)
    return result


def _load(path, result):
    return ckpt.load(path, result.model, result.optim, result.lr_scheduler, result.dataloader)


@pytest.mark.parametrize("forged", [False, True], ids=["manifest_as_saved", "manifest_forged"])
@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_a_pickle_payload_in_the_metadata_never_runs(saved, target, tmp_path, kind, forged):
    pickle.loads(pickle.dumps(PAYLOADS[kind](tmp_path / "proof")))
    assert (tmp_path / "proof").exists()  # the standard unpickler runs it
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    marker = tmp_path / "ran"
    payload = pickle.dumps(PAYLOADS[kind](marker))
    size = (path / ".metadata").stat().st_size
    (path / ".metadata").write_bytes(payload + b" " * (size - len(payload)))  # same size, as in the audit
    if forged:  # whoever shares a hostile checkpoint can rewrite its checksums too
        forge_manifest(path)
    before = snapshot(target)
    assert not ckpt.exists(path)
    refused = r"refused global (posix\.system|builtins\.exec)" if forged else r"changed since the save.*\.metadata"
    with pytest.raises(CheckpointError, match=refused):
        _load(path, target)
    assert not marker.exists()
    assert not differences(before, snapshot(target))


def test_the_metadata_reader_builds_no_other_object_and_patches_no_class():
    patch = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x03\x00\x00\x00abcK\x01s\x86b."
    with pytest.raises(CheckpointError, match="refused to set the state of a type"):
        safe_pickle.loads(patch, "crafted")
    assert not hasattr(Metadata, "abc")
    with pytest.raises(CheckpointError, match="refused global builtins.getattr"):
        safe_pickle.loads(pickle.dumps(getattr), "crafted")
    with pytest.raises(CheckpointError, match="it holds a dict, not a Metadata"):
        safe_pickle.loads(pickle.dumps({"state_dict_metadata": {}}), "crafted")


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", io.MANIFEST])
def test_same_size_byte_flips_in_every_file_are_refused(saved, target, tmp_path, name):
    size = (saved / name).stat().st_size
    before = snapshot(target)
    for where in (0, 9, size // 3, size // 2, size - 2):
        path = tmp_path / f"ck_{where}"
        shutil.copytree(saved, path)
        flip(path / name, where)
        with pytest.raises(CheckpointError, match=r"changed since the save|cannot be read.*corrupt"):
            _load(path, target)
    assert not differences(before, snapshot(target))


@pytest.mark.parametrize("edit", ["world_size", "checksum", "size"])
def test_an_edited_manifest_is_refused(saved, target, tmp_path, edit):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    text = (path / io.MANIFEST).read_text()
    if edit == "world_size":
        text = text.replace('"world_size": 1', '"world_size": 2')
    else:
        key = '"sha256": "' if edit == "checksum" else '"size": '
        at = text.index(key) + len(key)
        text = text[:at] + ("1" if text[at] != "1" else "2") + text[at + 1:]  # same size, still valid JSON
    (path / io.MANIFEST).write_text(text)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="altered after the save"):
        _load(path, target)
    assert not differences(before, snapshot(target))


def test_garbled_metadata_is_a_checkpoint_error_even_with_a_matching_manifest(saved, target, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    flip(path / ".metadata", 10)  # the top byte of the first frame's length
    with pytest.raises(OverflowError):
        pickle.loads((path / ".metadata").read_bytes())  # what torch's reader raised
    forge_manifest(path)
    with pytest.raises(CheckpointError, match=r"\.metadata is not valid torch.distributed.checkpoint metadata"):
        _load(path, target)


def _version_1(path):
    manifest = json.loads((path / io.MANIFEST).read_text())
    manifest = {**manifest, "version": 1, "files": {k: v["size"] for k, v in manifest["files"].items()}}
    del manifest[io.SELF_CHECK]
    (path / io.MANIFEST).write_text(json.dumps(manifest))


def test_a_version_1_checkpoint_loads_only_when_allowed(saved, tmp_path, caplog):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    _version_1(path)
    result = build("single", seed=5)
    before = snapshot(result)
    with pytest.raises(CheckpointError, match=r"without checksums \(manifest version 1\).*allow_unverified=True"):
        _load(path, result)
    assert not differences(before, snapshot(result))
    with caplog.at_level("WARNING", logger="atorch"):
        assert ckpt.load(path, result.model, result.optim, result.lr_scheduler, result.dataloader,
                         allow_unverified=True) == {"step": 2}
    assert "sizes checked only" in caplog.text


def test_a_version_2_entry_without_its_checksum_is_refused(saved, target, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    manifest = json.loads((path / io.MANIFEST).read_text())
    name = next(n for n in manifest["files"] if n.endswith(".distcp"))
    del manifest["files"][name]["sha256"]
    manifest[io.SELF_CHECK] = io._self_digest(manifest)  # whoever dropped it can fix the manifest's own checksum too
    (path / io.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"lists files without a checksum \['{name}'\]"):
        _load(path, target)


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_part_that_is_a_symlink_is_refused(saved, target, tmp_path, name):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    outside = tmp_path / "outside"
    shutil.copy(path / name, outside)  # same bytes: size and checksum match
    (path / name).unlink()
    (path / name).symlink_to(outside)
    before = snapshot(target)
    assert not ckpt.exists(path)
    with pytest.raises(CheckpointError, match=rf"links, not regular files inside the checkpoint folder \['{name}'\]"):
        _load(path, target)
    assert not differences(before, snapshot(target))


def test_the_checkpoint_folder_itself_may_be_a_link(saved, tmp_path):
    (tmp_path / "latest").symlink_to(saved)
    assert ckpt.load(tmp_path / "latest", build("single", seed=5).model) == {"step": 2}
