import pytest
import torch

from atorch.compression.encoding import (
    assemble,
    num_bits,
    num_tiles,
    position_codes,
    split,
    tile_grid,
    tile_shape_for,
    tile_slices,
)
from atorch.errors import CompressionError

SHAPES = [(4, 4), (5, 7), (1, 9), (8, 3), (13, 16)]


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_cover_every_weight_exactly_once(shape):
    tile = (4, 4)
    counts = torch.zeros(shape, dtype=torch.long)
    for rows, cols in tile_slices(shape, tile):
        counts[rows, cols] += 1
    assert counts.eq(1).all()
    assert len(tile_slices(shape, tile)) == num_tiles(shape, tile) == tile_grid(shape, tile)[0] * tile_grid(shape, tile)[1]


@pytest.mark.parametrize("shape", SHAPES)
def test_assemble_puts_each_tile_value_at_its_own_position_once(shape):
    tile = (4, 4)
    n = num_tiles(shape, tile)
    # Value = tile index * 100 + position in the tile: every matrix entry says where it came from.
    tiles = torch.arange(n)[:, None] * 100 + torch.arange(16)[None, :]
    matrix = assemble(tiles, shape, tile)
    assert matrix.shape == shape
    for k, (rows, cols) in enumerate(tile_slices(shape, tile)):
        block = matrix[rows, cols]
        expected = (k * 100 + torch.arange(16).reshape(4, 4))[: block.shape[0], : block.shape[1]]
        assert torch.equal(block, expected)
    assert matrix.flatten().unique().numel() == matrix.numel()  # no tile position used twice
    assert torch.equal(assemble(split(matrix, tile), shape, tile), matrix)


def test_assemble_is_differentiable_and_ignores_cropped_positions():
    tiles = torch.randn(num_tiles((5, 7), (4, 4)), 16, requires_grad=True)
    assemble(tiles, (5, 7), (4, 4)).sum().backward()
    assert tiles.grad.sum().item() == 35  # one gradient per weight of the matrix, none from the crop


def test_position_codes_are_distinct_signed_bits():
    codes = position_codes((3, 5))
    assert codes.shape == (15, num_bits(3) + num_bits(5)) == (15, 5)
    assert set(codes.unique().tolist()) == {-1.0, 1.0}
    assert len({tuple(row) for row in codes.tolist()}) == 15
    assert position_codes((1, 1)).shape == (1, 2)
    assert position_codes((2, 2)).tolist() == [[-1, -1], [-1, 1], [1, -1], [1, 1]]


def test_tile_shrinks_to_small_matrices_and_bad_shapes_are_errors():
    assert tile_shape_for([(10, 300)], (64, 64)) == (10, 64)
    assert tile_shape_for([(8, 8), (8, 8), (8, 8)], (4, 16)) == (4, 8)
    with pytest.raises(CompressionError, match="positive"):
        tile_grid((0, 4), (2, 2))
