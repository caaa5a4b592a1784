"""What keeps `atorch plan` within its start-up budget (under 5 CPU s for a 7B model, measured by
benchmarks/cli_startup.py): it imports little beyond torch, transformers and the model, runs each
distinct activation probe once, and starts with the garbage collector off. Timings are the
benchmark's; these tests check the causes, which do not move with the machine's load."""

import ast
import gc
import json
import subprocess
import sys

import pytest

from atorch.cli.main import main

TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
# What plan imports beyond torch, transformers and the model (its own code and the Strategy's
# pydantic); 11 other modules today (zoneinfo, torch.profiler's pieces)
OWN = ("atorch", "pydantic", "pydantic_core", "annotated_types", "typing_inspection")
MAX_OTHER = 30


def _config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _plan_imports(config: str, *flags: str) -> list[str]:
    """Modules `atorch plan` loads beyond those of building the model with transformers."""
    code = (
        "import json, sys\nimport torch\nfrom transformers import AutoConfig, AutoModelForCausalLM\n"
        f"config = AutoConfig.for_model(**json.load(open({config!r})))\n"
        "with torch.device('meta'):\n    AutoModelForCausalLM.from_config(config)\n"
        "before = set(sys.modules)\nfrom atorch.cli.main import main\n"
        f"assert main(['plan', '--hf-config', {config!r}, '--world-size', '8', *{flags!r}]) == 0\n"
        "print(sorted(set(sys.modules) - before))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_plan_imports_little_beyond_the_model(tmp_path):
    pytest.importorskip("transformers")
    extra = _plan_imports(_config(tmp_path), "--batch-size", "8", "--seq-len", "16")
    assert any(m.startswith("atorch.auto.search") for m in extra)  # the check sees plan's own imports
    other = [m for m in extra if m.split(".")[0] not in OWN]
    assert len(other) < MAX_OTHER, f"atorch plan imports {len(other)} modules beyond its own: {other}"
    heavy = [m for m in extra if m.split(".")[0] in ("deepspeed", "matplotlib", "peft", "fairscale")
             or m.startswith(("torch.distributed.pipelining", "torch._inductor.compile_fx"))]
    assert not heavy, heavy


def test_plan_runs_each_distinct_probe_once(tmp_path, capsys, monkeypatch):
    """72 candidates of a 7B plan ran 120 probes (11 of its 15 CPU s); each distinct one once: 9."""
    pytest.importorskip("transformers")
    from atorch.auto.search import cost

    keys, probe_once = [], cost.probe_once

    def counted(model, strategy, batch, model_input_format, loss_func, device_ctx, stages):
        keys.append(cost.probe_key(strategy, batch, stages))
        return probe_once(model, strategy, batch, model_input_format, loss_func, device_ctx, stages)

    monkeypatch.setattr(cost, "probe_once", counted)
    assert main(["plan", "--hf-config", _config(tmp_path), "--world-size", "8", "--batch-size", "8",
                 "--seq-len", "16"]) == 0
    candidates = int(capsys.readouterr().err.split("[1/")[1].split("]")[0])
    assert len(keys) == len(set(keys)), "a probe ran twice"
    assert 1 < len(keys) < candidates / 3, (len(keys), candidates)


def test_plan_starts_without_the_collector_and_gives_it_back(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import atorch.cli.plan as plan
    from atorch.auto.search import cost

    seen, build_model, probe_once = {}, plan.build_model, cost.probe_once

    def building(*args, **kwargs):
        seen["building"] = gc.isenabled()
        return build_model(*args, **kwargs)

    def probing(*args, **kwargs):
        seen["probing"] = (gc.isenabled(), gc.get_freeze_count() > 0)
        return probe_once(*args, **kwargs)

    monkeypatch.setattr(plan, "build_model", building)
    monkeypatch.setattr(cost, "probe_once", probing)
    assert gc.isenabled()
    assert main(["plan", "--hf-config", _config(tmp_path), "--world-size", "8", "--batch-size", "8",
                 "--seq-len", "16"]) == 0
    assert seen == {"building": False, "probing": (True, True)}
    assert gc.isenabled() and gc.get_freeze_count() == 0
