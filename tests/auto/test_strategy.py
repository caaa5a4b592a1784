import json
import pickle

import pytest
import torch

from atorch.auto import Strategy, method_names
from atorch.auto.registry import get_method
from atorch.auto.strategy import parse_strategy
from atorch.errors import AtorchConfigError, MethodConfigError, StrategyFileError, UnknownMethodError
from tests.helpers.models import Block

# One non-default config per method, in the forms the ATorch docs show.
ATORCH_FORMS = {
    "parallel_mode": ([("data", 2)], None),
    "amp_native": {"dtype": torch.bfloat16},
    "half": "bf16",
    "checkpoint": (Block,),
    "native_dynamo": {"backend": "aot_eager", "fullgraph": True},
    "fused_optimizer": {"impl": "foreach"},
    "zero1": {"use_ds_zero": True},
    "tensor_parallel": {"algorithm": "megatron"},
    "sequence_parallel": {},
    "expert_parallel": {"size": 2},
    "module_replace": {"pairs": ["hf_rmsnorm"], "hf_attention": None},
    "fp8": {"include": ["blocks"], "exclude": ["head"], "fp8_format": "E4M3", "amax_history_len": 16,
            "amax_compute_algo": "most_recent", "margin": 1, "interval": 2, "reduce_amax": False, "verbose": True},
    "zero2": {"not_use_fsdp": True},
    "pipeline_parallel": {"num_microbatches": 4, "schedule": "gpipe", "virtual_pipeline_size": 2},
    "mixed_parallel": {"num_microbatches": 2, "tensor_size": 2, "pipeline_size": 2},
    "ds_3d_parallel": {"num_microbatches": 2, "partition_method": "uniform", "ds_config": {"steps_per_print": 10}},
    "genomic_bottleneck": {"tile_size": 32, "gnet_width": 8, "ignore_layers": ["head"], "optimizer": "sgd", "lr": 0.1},
    "gradient_accumulation": {"steps": 4},
    "fsdp": {"atorch_wrap_cls": (Block,), "param_dtype": torch.bfloat16, "atorch_size_based_min_num_params": 10,
             "atorch_ignored_cls": ["LayerNorm"], "wrap_trainable_outmost": True, "reshard_after_forward": False},
}


def test_every_registered_method_has_a_round_trip_case():
    assert set(ATORCH_FORMS) >= set(method_names())


@pytest.mark.parametrize("name", sorted(ATORCH_FORMS))
def test_config_json_round_trip(name):
    for raw in (None, ATORCH_FORMS[name]):
        strategy = Strategy([(name, raw)])
        text = strategy.to_json()
        json.loads(text)  # plain JSON
        assert Strategy.from_json(text) == strategy
        assert Strategy.from_json(text.encode()) == strategy


def test_all_defaults_round_trip():
    strategy = Strategy(method_names())
    assert Strategy.from_json(strategy.to_json()) == strategy


def test_atorch_forms_are_read():
    s = Strategy(
        [
            ("parallel_mode", ([("tensor", 2), ("data", 2)], [0, 2, 1, 3])),
            ("amp_native", {"dtype": torch.bfloat16}),
            ("half", "fp16"),
            ("checkpoint", (Block,)),
        ]
    )
    assert s.opt_names == ["parallel_mode", "amp_native", "half", "checkpoint"]
    assert s.get("parallel_mode").dims == [("tensor", 2), ("data", 2)]
    assert s.get("parallel_mode").rank_order == [0, 2, 1, 3]
    assert s.get("amp_native").dtype is torch.bfloat16
    assert s.get("half").dtype is torch.float16
    assert s.get("checkpoint").wrap_class == [f"{Block.__module__}.Block"]
    assert s.get("fsdp") is None
    assert Strategy([("checkpoint", ["Block"])]).get("checkpoint").wrap_class == ["Block"]
    assert Strategy([("checkpoint", {"wrap_class": Block, "no_reentrant": False})]).get("checkpoint").no_reentrant is False


