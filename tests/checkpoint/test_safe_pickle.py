"""The restricted unpickler of DCP metadata: no call outside its allow-list, no import, no instance hook."""

import builtins
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from atorch.checkpoint import safe_pickle
from atorch.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


class _Call:
    """Unpickles as ``call(*args)``."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _payloads(marker: Path) -> dict:
    code = f"open({str(marker)!r}, 'w').write('ran')"
    return {
        "eval": _Call(builtins.eval, code),
        "exec": _Call(builtins.exec, code),
        "compile": _Call(builtins.compile, code, "x", "exec"),
        "__import__": _Call(builtins.__import__, "os"),
        "open": _Call(builtins.open, str(marker), "w"),
        "getattr": _Call(builtins.getattr, "text", "upper"),
        "setattr": _Call(builtins.setattr, Metadata, "x", 1),
        "os.system": _Call(os.system, f"touch {marker}"),
        "subprocess.Popen": _Call(subprocess.Popen, ["touch", str(marker)]),
        "breakpoint": _Call(builtins.breakpoint),
    }


@pytest.mark.parametrize("kind", sorted(_payloads(Path("x"))))
def test_no_callable_outside_the_allow_list_runs(tmp_path, kind):
    """The standard unpickler runs each of these; the restricted one refuses each by name.
    (Negative control: with ``builtins.eval`` added to ``_GLOBALS``/``_CALLABLE`` the eval case fails.)"""
    marker = tmp_path / "ran"
    data = pickle.dumps(_payloads(marker)[kind])
    with pytest.raises(CheckpointError, match="refused global"):
        safe_pickle.loads(data, "crafted")
    assert not marker.exists()
    assert not hasattr(Metadata, "x")


def test_a_named_submodule_is_never_imported():
    """``torch._inductor`` named by a 20-byte pickle: refused without importing it (it took 17 s)."""
    payload = b"\x80\x02ctorch\n_inductor\n."
    code = ("import sys; from atorch.checkpoint import safe_pickle\n"
            "try:\n    safe_pickle.loads(%r, 'crafted')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "print('imported' if 'torch._inductor' in sys.modules else 'not imported')" % payload)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120).stdout
    assert "CheckpointError" in out and "refused global torch._inductor" in out, out
    assert out.strip().endswith("not imported"), out


def test_a_build_never_calls_a_setstate_an_earlier_build_put_on_the_instance():
    # NEWOBJ BytesStorageMetadata(); BUILD {"__setstate__": Metadata}; BUILD {"a": 1}: pickle's own
    # load_build calls instance.__setstate__(state), here Metadata({"a": 1}).
    data = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\n)\x81"
            b"}X\x0c\x00\x00\x00__setstate__ctorch.distributed.checkpoint.metadata\nMetadata\nsb"
            b"}X\x01\x00\x00\x00aK\x01sb.")
    with pytest.raises(CheckpointError, match=r"refused state keys \['__setstate__'\]"):
        safe_pickle.loads(data, "crafted")
    assert "__setstate__" not in vars(BytesStorageMetadata)


def test_real_metadata_still_reads(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3), "obj": {"step": 1}}, checkpoint_id=tmp_path, no_dist=True)
    metadata = safe_pickle.loads((tmp_path / ".metadata").read_bytes(), "real")
    assert set(metadata.state_dict_metadata) >= {"w"}
    assert metadata.state_dict_metadata["w"].properties.dtype == torch.float32
