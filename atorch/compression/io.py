"""Saving and loading g-nets, sharded by owner rank and loadable at another world size.

Layout of a checkpoint directory::

    meta.json                 the layout: tile, width, depth, and per covered weight its
                              matrix shapes and the rank that saved its g-net
    gnets-rank00000.pt ...    per saving rank: {name: {"gnet": state_dict, "optimizer": state_dict}}

Each g-net has its own optimizer, so a g-net moves to another owner with its optimizer state.
Shards hold tensors and plain containers only and are read with ``torch.load(weights_only=True)``.
"""

import json
import os

import torch
import torch.distributed as dist

from atorch.errors import CompressionError

FORMAT = 1


def _shard(path: str, rank: int) -> str:
    return os.path.join(path, f"gnets-rank{rank:05d}.pt")


def _layout(gnets) -> dict:
    return {
        "format": FORMAT,
        "world_size": gnets.world_size,
        "tile_size": list(gnets.tile_size),
        "gnet_width": gnets.gnet_width,
        "gnet_depth": gnets.gnet_depth,
        "gnets": {
            name: {"rank": r.rank, "shapes": [list(s) for s in r.shapes], "tile": list(r.tile)}
            for name, r in gnets.gnetdict.items()
        },
    }


def _barrier(gnets) -> None:
    if gnets.comm.group is not None:
        dist.barrier(group=gnets.comm.group)


def save_gnets(gnets, path: str) -> None:
    """Write ``meta.json`` (first rank of the group) and this rank's shard; all ranks leave
    together, so a load right after sees every file."""
    os.makedirs(path, exist_ok=True)
    shard = {
        r.name: {"gnet": r.gnet.state_dict(), "optimizer": r.optimizer.state_dict()} for r in gnets.owned()
    }
    torch.save(shard, _shard(path, gnets.rank))
    if gnets.rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(_layout(gnets), f, indent=1)
    _barrier(gnets)


def load_gnets(gnets, path: str) -> None:
    """Fill the g-nets this rank owns (and their optimizers) from a checkpoint of any world size.

    The model must be covered the same way (same weights, shapes, tiles and g-net sizes);
    otherwise the error names the first difference.
    """
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise CompressionError(f"{path} holds no g-net checkpoint (no meta.json); save one with GenomicBottleneck.save")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CompressionError(f"{meta_file} has format {meta.get('format')}; this atorch reads format {FORMAT}")
    mine = _layout(gnets)
    for key in ("gnet_width", "gnet_depth", "tile_size"):
        if meta[key] != mine[key]:
            raise CompressionError(f"the checkpoint has {key}={meta[key]} but these g-nets have {mine[key]}; build them alike")
    if set(meta["gnets"]) != set(mine["gnets"]):
        extra = sorted(set(meta["gnets"]) - set(mine["gnets"]))
        missing = sorted(set(mine["gnets"]) - set(meta["gnets"]))
        raise CompressionError(f"the checkpoint covers other weights: only in the checkpoint {extra}, only here {missing}")
    for name, entry in meta["gnets"].items():
        if entry["shapes"] != mine["gnets"][name]["shapes"] or entry["tile"] != mine["gnets"][name]["tile"]:
            raise CompressionError(f"{name}: the checkpoint has matrices {entry['shapes']} (tile {entry['tile']}), "
                                   f"the model {mine['gnets'][name]['shapes']} (tile {mine['gnets'][name]['tile']})")
    shards: dict[int, dict] = {}
    for record in gnets.owned():
        source = meta["gnets"][record.name]["rank"]
        if source not in shards:
            shards[source] = torch.load(_shard(path, source), map_location="cpu", weights_only=True)
        state = shards[source][record.name]
        record.gnet.load_state_dict(state["gnet"])
        record.optimizer.load_state_dict(state["optimizer"])
    _barrier(gnets)
