"""The g-net: a small MLP from a weight's encoded position in a tile to that weight, for every tile."""

import zlib

import torch
from torch import nn

from atorch.compression.encoding import position_codes


class GNet(nn.Module):
    """Maps each encoded position of a ``tile`` to one value per tile: output ``(n_tiles, tile numel)``.

    ``depth`` hidden layers of ``width`` units (SiLU) share all tiles; the last layer has one
    output per tile. ``scale`` (a buffer, saved with the g-net) sets the spread of the predicted
    weights; :meth:`calibrate` matches it to the weights the g-net replaces.

    >>> gnet = GNet(tile=(4, 8), n_tiles=3, width=16, depth=2)
    >>> gnet().shape
    torch.Size([3, 32])
    """

    def __init__(self, tile: tuple[int, int], n_tiles: int, width: int, depth: int):
        super().__init__()
        codes = position_codes(tile)
        self.register_buffer("codes", codes, persistent=False)
        layers: list[nn.Module] = []
        features = codes.shape[1]
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.SiLU()]
            features = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(features, n_tiles)
        # No per-tile offset at the start: a constant added to a whole tile is a rank-one block
        # that makes the first predicted weights needlessly coherent (a large top singular value).
        nn.init.zeros_(self.head.bias)
        self.register_buffer("scale", torch.ones(()))

    def forward(self) -> torch.Tensor:
        return (self.head(self.body(self.codes)) * self.scale).t()

    @torch.no_grad()
    def calibrate(self, target_std: float) -> None:
        """Scale the output so the predicted weights start with standard deviation ``target_std``."""
        self.scale.fill_(1.0)
        raw_std = self().std().item()
        self.scale.fill_(target_std / raw_std if raw_std > 0 else 1.0)


def gnet_seed(seed: int, name: str) -> int:
    """The seed of the g-net that predicts parameter ``name``: the same on every rank and world size."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def build_gnet(name: str, tile: tuple[int, int], n_tiles: int, width: int, depth: int, seed: int,
               device: torch.device | str = "cpu") -> GNet:
    """A g-net initialized from a seed derived from ``name``, so that its initial values do not
    depend on which rank builds it (``device="meta"`` builds the shape only, to count parameters)."""
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return GNet(tile, n_tiles, width, depth)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(gnet_seed(seed, name))
        gnet = GNet(tile, n_tiles, width, depth)
    return gnet.to(device)
