import json

import pytest

from atorch.cli.main import main


def test_help_and_the_parser_import_no_torch():
    """`atorch --help` took 2.2 s, nearly all of it importing torch through atorch/__init__."""
    import subprocess
    import sys

    code = ("import sys\nfrom atorch.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'pydantic') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "validate" in done.stdout and "plan" in done.stdout


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
                                                             estimated_peak_bytes=1000, measured_peak_bytes=900,
                                                             throughput=12.5)], winner=0)
    report.save(tmp_path / "r.json")
    assert main(["explain", str(tmp_path / "r.json")]) == 0
    assert "parallel_mode" in capsys.readouterr().out


LONG_REASON = ("estimated 9.1GiB is over the 4.0GiB budget by more than the estimate's known error "
               "(estimates run 0.8-1.25x the measured peak); add checkpoint or shard the optimizer state "
               "with zero1, zero2 or fsdp")


def _report_with_a_long_reason():
    from atorch.auto.search.report import CandidateResult, SearchReport

    breakdown = {"params": 2**30, "grads": 2**30, "optim_state": 2 * 2**30, "gathered": 0,
                 "activations": 5 * 2**30, "step_temp": 0, "forward_flops": 1.5e12, "total": 9 * 2**30}
    pruned = CandidateResult({"methods": [{"name": "parallel_mode"}]}, "pruned", 9 * 2**30, breakdown,
                             reason=LONG_REASON)
    measured = CandidateResult({"methods": [{"name": "parallel_mode"}, {"name": "fsdp"}]}, "measured",
                               3 * 2**30, {**breakdown, "activations": 2**30, "total": 3 * 2**30},
                               measured_peak_bytes=3 * 2**30, throughput=12.5)
    return SearchReport(2, "cpu", 4 * 2**30, [pruned, measured], winner=1)


def _words(text):
    return " ".join(text.split())


def test_report_table_shows_the_whole_reason_wrapped():
    table = _report_with_a_long_reason().table(all_rows=True)
    # Before: cut at 70 characters ("...known error (es").
    assert LONG_REASON in _words(table)
    lines = table.splitlines()
    reason_column = lines[1].index("status")
    assert max(len(line) for line in lines) <= 120  # before: up to 219 characters
    # The reason continues on the next lines, under its column.
    pruned_row = next(i for i, line in enumerate(lines) if " pruned: " in line)
    for continuation in lines[pruned_row + 1:pruned_row + 3]:
        assert continuation[:reason_column].strip() == "" and continuation[reason_column] != " "


def test_a_long_strategy_name_wraps_within_120_columns():
    from atorch.auto.search.report import CandidateResult, SearchReport

    names = [("parallel_mode", {}), ("checkpoint", {"selective": True}), ("zero1", {}),
             ("gradient_accumulation", {"steps": 4}), ("amp_native", {})]
    report = SearchReport(2, "cpu", 2**30, winner=0)
    for count in (5, 2):
        strategy = {"format": "atorch-strategy", "version": 1,
                    "methods": [{"name": n, "config": c} for n, c in names[:count]]}
        report.candidates.append(CandidateResult(strategy, status="measured", throughput=1400.0 + count,
                                                 throughput_range=[1356.0, 1447.0], layout="pipeline=2, microbatches=4",
                                                 estimated_step_seconds=0.005, estimated_peak_bytes=6 * 2**20,
                                                 measured_peak_bytes=6 * 2**20))
    report.global_batch = 16
    lines = report.table().splitlines()
    assert max(len(line) for line in lines) <= 120  # before: 137 on the README example's search
    # every method name is there whole, the long one over two lines under its column
    assert "gradient_accumulation x4" in _words(report.table())
    column = next(line for line in lines if line.lstrip().startswith("strategy")).index("strategy")
    first = next(i for i, line in enumerate(lines) if line.startswith("*"))
    assert lines[first + 1][:column].strip() == "" and lines[first + 1][column] != " "


