"""``create_dataloader``: the global batch split over the data x depth ranks of a 3D grid."""

from typing import Any

from torch.utils.data import DataLoader

from atorch.data.loader import build_dataloader
from atorch.errors import AtorchConfigError


def create_dataloader(dataset: Any, global_batch_size: int, num_workers: int = 0, *args: Any, **kwargs: Any) -> DataLoader:
    """A loader whose every batch is this rank's share of ``global_batch_size`` samples.

    The global batch is divided over the data x depth ranks of the grid set by
    :func:`atorch.intra_layer.init` (the ranks of one row x column group get the same samples,
    as the 3D layers expect). Keyword arguments go to ``DataLoader`` (``shuffle`` and
    ``drop_last`` to the distributed sampler); ``topology=`` picks another grid. DataLoader
    options must be passed by keyword.

    Example::

        atorch.intra_layer.init(G_data=2, G_intra_d=2)         # 4 processes
        loader = atorch.data.create_dataloader(dataset, global_batch_size=32, shuffle=True)
        # every batch has 32 / (2 x 2) = 8 samples
    """
    from atorch.intra_layer.grid import current

    if args:
        raise AtorchConfigError(
            f"create_dataloader got {len(args)} extra positional arguments; pass DataLoader options by keyword "
            "(for example shuffle=True)"
        )
    topology = kwargs.pop("topology", None) or current()
    loader_args = {**kwargs, "batch_size": int(global_batch_size), "num_workers": int(num_workers)}
    return build_dataloader(dataset, loader_args, topology.data_parallel_size, topology.data_parallel_rank)
