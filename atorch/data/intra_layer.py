"""``create_dataloader``: the global batch split over the data x depth ranks of a 3D grid."""

from typing import Any

from torch.utils.data import DataLoader

from atorch.data.loader import build_dataloader
from atorch.errors import AtorchConfigError, WorldSizeError


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AtorchConfigError(f"create_dataloader: {name}={value!r} must be an integer >= {minimum}")
    return value


def create_dataloader(dataset: Any, global_batch_size: int, micro_batch_size: int | None = None,
                      num_workers: int = 0, *args: Any, **kwargs: Any) -> DataLoader:
    """A loader whose every batch is this rank's share of ``global_batch_size`` samples.

    AxoNN's positional order: ``(dataset, global_batch_size, micro_batch_size, num_workers)``.
    The global batch is divided over the data x depth ranks of the grid set by
    :func:`atorch.intra_layer.init` (the ranks of one row x column group get the same samples,
    as the 3D layers expect). ``micro_batch_size`` (default: the whole per-rank batch) must
    divide each rank's batch; the loader records it as ``loader.micro_batch_size`` and
    ``loader.num_micro_batches`` for a loop that accumulates over micro batches (the batches it
    yields are whole per-rank batches). Keyword arguments go to ``DataLoader`` (``shuffle`` and
    ``drop_last`` to the distributed sampler); ``topology=`` picks another grid. Other
    DataLoader options must be passed by keyword.

    Example::

        atorch.intra_layer.init(G_data=2, G_intra_d=2)         # 4 processes
        loader = atorch.data.create_dataloader(dataset, 32, 4, num_workers=2, shuffle=True)
        # every batch has 32 / (2 x 2) = 8 samples: 2 micro batches of 4
    """
    from atorch.intra_layer.grid import current

    if args:
        raise AtorchConfigError(
            f"create_dataloader got {len(args)} positional arguments after num_workers; its order is (dataset, "
            "global_batch_size, micro_batch_size, num_workers): pass DataLoader options by keyword (for example "
            "shuffle=True)"
        )
    topology = kwargs.pop("topology", None) or current()
    global_batch_size = _count("global_batch_size", global_batch_size, 1)
    num_workers = _count("num_workers", num_workers, 0)
    dp = topology.data_parallel_size
    if global_batch_size % dp:
        raise WorldSizeError(
            f"global batch size {global_batch_size} does not divide over {dp} data-parallel ranks (data x depth); "
            f"use a multiple of {dp}"
        )
    per_rank = global_batch_size // dp
    if micro_batch_size is None:
        micro_batch_size = per_rank
    micro_batch_size = _count("micro_batch_size", micro_batch_size, 1)
    if per_rank % micro_batch_size:
        raise WorldSizeError(
            f"create_dataloader: micro_batch_size={micro_batch_size} does not divide each rank's batch of "
            f"{per_rank} samples (global batch {global_batch_size} / {dp} data x depth ranks); the order is "
            "(dataset, global_batch_size, micro_batch_size, num_workers), so pass num_workers= by keyword if that "
            "is what the third argument meant"
        )
    loader_args = {**kwargs, "batch_size": global_batch_size, "num_workers": num_workers}
    loader = build_dataloader(dataset, loader_args, dp, topology.data_parallel_rank)
    loader.micro_batch_size = micro_batch_size
    loader.num_micro_batches = per_rank // micro_batch_size
    return loader
