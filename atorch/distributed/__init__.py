"""Process groups and the process topology."""

from atorch.distributed.env import device, init_distributed, local_rank, rank, shutdown, world_size
from atorch.distributed.topology import DATA_PARALLEL_DIMS, KNOWN_DIMS, Topology

__all__ = [
    "DATA_PARALLEL_DIMS",
    "KNOWN_DIMS",
    "Topology",
    "device",
    "init_distributed",
    "local_rank",
    "rank",
    "shutdown",
    "world_size",
]
