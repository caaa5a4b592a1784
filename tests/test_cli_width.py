"""What the atorch command prints fits the terminal: every line of a search report (`explain`),
`plan` (with `--batch-size`, and `--search`) and `validate` within 80 and 120 columns (COLUMNS),
and no word cut to get there: the same words at both widths."""

import re
from pathlib import Path

import pytest

from atorch.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "docs" / "plans" / "llama7b.json")
# words a table's header adds where it is printed as columns, or a narrow one's blocks repeat
LAYOUT_WORDS = {"layout", "strategy", "status", "samples/s", "est.", "peak", "verdict", "rank", "methods",
                "GiB/rank", "step", "s", "tok/s/GPU", "MFU", "weights", "grads", "optim", "gathered", "buckets",
                "states", "acts"}


def _words(text: str) -> set[str]:
    return {word.strip("[]();,:") for word in text.split()} - {""}


def _rendered(argv, monkeypatch, capsys) -> dict[int, str]:
    out = {}
    for width in (80, 120):
        monkeypatch.setenv("COLUMNS", str(width))
        assert main(argv) == 0
        out[width] = capsys.readouterr().out
        too_long = [line for line in out[width].splitlines() if len(line) > width]
        assert not too_long, (width, too_long[:3])
    narrow, wide = _words(out[80]), _words(out[120])
    assert not (narrow - wide - LAYOUT_WORDS) and not (wide - narrow - LAYOUT_WORDS), (narrow ^ wide) - LAYOUT_WORDS
    return out


def test_a_search_report_fits_both_widths_with_every_name_whole(tmp_path, monkeypatch, capsys):
    from tests.auto.search.replay import replay

    replay("tests-tiny-budget", tmp_path)  # a pipeline, amp, accumulation x4, long reasons
    out = _rendered(["explain", str(tmp_path / "tests-tiny-budget.json")], monkeypatch, capsys)
    for text in out.values():
        assert "gradient_accumulation" in text and "pipeline_parallel" in text
        assert not re.search(r"\bgra\s*$|\bdient_", text, re.M)  # the cut the report once made


def test_plan_with_a_batch_and_validate_fit_both_widths(monkeypatch, capsys):
    pytest.importorskip("transformers")
    plan = _rendered(["plan", "--hf-config", LLAMA, "--world-size", "64", "--memory", "80GiB", "--batch-size", "64",
                      "--seq-len", "128"], monkeypatch, capsys)
    assert all("gradient_accumulation" in text and "fits" in text for text in plan.values())
    checked = _rendered(["validate", str(ROOT / "strategies" / "zero2_checkpoint.json"), "--hf-config", LLAMA,
                         "--world-size", "8"], monkeypatch, capsys)
    assert all("valid" in text for text in checked.values())


def test_plan_search_fits_both_widths(tmp_path, monkeypatch, capsys):
    from tests.test_cli_plan_search import _tiny_llama

    config = _tiny_llama(tmp_path)
    out = _rendered(["plan", "--search", "--profile", "h100_80gb", "--memory", "60MiB", "--hf-config", config,
                     "--world-size", "8", "--batch-size", "8", "--seq-len", "64"], monkeypatch, capsys)
    assert all("layouts that fit, fastest first" in text for text in out.values())


def test_json_is_not_folded(tmp_path, monkeypatch, capsys):
    import json

    from tests.test_cli_plan_search import _tiny_llama

    monkeypatch.setenv("COLUMNS", "80")
    config = _tiny_llama(tmp_path, layers=2, hidden=128)
    assert main(["plan", "--search", "--profile", "h100_80gb", "--hf-config", config, "--world-size", "2",
                 "--batch-size", "2", "--seq-len", "32", "--json"]) == 0
    json.loads(capsys.readouterr().out)


def test_every_rule_the_report_counts_is_defined_in_the_docs():
    from atorch.auto.search import candidate, stop

    rules = {value for name, value in vars(candidate).items() if name.isupper() and isinstance(value, str)
             and value.islower() and " " not in value}
    rules |= {stop.CANNOT_FIT, stop.CANNOT_WIN, "conflicting"}
    glossary = (ROOT / "docs" / "search.md").read_text().split("### The report's words", 1)[1].split("## ", 1)[0]
    words = glossary.replace(",", " |").split("|")
    missing = [rule for rule in sorted(rules) if not any(w.strip() == rule.replace("_", " ") for w in words)]
    assert not missing, missing
