"""The cost types a method's cost term fills in import nothing of the search or of the methods:
a method's file imports them at its top, and no import circle runs through the registry."""

import subprocess
import sys


def test_the_cost_types_import_nothing_of_the_search_or_the_methods():
    code = ("import sys, atorch.auto.step_cost; "
            "print(sorted(m for m in sys.modules if m.startswith(('atorch.auto.search', 'atorch.methods'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_search_still_names_them():
    from atorch.auto import step_cost
    from atorch.auto.search import cost

    assert cost.StepCost is step_cost.StepCost and cost.Comm is step_cost.Comm
    assert cost.MemoryEstimate is step_cost.MemoryEstimate
