import torch

from atorch.compression.gnet import GNet, build_gnet


def test_gnet_predicts_one_value_per_tile_position():
    gnet = GNet(tile=(4, 8), n_tiles=3, width=16, depth=2)
    assert gnet().shape == (3, 32)
    assert sum(p.numel() for p in gnet.parameters()) == (5 * 16 + 16) + (16 * 16 + 16) + (16 * 3 + 3)


def test_calibrate_sets_the_spread_of_the_predictions():
    gnet = GNet(tile=(16, 16), n_tiles=4, width=8, depth=1)
    gnet.calibrate(0.05)
    assert abs(gnet().std().item() - 0.05) < 1e-6
    assert "scale" in gnet.state_dict() and "codes" not in gnet.state_dict()


def test_a_gnet_starts_the_same_wherever_it_is_built():
    a = build_gnet("blocks.0.mlp.0.weight", (8, 8), 2, 16, 2, seed=0)
    torch.manual_seed(123)  # the global RNG does not matter
    b = build_gnet("blocks.0.mlp.0.weight", (8, 8), 2, 16, 2, seed=0)
    c = build_gnet("blocks.1.mlp.0.weight", (8, 8), 2, 16, 2, seed=0)
    assert torch.equal(a(), b())
    assert not torch.equal(a(), c())
    meta = build_gnet("x", (8, 8), 2, 16, 2, seed=0, device="meta")
    assert all(p.is_meta for p in meta.parameters())
