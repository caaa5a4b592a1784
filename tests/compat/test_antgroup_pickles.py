"""ATorch's pickled strategies go through a restricted unpickler that imports nothing a pickle
names: a 20-byte pickle naming torch._inductor forced a 17 s import through getattr(torch, ...)."""

import subprocess
import sys

SCRIPT = """
import pickle, sys
from atorch.compat.antgroup.strategy_io import get_strategy
payload = b"\\x80\\x04\\x8c\\x05torch\\x94\\x8c\\t_inductor\\x94\\x93\\x94."
assert "torch._inductor" not in sys.modules
ok, strategy = get_strategy(payload)
print("ok" if not ok else "loaded", "imported" if "torch._inductor" in sys.modules else "not imported")
"""


def test_a_pickle_naming_a_torch_submodule_imports_nothing():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["not", "imported"], out.stdout
