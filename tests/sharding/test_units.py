from torch import nn

from atorch.sharding.fsdp2 import choose_units
from tests.helpers.models import TinyTransformer


def test_units_by_class_are_innermost_first():
    model = TinyTransformer()
    assert choose_units(model, ["Block"]) == ["blocks.0", "blocks.1"]
    units = choose_units(model, ["Block", "Linear"])
    assert units.index("blocks.0.mlp.0") < units.index("blocks.0")
    assert "head" in units


def test_size_based_units_skip_containers_and_covered_params():
    model = TinyTransformer()
    # Each mlp holds 8352 parameters; what is left of a block after its mlp (4352) is below the
    # threshold, and the two blocks' remainders together (8704) sit in a ModuleList, which has
    # no forward to hook, so they fall to the root.
    assert choose_units(model, [], min_num_params=8000) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert choose_units(model, ["Block"], min_num_params=10**9) == ["blocks.0", "blocks.1"]


def test_ignored_classes_are_never_units():
    model = TinyTransformer()
    assert choose_units(model, ["Block"], ignored_names=["Block"]) == []
    assert all("norm" not in u for u in choose_units(model, ["LayerNorm", "Block"], ignored_names=["LayerNorm"]))


def test_trainable_outmost_finds_adapters_inside_containers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleDict({"adapter": nn.Linear(4, 4)}))
    model[0].requires_grad_(False)
    assert choose_units(model, [], trainable_outmost=True) == ["1.adapter"]