def test_explain_shows_whole_reasons_and_the_estimate_breakdown(tmp_path, capsys):
    _report_with_a_long_reason().save(tmp_path / "r.json")
    assert main(["explain", str(tmp_path / "r.json")]) == 0
    short = capsys.readouterr().out  # the pruned candidate grouped by its rule, without its reason
    assert LONG_REASON not in _words(short) and "pruned, other (1): parallel_mode" in short
    assert "atorch explain REPORT --all" in short
    assert main(["explain", str(tmp_path / "r.json"), "--all"]) == 0
    out = capsys.readouterr().out
    assert LONG_REASON in _words(out)
    # The terms the JSON holds, per candidate, in GiB (before: only the peak).
    assert ("parallel_mode: params 1.0GiB, grads 1.0GiB, optim_state 2.0GiB, gathered 0B, activations 5.0GiB, "
            "step_temp 0B, forward_flops 1.5e+12 FLOP, total 9.0GiB") in _words(out)  # folded within 120 columns
    assert "parallel_mode + fsdp: params 1.0GiB" in out


def test_explain_a_strategy_file(tmp_path, capsys):
    # Before: SearchReport.__init__() got an unexpected keyword argument 'format'.
    assert main(["explain", "strategies/zero2_checkpoint.json"]) == 0
    out = capsys.readouterr().out
    assert "a strategy file (4 methods)" in out and "whose Adam state does not" in out
    assert out.index("1. parallel_mode") < out.index("2. amp_native") < out.index("3. checkpoint") < out.index("4. zero2")
    assert "atorch validate strategies/zero2_checkpoint.json" in out
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"loss": [1.0]}))
    assert main(["explain", str(other)]) == 2
    assert "is not an atorch search report" in capsys.readouterr().err


def test_plan_a_small_llama_on_64_simulated_ranks(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}))
    assert main(["plan", "--hf-config", str(config), "--world-size", "64", "--memory", "1MiB",
                 "--batch-size", "64", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "64 x cuda" in out and "parallel_mode + fsdp" in out and "fits" in out and "over budget" in out


def _write(path, methods, **top):
    path.write_text(json.dumps({"format": "atorch-strategy", "version": 1, **top, "methods": methods}))
    return str(path)


def test_validate_reports_every_problem_in_one_run(tmp_path, capsys):
    path = _write(tmp_path / "bad.json", [
        {"name": "parallel_mode"},
        {"name": "amp_native", "config": {"dtyp": "bf16"}},
        {"name": "zero3"},
        {"name": "zero2"},
        {"name": "fsdp"},
        {"name": "zero1"},
    ])
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "5 problems" in err  # before: only the first (the typo) was reported
    assert "method 2: invalid config for method 'amp_native': unknown field 'dtyp'" in err
    assert "method 3: unknown method 'zero3'" in err
    for pair in ("'fsdp' and 'zero2'", "'fsdp' and 'zero1'", "'zero1' and 'zero2'"):
        assert f"methods {pair} cannot be used together" in err


def test_validate_refuses_conflicts_at_any_world_size(tmp_path, capsys):
    path = _write(tmp_path / "zero2_fsdp.json", [{"name": "zero2"}, {"name": "fsdp"}])
    # Before: "valid" unless --world-size was given (one process drops both methods).
    for flags in ([], ["--world-size", "1"], ["--world-size", "8"]):
        assert main(["validate", path, *flags]) == 2
        assert "'fsdp' and 'zero2' cannot be used together" in capsys.readouterr().err
    assert main(["validate", "strategies/zero2_checkpoint.json"]) == 0
    assert "add --world-size N" in capsys.readouterr().out


def _gpt2_config(tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_positions": 64, "n_embd": 32,
                                "n_layer": 2, "n_head": 4}))
    return str(path)


