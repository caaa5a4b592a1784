import json

import pytest

from atorch.cli.main import main


def test_validate_good_and_bad(tmp_path, capsys):
    assert main(["validate", "strategies/ddp_bf16.json", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "rescaled to 8" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"methods": [{"name": "amp_native", "config": {"dtyp": "bf16"}}]}))
    assert main(["validate", str(bad)]) == 2
    assert "unknown field 'dtyp'" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_explain(tmp_path, capsys):
    from atorch.auto.search.report import CandidateResult, SearchReport

    report = SearchReport(2, "cpu", 2**30, [CandidateResult({"methods": [{"name": "parallel_mode"}]}, "measured",
                                                             1000, None, 900, 12.5)], winner=0)
    report.save(tmp_path / "r.json")
    assert main(["explain", str(tmp_path / "r.json")]) == 0
    assert "parallel_mode" in capsys.readouterr().out


def test_plan_a_small_llama_on_64_simulated_ranks(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}))
    assert main(["plan", "--hf-config", str(config), "--world-size", "64", "--memory", "1MiB",
                 "--batch-size", "64", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "64 x cuda" in out and "parallel_mode + fsdp" in out and "fits" in out and "over budget" in out
