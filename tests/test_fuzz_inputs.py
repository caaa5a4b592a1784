"""Fuzzed inputs at every boundary that reads a file or an argument (issue 56, point 6).

Valid seeds (a strategy file, a Hugging Face config, a search report, a hardware profile, a
search-cache entry, a calibration, the command's flags) are mutated at random places into the
value classes that once ended in raw errors or hangs: wrong types, negative, zero, huge and
non-finite numbers, empty and long strings, deep nesting, a key removed or an unknown one added.
Each input must end in the boundary's own answer (a result, a refusal by name: exit code 2 or an
atorch error, or a skip with a WARNING for a cache or a calibration), never in a raw Python error,
and within ``LIMIT_S``. Seeded: a failure prints its seed and input, and reruns the same.
``ATORCH_FUZZ_CASES`` sets the cases per boundary (a bounded budget in the default run).
"""

import copy
import json
import os
import random
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from atorch.cli.main import main
from atorch.errors import AtorchConfigError

CASES = int(os.environ.get("ATORCH_FUZZ_CASES", "25"))
LIMIT_S = 10
ROOT = Path(__file__).resolve().parents[1]


def _deep(levels: int):
    value = []
    for _ in range(levels):
        value = [value]
    return value


HOSTILE = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**100, 1e308, -1e308, 0.5, float("inf"),
           float("-inf"), float("nan"), "", "x", "1GiB", "-1", "nan", "a" * 5000, [], {}, [1, 2], {"a": 1},
           _deep(200), {"name": None}]


def _places(value, path=()):
    """Every (path to a container, key in it) of a JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield path, key
            yield from _places(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield path, index
            yield from _places(item, (*path, index))


def mutate(seed_value, rng: random.Random):
    """The seed with one to three random edits: a value replaced, a key removed or one added."""
    value = copy.deepcopy(seed_value)
    for _ in range(rng.randint(1, 3)):
        places = list(_places(value))
        if not places or rng.random() < 0.05:
            return rng.choice(HOSTILE)
        path, key = rng.choice(places)
        container = value
        for step in path:
            container = container[step]
        edit = rng.random()
        if edit < 0.7:
            container[key] = copy.deepcopy(rng.choice(HOSTILE))
        elif edit < 0.85 and isinstance(container, dict):
            del container[key]
        elif isinstance(container, dict):
            container[rng.choice(["zz_unknown", "version", "name", "methods"])] = copy.deepcopy(rng.choice(HOSTILE))
    return value


@contextmanager
def _bounded(what: str):
    def expired(signum, frame):
        raise TimeoutError(f"{what} ran over {LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(LIMIT_S)
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < LIMIT_S, what


def _write(path: Path, value) -> str:
    path.write_text(json.dumps(value))  # NaN and Infinity as Python's json writes them
    return str(path)


def _cli(argv: list[str]) -> int:
    """The command's answer: its exit code (argparse's refusal is SystemExit 2)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def _each_case(name: str, seed_value, check, tmp_path, capsys):
    rng = random.Random(f"{name}-{CASES}")
    problems = []
    for case in range(CASES):
        value = mutate(seed_value, rng)
        try:
            with _bounded(f"{name} case {case}"):
                check(value, tmp_path / f"{name}-{case}.json")
        except (AtorchConfigError, ValueError) as error:  # a refusal by name is an answer
            if type(error) is ValueError and not str(error):
                problems.append(f"case {case}: a ValueError with no message for {json.dumps(value)[:300]}")
        except Exception as error:  # noqa: BLE001 - what the test looks for
            problems.append(f"case {case}: {type(error).__name__}: {str(error)[:200]} for {json.dumps(value)[:300]}")
        capsys.readouterr()
    assert not problems, "\n".join(problems)


def _tiny_llama_config() -> dict:
    return {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}


def test_fuzzed_strategy_files(tmp_path, capsys):
    seed = json.loads((ROOT / "strategies" / "lora_fsdp_bf16.json").read_text())

    def check(value, path):
        assert _cli(["validate", _write(path, value)]) in (0, 1, 2)

    _each_case("strategy", seed, check, tmp_path, capsys)


def test_fuzzed_hf_configs(tmp_path, capsys):
    def check(value, path):
        assert _cli(["plan", "--hf-config", _write(path, value), "--world-size", "2", "--batch-size", "4",
                     "--seq-len", "32", "--memory", "16GiB"]) in (0, 2)

    _each_case("hf-config", _tiny_llama_config(), check, tmp_path, capsys)


def test_fuzzed_plan_arguments(tmp_path, capsys):
    config = _write(tmp_path / "llama.json", _tiny_llama_config())
    flags = {"--world-size": "2", "--batch-size": "4", "--seq-len": "32", "--memory": "16GiB", "--reserve": "1GiB",
             "--top": "2", "--dtype": "bf16", "--optimizer": "AdamW", "--profile": "h100_80gb"}

    def check(value, path):
        argv = ["plan", "--hf-config", config, "--search"]
        if not isinstance(value, dict):  # the whole set replaced: one stray argument
            value = {json.dumps(value): ""}
        for flag, given in value.items():
            argv += [flag, given if isinstance(given, str) else json.dumps(given)]
        assert _cli(argv) in (0, 2)

    _each_case("plan-flags", flags, check, tmp_path, capsys)


def test_fuzzed_reports(tmp_path, capsys):
    from tests.test_cli import _report_with_a_long_reason

    seed = _report_with_a_long_reason().to_dict()

    def check(value, path):
        assert _cli(["explain", _write(path, value)]) in (0, 2)

    _each_case("report", seed, check, tmp_path, capsys)


def test_fuzzed_hardware_profiles(tmp_path, capsys):
    seed = json.loads((ROOT / "atorch" / "auto" / "search" / "profiles" / "h100_80gb.json").read_text())
    config = _write(tmp_path / "llama.json", _tiny_llama_config())

    def check(value, path):
        assert _cli(["plan", "--hf-config", config, "--world-size", "2", "--batch-size", "4", "--seq-len", "32",
                     "--search", "--top", "1", "--profile", _write(path, value)]) in (0, 2)

    _each_case("profile", seed, check, tmp_path, capsys)


def test_fuzzed_cache_entries_and_calibrations_are_skipped_with_a_warning(tmp_path, capsys):
    from atorch.auto.search import cache
    from atorch.auto.search.calibration_file import read_cached
    from atorch.auto.strategy import Strategy
    from tests.test_cli import _report_with_a_long_reason

    strategy = Strategy.from_json(json.dumps([{"name": "parallel_mode"}]))
    cache.store(tmp_path, "k", strategy, _report_with_a_long_reason())
    entry = next(tmp_path.glob("*.json"))
    seed_entry = json.loads(entry.read_text())

    def check_entry(value, path):
        entry.write_text(json.dumps(value))
        found = cache.load(tmp_path, "k")
        assert found is None or isinstance(found, tuple)

    _each_case("cache", seed_entry, check_entry, tmp_path, capsys)
    seed_calibration = json.loads((ROOT / "atorch" / "auto" / "search" / "profiles" / "h100_80gb.json").read_text())
    seed_calibration["calibration"] = {"when": "2026-11-27"}

    def check_calibration(value, path):
        data, why = read_cached(Path(_write(path, value)), torch.device("cpu"))
        assert data is None or isinstance(data, dict)

    _each_case("calibration", seed_calibration, check_calibration, tmp_path, capsys)
