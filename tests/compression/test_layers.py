import pytest
import torch
from torch import nn

from atorch.compression import GenomicBottleneck, register_gnet_type, unregister_gnet_type
from atorch.compression.layers import gnet_type_for
from atorch.errors import CompressionError


class Bilinear3(nn.Module):
    """A layer with a 3-D kernel that no built-in g-net type knows."""

    def __init__(self):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(6, 10, 12) * 0.1)

    def forward(self, x):
        return torch.einsum("bi,oij->boj", x, self.kernel).sum(-1)


@pytest.fixture
def bilinear_type():
    entry = register_gnet_type(
        Bilinear3,
        init_fn=lambda m: {"kernel": [(m.kernel.shape[0], m.kernel[0].numel())]},
        build_fn=lambda m, name, mats: mats[0].reshape(m.kernel.shape),
    )
    yield entry
    unregister_gnet_type(Bilinear3)


def test_a_registered_type_gets_a_gnet_and_trains(bilinear_type):
    model = nn.Sequential(Bilinear3())
    gnets = GenomicBottleneck(model, tile_size=8, gnet_width=8, min_numel=100)
    assert list(gnets.gnetdict) == ["0.kernel"] and gnets.gnetdict["0.kernel"].shapes == [(6, 120)]
    before = model[0].kernel.detach().clone()
    gnets.zero_grad()
    gnets.predict_weights()
    model(torch.randn(4, 10)).pow(2).mean().backward()
    gnets.backward()
    gnets.step()
    gnets.predict_weights()
    assert not torch.equal(before, model[0].kernel.detach())


def test_registering_a_type_twice_is_an_error_that_says_how_to_replace_it(bilinear_type):
    with pytest.raises(CompressionError, match="already registered.*unregister_gnet_type"):
        register_gnet_type(Bilinear3, bilinear_type.init_fn, bilinear_type.build_fn)
    with pytest.raises(CompressionError, match="already registered"):
        register_gnet_type(nn.Linear, bilinear_type.init_fn, bilinear_type.build_fn)
    with pytest.raises(CompressionError, match="nn.Module subclass"):
        register_gnet_type(int, bilinear_type.init_fn, bilinear_type.build_fn)


def test_subclasses_use_their_base_entry_and_wrong_layouts_are_caught(bilinear_type):
    out_proj = nn.MultiheadAttention(8, 2).out_proj  # NonDynamicallyQuantizableLinear
    assert gnet_type_for(out_proj).layer_type is nn.Linear
    assert gnet_type_for(nn.ReLU()) is None
    unregister_gnet_type(Bilinear3)
    register_gnet_type(Bilinear3, lambda m: {"kernel": [(6, 10)]}, bilinear_type.build_fn)
    with pytest.raises(CompressionError, match="do not hold its 720 elements"):
        GenomicBottleneck(nn.Sequential(Bilinear3()), min_numel=1)


def test_attention_without_packed_projection_covers_q_k_v_separately():
    attn = nn.MultiheadAttention(64, 4, kdim=32, vdim=32)
    gnets = GenomicBottleneck(nn.Sequential(attn), tile_size=16, min_numel=100)
    assert sorted(gnets.gnetdict) == ["0.k_proj_weight", "0.out_proj.weight", "0.q_proj_weight", "0.v_proj_weight"]