def test_validate_against_a_model_names_the_fix(tmp_path, capsys):
    pytest.importorskip("transformers")
    gpt2 = _gpt2_config(tmp_path)
    assert main(["validate", "strategies/llama_fsdp_bf16_checkpoint.json", "--hf-config", gpt2]) == 2
    err = capsys.readouterr().err
    # Both classes are reported (fsdp's and checkpoint's), each with the fix, and the file's own
    # description says it is for Llama models.
    assert "2 problems" in err and "Llama-family models only" in err
    assert 'write "atorch_wrap_cls": [] to use the model\'s repeated blocks' in err
    assert "write \"wrap_class\": [] to use the model's repeated blocks, found by structure (here ['GPT2Block'])" in err
    # Without a model, the file itself is valid; the generic files are valid against GPT-2.
    assert main(["validate", "strategies/llama_fsdp_bf16_checkpoint.json"]) == 0
    assert main(["validate", "strategies/lora_fsdp_bf16.json", "--hf-config", gpt2, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "against the model" in out and "GPT2Block" in out


def test_validate_lists_three_independent_problems_in_one_run(tmp_path, capsys):
    """A config error, a world-size error and a model error: before, only the first was reported
    (the config error hid the other two), one rerun per fix."""
    pytest.importorskip("transformers")
    gpt2 = _gpt2_config(tmp_path)
    path = _write(tmp_path / "three.json", [
        {"name": "parallel_mode", "config": [[["zero", 3], ["data", 1]], None]},  # 3 does not divide 8
        {"name": "amp_native", "config": {"dtyp": "bf16"}},  # a typo
        {"name": "checkpoint", "config": {"wrap_class": ["LlamaDecoderLayer"]}},  # not in GPT-2
    ])
    assert main(["validate", path, "--hf-config", gpt2, "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err
    assert "1. method 2: invalid config for method 'amp_native': unknown field 'dtyp'" in err
    assert "Fix: rename 'dtyp' to 'dtype'" in err
    assert "2. on 8 ranks:" in err and "multiple of 3" in err
    assert "3. checkpoint: no module of class ['LlamaDecoderLayer'] in the model" in err
    assert 'Fix: write "wrap_class": []' in err  # each problem says how to fix it
    # Each alone is still found alone.
    assert main(["validate", path, "--world-size", "8"]) == 2
    assert "2 problems" in capsys.readouterr().err


def test_validate_checks_the_rest_beside_a_conflict(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = _write(tmp_path / "conflict.json", [
        {"name": "zero2"}, {"name": "fsdp"}, {"name": "checkpoint", "config": {"wrap_class": ["LlamaDecoderLayer"]}}])
    assert main(["validate", path, "--hf-config", _gpt2_config(tmp_path), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "'fsdp' and 'zero2' cannot be used together" in err and "LlamaDecoderLayer" in err


LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2752,
         "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16}


def _plan_rows(out):
    """strategy label -> the GiB figures of its row."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("parallel_mode"):
            label, _, rest = line.partition("  ")
            rows[label.strip()] = [float(x) for x in rest.split()[:-1] if x.replace(".", "").isdigit()]
    return rows


def test_plan_model_states_only_with_units_assumptions_and_progress(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    # Before: --batch-size was required, figures were bare "G", and nothing said what was assumed.
    assert main(["plan", "--hf-config", str(config), "--world-size", "8", "--dtype", "bf16", "--optimizer", "sgd"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "model states only" in out and "all figures: GiB per rank" in out
    assert "weights          2 B/param (bfloat16)" in out
    assert "optimizer state  0 B/param (SGD: 0 states x 2 B)" in out
    assert "[4/4] fsdp" in captured.err  # progress
    rows = _plan_rows(out)
    assert set(rows) == {"parallel_mode", "parallel_mode + zero1", "parallel_mode + zero2", "parallel_mode + fsdp"}
    vocab_matrices = 2 * LLAMA["vocab_size"] * LLAMA["hidden_size"]  # embedding + lm_head
    assert rows["parallel_mode"][0] * 2**30 > 2 * vocab_matrices  # in bf16: 2 B each
    assert rows["parallel_mode + fsdp"][0] == pytest.approx(rows["parallel_mode"][0] / 8, abs=0.01)


def test_plan_deepspeed_accounting_reads_as_deepspeeds_estimator(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    assert main(["plan", "--hf-config", str(config), "--world-size", "8", "--accounting", "deepspeed"]) == 0
    out = capsys.readouterr().out
    assert "accounting: deepspeed" in out and "fp32 master 4" in out
    from tests.auto.test_model_states import HAS_DEEPSPEED, _deepspeed_estimators, _llama

    if not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed: its estimator is the reference")
    zero2, _ = _deepspeed_estimators()
    total = sum(p.numel() for p in _llama().parameters())
    expected = zero2(total, 8, 1, cpu_offload=False)[1] / 2**30
    states = _plan_rows(out)["parallel_mode + zero2"][5]  # weights, grads, optim, gathered, buckets, states
    assert abs(states / expected - 1) < 0.05, (states, expected)


def test_explain_plot_draws_a_report_and_refuses_a_strategy_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report = _report_with_a_long_reason()
    report.candidates[1].estimated_step_seconds = 0.02
    report.save(tmp_path / "r.json")
    image = tmp_path / "r.png"
    assert main(["explain", str(tmp_path / "r.json"), "--plot", str(image)]) == 0
    assert f"plot written to {image}" in capsys.readouterr().out
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 10_000
    assert main(["explain", "strategies/zero2_checkpoint.json", "--plot", str(tmp_path / "s.png")]) == 2
    assert "--plot draws search reports" in capsys.readouterr().err
    assert not (tmp_path / "s.png").exists()


def test_plan_states_only_and_with_a_batch_agree_on_every_state_term(tmp_path, capsys):
    """The states-only table had left out DDP's gradient buckets that the --batch-size table adds
    (25 GiB a rank for 7B): the same strategy read 56.5 and 81.6 GiB of states."""
    pytest.importorskip("transformers")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    assert main(["plan", "--hf-config", str(config), "--world-size", "8"]) == 0
    states = _plan_rows(capsys.readouterr().out)
    assert main(["plan", "--hf-config", str(config), "--world-size", "8", "--batch-size", "8", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    with_batch = _plan_rows(out)
    assert "casts emulated on the meta device" in out  # amp_native's activations on meta (amp/meta_autocast.py)
    for label, figures in states.items():  # weights, grads, optim, gathered, buckets, states
        assert with_batch[label][:6] == figures, label
    assert states["parallel_mode + zero1"][4] > 0  # DDP's buckets


def test_docs_cli_quotes_the_figure_the_tool_prints(capsys):
    """docs/cli.md quoted 34.5 GiB for 7B ZeRO-2 on 8 ranks while the tool printed 39.52."""
    import re
    from pathlib import Path

    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    quoted = re.search(r"ZeRO-2 on 8 ranks that is ([\d.]+) GiB \(atorch\)", (root / "docs" / "cli.md").read_text())
    assert quoted, "docs/cli.md no longer quotes the 7B ZeRO-2 figure this test checks"
    assert main(["plan", "--hf-config", str(root / "docs" / "plans" / "llama7b.json"), "--world-size", "8"]) == 0
    printed = _plan_rows(capsys.readouterr().out)["parallel_mode + zero2"][5]
    assert float(quoted.group(1)) == pytest.approx(printed, abs=0.05)


def test_the_close_call_timed_side_by_side_leads_the_table_in_its_order_there():
    """The README example's search: zero1 read faster in its dry runs, plain data parallelism ran
    5% faster side by side and won; the table put zero1's row first and the pick second."""
    from atorch.auto.search.report import CandidateResult, SearchReport

    def row(names, reading, together=None):
        strategy = {"format": "atorch-strategy", "version": 1, "methods": [{"name": n, "config": {}} for n in names]}
        return CandidateResult(strategy, status="measured", throughput=reading, side_by_side=together,
                               side_by_side_seconds=[0.01] * 18 if together else None, layout="data=2",
                               measured_peak_bytes=6 * 2**20)

    report = SearchReport(2, "cpu", 2**30, [row(["parallel_mode", "zero1"], 1370.0, 1332.0),
                                            row(["parallel_mode"], 1227.0, 1402.0),
                                            row(["parallel_mode", "checkpoint"], 1300.0)], winner=1)
    report.global_batch = 16
    lines = report.table().splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("strategy")) + 1
    assert lines[first].startswith("*") and "parallel_mode " in lines[first], lines  # the pick, first
    assert "zero1" in lines[first + 1] and "checkpoint" in lines[first + 2], lines  # then the dry runs' order


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "0"], "--world-size takes a positive whole number (at most 1048576), got 0"),
    (["--world-size", "-3"], "got -3"),
    (["--world-size", str(10**12)], "at most 1048576"),
    (["--world-size", "8", "--memory", "inf"], "--memory takes a positive size"),
    (["--world-size", "8", "--memory=-1GiB"], "--memory takes a positive size"),
    (["--world-size", "8", "--memory", "lots"], "--memory takes a positive size"),
    (["--world-size", "8", "--batch-size", "-2"], "--batch-size takes a positive whole number (at most 1073741824), got -2"),
    (["--world-size", "8", "--seq-len", "-5"], "--seq-len takes a positive whole number (at most 1073741824), got -5"),
    (["--world-size", "8", "--top", "0"], "--top takes a positive whole number, got 0"),
])
def test_plan_refuses_sizes_that_are_not_positive_by_name(flags, message, capsys):
    # Issue 56: world size 0 and a negative sequence length printed a table; --memory inf ended in
    # an OverflowError; 10**12 ranks ran for minutes.
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--hf-config", "docs/plans/llama7b.json", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _text_file(path, text: str):
    path.write_text(text)
    return str(path)


def test_bad_hf_configs_and_strategy_files_are_refused_by_name_not_with_a_traceback(tmp_path, capsys):
    # Issue 56 (fuzzed inputs): each of these ended in a traceback, or blocked forever (a FIFO).
    import os

    cases = {
        _text_file(tmp_path / "empty.json", "{}"): "needs a JSON object with a 'model_type'",
        _text_file(tmp_path / "neg.json", json.dumps({"model_type": "llama", "hidden_size": -32, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 100})):
            "sizes must be positive whole numbers, got {'hidden_size': -32}",
        _text_file(tmp_path / "heads.json", json.dumps({"model_type": "llama", "hidden_size": 30, "num_hidden_layers": 2,
                                                     "num_attention_heads": 4, "vocab_size": 100,
                                                     "intermediate_size": 64})):
            "does not build a model: ValueError: The hidden size (30) is not a multiple",
        _text_file(tmp_path / "text.json", "not json"): "is not a JSON config",
    }
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cases[str(fifo)] = "is not a file"
    for path, message in cases.items():
        assert main(["plan", "--hf-config", path, "--world-size", "2"]) == 2, path
        assert message in capsys.readouterr().err, path
    strategies = {
        _text_file(tmp_path / "version.json", json.dumps({"version": "x", "methods": [{"name": "parallel_mode"}]})):
            "'version' must be a positive whole number",
        # deeper than any recursion limit (torch._dynamo raises Python's when it is imported)
        _text_file(tmp_path / "deep.json", "[" * 100_000 + "]" * 100_000): "nests its JSON too deep",
    }
    for path, message in strategies.items():
        assert main(["validate", path]) == 2, path
        assert message in capsys.readouterr().err, path


def test_plan_never_shows_a_peak_below_its_model_states(capsys):
    """The states column summed the gathered weights and the gradients, which the peak's formula
    never holds together: a 7B row on 64 ranks read 88.84 GiB of states and an 82.28 GiB peak."""
    from pathlib import Path

    pytest.importorskip("transformers")
    config = Path(__file__).resolve().parents[1] / "docs" / "plans" / "llama7b.json"
    # short sequences: activations smaller than the gradients (gradient_accumulation x4 + fsdp had
    # read 29.16 GiB of states, 29.11 peak)
    assert main(["plan", "--hf-config", str(config), "--world-size", "64", "--memory", "80GiB",
                 "--batch-size", "64", "--seq-len", "128"]) == 0
    rows = _plan_rows(capsys.readouterr().out)  # weights, grads, optim, gathered, buckets, states, acts, peak
    assert len(rows) >= 4 and any(figures[3] > 0 for figures in rows.values())  # fsdp gathers weights
    for label, figures in rows.items():
        assert figures[5] <= figures[7] + 0.01, (label, figures)


def test_validate_reports_the_conflicts_of_a_method_whose_config_is_invalid_and_its_model_classes(tmp_path, capsys):
    """A config typo hid the method's conflict (one rerun per fix), and a method in a conflict was
    never checked against the model: every problem now comes in one run."""
    pytest.importorskip("transformers")
    path = _write(tmp_path / "hidden.json", [
        {"name": "zero2", "config": {"bogus": 1}},  # invalid, and in conflict with fsdp
        {"name": "fsdp", "config": {"atorch_wrap_cls": ["LlamaDecoderLayer"]}},  # in conflict, and not in GPT-2
    ])
    assert main(["validate", path, "--hf-config", _gpt2_config(tmp_path)]) == 2
    err = _words(capsys.readouterr().err)
    assert "3 problems" in err and "unknown field 'bogus'" in err
    assert "'fsdp' and 'zero2' cannot be used together" in err and "LlamaDecoderLayer" in err


def test_more_bad_flags_are_refused_by_name(capsys):
    """`validate --world-size 0` printed "valid ... on 0 x cuda", `calibrate --threads 0` measured,
    `plan --exclude zero9` excluded nothing in silence, and `plan --model nomodule:fn` ended in a
    traceback."""
    for argv in (["validate", "strategies/zero2_checkpoint.json", "--world-size", "0"],
                 ["calibrate", "--nproc", "1", "--threads", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "takes a positive whole number" in capsys.readouterr().err
    llama = "docs/plans/llama7b.json"
    assert main(["plan", "--hf-config", llama, "--world-size", "8", "--exclude", "zero9"]) == 2
    assert "unknown method 'zero9'. Did you mean" in capsys.readouterr().err
    assert main(["plan", "--model", "nomodule:fn", "--world-size", "8"]) == 2
    assert "--model 'nomodule:fn': ModuleNotFoundError" in capsys.readouterr().err


def test_fuzz_finds_refused_by_name(tmp_path, capsys):
    # Issue 56, point 6: what tests/test_fuzz_inputs.py found, each refused naming the field.
    import math

    from atorch.auto.search.profiles import FOLDER

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2**63,
              "num_attention_heads": 4, "vocab_size": 128}
    assert main(["plan", "--hf-config", _text_file(tmp_path / "deep.json", json.dumps(config)),
                 "--world-size", "2"]) == 2  # it built 2**63 layers on meta for minutes
    assert "at most 512 layers" in capsys.readouterr().err
    profile = json.loads((FOLDER / "h100_80gb.json").read_text())
    for field, value, told in (("gpus_per_node", math.inf, "gpus_per_node must be a whole number"),
                               ("intra_node", 5, "intra_node must be an object with a 'bandwidth'"),
                               ("sources", "x", "sources must be an object of texts")):
        path = _text_file(tmp_path / f"{field}.json", json.dumps({**profile, field: value}))
        assert main(["plan", "--hf-config", _text_file(tmp_path / "ok.json", json.dumps({**config,
                     "num_hidden_layers": 2})), "--world-size", "2", "--batch-size", "4", "--seq-len", "32", "--search",
                     "--profile", path]) == 2
        assert told in capsys.readouterr().err, field
    report = _report_with_a_long_reason().to_dict()
    report["candidates"][1]["estimate_breakdown"]["forward_flops"] = []
    assert main(["explain", _text_file(tmp_path / "report.json", json.dumps(report))]) == 2
    assert "estimate_breakdown must hold numbers" in capsys.readouterr().err
