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


def test_atorch_own_strategy_in_atorch_load_save_strategy(tmp_path):
    """ATorch's test_load_save_strategy with its `from atorch.auto.strategy import Strategy` left as
    it is (before: atorch's Strategy refused (name, config, tunable) items and its pickle was refused)."""
    import pickle

    from atorch.auto.strategy import Strategy
    from atorch.compat.antgroup import get_strategy, read_pickled_strategy, save_strategy

    strategy = Strategy([("parallel_mode", ([("data", 2)], None), False), ("amp_native", None, False)])
    filename = str(tmp_path / "strategy.st")
    save_strategy(strategy, filename)
    status, loaded = get_strategy(filename)
    assert status and loaded == strategy
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        status, loaded = get_strategy(pickle.dumps(strategy, protocol=protocol))  # the restricted unpickler
        assert status and loaded == strategy, protocol
    assert get_strategy("_bad_filename.st") == (False, None)
    assert [name for name, _, tunable in strategy.convert_strategy_to_easydl_format()] == ["parallel_mode",
                                                                                          "amp_native"]
    # the pickle holds the JSON that save() writes, nothing a restricted reader must build
    assert read_pickled_strategy(pickle.dumps(strategy)) == strategy.to_dict()["methods"]
    assert loaded != Strategy([("parallel_mode", ([("data", 2)], None), False)])  # control


def test_a_pickled_atorch_strategy_is_never_built_by_running_code():
    """The standard unpickler rebuilds it from the same plain data (validated: a bad config raises),
    and an ATorch pickle met there says where to read it."""
    import pickle

    import pytest

    from atorch.auto.strategy import Strategy
    from atorch.errors import MethodConfigError, StrategyFileError
    from tests.compat.test_antgroup import atorch_pickle

    strategy = Strategy(["parallel_mode", ("amp_native", {"dtype": "bf16"})], "for a test")
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy == strategy and copy.description == "for a test"
    tampered = pickle.dumps(strategy).replace(b"bfloat16", b"bfloat99")
    with pytest.raises(MethodConfigError, match="dtype"):
        pickle.loads(tampered)
    with pytest.raises(StrategyFileError, match="atorch.compat.antgroup.get_strategy"):
        pickle.loads(atorch_pickle([("amp_native", None, False)]))


def test_pickling_says_it_leaves_out_code_only_settings(atorch_logs):
    import pickle

    from atorch.auto.strategy import Strategy
    from atorch.sharding.deepspeed_config import TrustedDsConfig
    from tests.conftest import messages

    trusted = Strategy(["parallel_mode", ("zero2", {"use_ds_zero": True, "trusted_ds_config": TrustedDsConfig({})})])
    copy = pickle.loads(pickle.dumps(trusted))
    assert copy.get("zero2").trusted_ds_config is None and "zero2.trusted_ds_config" in messages(atorch_logs)


def test_a_strategy_pickle_calling_a_builtin_is_refused_and_runs_nothing(tmp_path):
    """eval, exec, compile, __import__, open, getattr, ... by themselves and inside ATorch's pickled
    Strategy. (Negative control: with ``builtins.eval`` added to ``_CONTAINERS`` and ``_CALLABLE``
    in atorch/compat/antgroup/strategy_io.py, the eval payload runs and this fails.)"""
    import pickle

    import pytest

    from atorch.compat.antgroup import read_pickled_strategy
    from atorch.errors import StrategyFileError
    from tests.checkpoint.test_safe_pickle import _payloads
    from tests.compat.test_antgroup import atorch_pickle

    marker = tmp_path / "ran"
    for name, payload in _payloads(marker).items():
        for data in (pickle.dumps(payload), atorch_pickle([("fsdp", {"x": payload}, False)])):
            with pytest.raises(StrategyFileError, match="never runs code"):
                read_pickled_strategy(data)
            assert not marker.exists(), name