def test_str_is_readable():
    text = str(Strategy(["parallel_mode", ("amp_native", "bf16")]))
    assert "parallel_mode" in text and "dtype=bfloat16" in text
    assert "no methods" in str(Strategy())


def test_equality_depends_on_config_and_order():
    assert Strategy(["half"]) == Strategy([("half", "fp16")])
    assert Strategy(["half"]) != Strategy([("half", "bf16")])
    assert Strategy(["half", "checkpoint"]) != Strategy(["checkpoint", "half"])


def test_save_and_load(tmp_path):
    s = Strategy([("amp_native", "bf16"), ("checkpoint", ["Block"])])
    path = tmp_path / "s.json"
    s.save(path)
    assert Strategy.load(path) == s
    assert parse_strategy(str(path)) == s
    assert parse_strategy(path) == s
    assert parse_strategy(path.read_text()) == s
    assert parse_strategy(path.read_bytes()) == s


def test_yaml_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("methods:\n  - name: amp_native\n    config: {dtype: bf16}\n  - checkpoint\n")
    s = Strategy.load(path)
    assert s.opt_names == ["amp_native", "checkpoint"]
    assert s.get("amp_native").dtype is torch.bfloat16


def test_bare_list_json():
    s = Strategy.from_json('["parallel_mode", ["half", {"dtype": "bf16"}]]')
    assert s == Strategy(["parallel_mode", ("half", "bf16")])


def test_unknown_method_lists_valid_names():
    with pytest.raises(UnknownMethodError) as info:
        Strategy(["amp_nativ"])
    message = str(info.value)
    assert "amp_nativ" in message and "Did you mean 'amp_native'" in message
    for name in method_names():
        assert name in message
    assert isinstance(info.value, ValueError)


def test_config_typo_names_the_field():
    with pytest.raises(MethodConfigError, match="unknown field 'dtyp'.*dtype"):
        Strategy([("amp_native", {"dtyp": "bf16"})])


def test_bad_value_names_the_field():
    with pytest.raises(MethodConfigError, match="dtype"):
        Strategy([("amp_native", {"dtype": "int8"})])
    with pytest.raises(MethodConfigError, match="growth_interval"):
        Strategy([("amp_native", {"growth_interval": 0})])


def test_duplicate_method_is_an_error():
    with pytest.raises(MethodConfigError, match="twice"):
        Strategy(["half", "half"])


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(StrategyFileError, match="nope.json"):
        parse_strategy(str(missing))


def test_malformed_file_names_the_path(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"methods": [')
    with pytest.raises(StrategyFileError, match="broken.json.*not valid JSON"):
        Strategy.load(path)
    path.write_text('{"methods": [], "extra": 1}')
    with pytest.raises(StrategyFileError, match="extra"):
        Strategy.load(path)


class _Boom:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_pickle_is_refused_and_never_unpickled(tmp_path, capsys):
    payload = pickle.dumps([_Boom(), "amp_native"])
    for value in (payload, pickle.dumps(["amp_native"], protocol=0)):
        with pytest.raises(StrategyFileError, match="pickle"):
            parse_strategy(value)
    for name in ("s.pkl", "s.json"):
        path = tmp_path / name
        path.write_bytes(payload)
        with pytest.raises(StrategyFileError, match="pickle"):
            Strategy.load(path)
    assert "unpickled!" not in capsys.readouterr().out


def test_unknown_load_strategy_type():
    with pytest.raises(StrategyFileError, match="not understood"):
        parse_strategy(42)


def test_errors_are_value_errors():
    assert issubclass(AtorchConfigError, ValueError)
    assert issubclass(StrategyFileError, AtorchConfigError)


def test_config_objects_are_copied():
    config = get_method("half").config_cls(dtype="bf16")
    s = Strategy([("half", config)])
    config.dtype = torch.float16
    assert s.get("half").dtype is torch.bfloat16
