"""Loading the method registry (what `atorch validate` and `atorch explain` of a strategy file do)
imports no torch._dynamo, torch.distributed.tensor or pipelining: they cost about 1 s (issue 40)."""

import ast
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.pipelining", "torch.distributed.fsdp")


def _heavy_after(code: str) -> list[str]:
    check = f"import sys\n{code}\nprint([m for m in {HEAVY!r} if m in sys.modules])\n"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_registry_and_validate_do_not_import_dynamo_or_dtensor():
    code = ("import atorch.methods\n"
            "from atorch.auto.registry import method_names\n"
            "assert 'fsdp' in method_names() and 'ds_3d_parallel' in method_names()\n"
            "from atorch.cli.main import main\n"
            "assert main(['validate', 'strategies/fsdp_bf16_checkpoint.json', '--world-size', '8']) == 0\n"
            "assert main(['explain', 'strategies/zero2_checkpoint.json']) == 0\n")
    assert _heavy_after(code) == []


def test_the_check_sees_a_heavy_import():
    # The same check reports a module once it is loaded: it is not vacuous (a stand-in, no 2 s import).
    assert _heavy_after("sys.modules['torch._dynamo'] = sys") == ["torch._dynamo"]
