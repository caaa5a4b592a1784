"""Tiling of weight matrices and the binary encoding of a weight's position inside a tile.

A matrix of shape ``(rows, cols)`` is cut into a grid of tiles of shape ``(tile_rows, tile_cols)``
(row-major order). The last row and column of tiles may stick out of the matrix: a g-net predicts
whole tiles and :func:`assemble` crops what lies outside, so every weight of the matrix comes from
exactly one tile position.

A position ``(i, j)`` inside a tile is encoded as the bits of ``i`` followed by the bits of ``j``
(least significant first), each bit written as -1 or +1: a fixed input that a g-net maps to the
weights at that position, one output per tile.
"""

import math

import torch

from atorch.errors import CompressionError


def tile_shape_for(shapes: list[tuple[int, int]], tile_size: tuple[int, int]) -> tuple[int, int]:
    """The tile shape used for matrices ``shapes``: ``tile_size`` shrunk to the largest matrix.

    >>> tile_shape_for([(10, 300)], (64, 64))
    (10, 64)
    """
    rows = max(r for r, _ in shapes)
    cols = max(c for _, c in shapes)
    return min(tile_size[0], rows), min(tile_size[1], cols)


def tile_grid(shape: tuple[int, int], tile: tuple[int, int]) -> tuple[int, int]:
    """How many tiles cover ``shape`` along rows and columns (the last ones may stick out)."""
    if min(shape) < 1 or min(tile) < 1:
        raise CompressionError(f"cannot tile a matrix of shape {tuple(shape)} with tiles {tuple(tile)}; both must be positive")
    return math.ceil(shape[0] / tile[0]), math.ceil(shape[1] / tile[1])


def num_tiles(shape: tuple[int, int], tile: tuple[int, int]) -> int:
    """The number of tiles that cover ``shape``."""
    grid_rows, grid_cols = tile_grid(shape, tile)
    return grid_rows * grid_cols


def tile_slices(shape: tuple[int, int], tile: tuple[int, int]) -> list[tuple[slice, slice]]:
    """The part of the matrix each tile covers, in tile order (cropped at the matrix's edge)."""
    grid_rows, grid_cols = tile_grid(shape, tile)
    return [
        (slice(r * tile[0], min((r + 1) * tile[0], shape[0])), slice(c * tile[1], min((c + 1) * tile[1], shape[1])))
        for r in range(grid_rows)
        for c in range(grid_cols)
    ]


def num_bits(n: int) -> int:
    """Bits needed to write the positions ``0 .. n-1`` (at least one)."""
    return max(1, (n - 1).bit_length())


def position_codes(tile: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The encoded positions of a tile, row-major: shape ``(rows * cols, bits(rows) + bits(cols))``.

    >>> position_codes((2, 2)).tolist()
    [[-1.0, -1.0], [-1.0, 1.0], [1.0, -1.0], [1.0, 1.0]]
    """
    rows, cols = tile
    i = torch.arange(rows).repeat_interleave(cols)
    j = torch.arange(cols).repeat(rows)

    def bits(index: torch.Tensor, count: int) -> torch.Tensor:
        shifts = torch.arange(count)
        return ((index[:, None] >> shifts) & 1).to(dtype) * 2 - 1

    return torch.cat([bits(i, num_bits(rows)), bits(j, num_bits(cols))], dim=1)


def assemble(tiles: torch.Tensor, shape: tuple[int, int], tile: tuple[int, int]) -> torch.Tensor:
    """A ``shape`` matrix from ``tiles`` of shape ``(n_tiles, tile_rows * tile_cols)`` (differentiable).

    Tile ``k`` is row ``k`` (row-major over the grid, positions row-major inside the tile); the
    parts of edge tiles outside the matrix are cropped.
    """
    grid_rows, grid_cols = tile_grid(shape, tile)
    if tiles.shape != (grid_rows * grid_cols, tile[0] * tile[1]):
        raise ValueError(f"expected tiles of shape {(grid_rows * grid_cols, tile[0] * tile[1])}, got {tuple(tiles.shape)}")
    full = tiles.reshape(grid_rows, grid_cols, tile[0], tile[1]).permute(0, 2, 1, 3)
    return full.reshape(grid_rows * tile[0], grid_cols * tile[1])[: shape[0], : shape[1]]


def split(matrix: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`assemble`: ``(n_tiles, tile_rows * tile_cols)``, zero beyond the edge."""
    grid_rows, grid_cols = tile_grid(tuple(matrix.shape), tile)
    padded = matrix.new_zeros(grid_rows * tile[0], grid_cols * tile[1])
    padded[: matrix.shape[0], : matrix.shape[1]] = matrix
    return padded.reshape(grid_rows, tile[0], grid_cols, tile[1]).permute(0, 2, 1, 3).reshape(-1, tile[0] * tile[1])
