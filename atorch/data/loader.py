"""Dataloaders over a global batch: each data-parallel rank gets its share (strong scaling)."""

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from atorch.errors import WorldSizeError


class GlobalBatchDataLoader(DataLoader):
    """A DataLoader whose distributed sampler moves to the next epoch each time it is iterated.

    Shuffling with a :class:`DistributedSampler` repeats the same order every epoch unless
    ``set_epoch`` is called; this loader calls it for you (epoch 0, 1, 2, ... per ``iter``).
    Call :meth:`set_epoch` to jump to a given epoch (for example when resuming).
    """

    def __init__(self, *args, global_batch_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.global_batch_size = global_batch_size
        self._next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    def __iter__(self):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._next_epoch)
        self._next_epoch += 1
        return super().__iter__()


def build_dataloader(
    dataset: Any,
    dataloader_args: dict | None,
    dp_size: int,
    dp_rank: int,
    sampler_cls: type | None = None,
    seed: int = 0,
) -> DataLoader:
    """A loader that yields this rank's ``batch_size // dp_size`` samples of each global batch.

    ``dataloader_args`` are DataLoader arguments; ``batch_size`` is the global batch and
    ``shuffle``/``drop_last`` move into the sampler, so the same seed gives the same global
    batches at every world size.
    """
    args = dict(dataloader_args or {})
    for key in ("sampler", "batch_sampler"):
        if args.get(key) is not None:
            raise ValueError(
                f"dataloader_args[{key!r}] is set, but atorch builds the sampler that splits the global "
                "batch over ranks; pass distributed_sampler_cls=YourSampler instead"
            )
    global_batch = int(args.pop("batch_size", 1))
    if global_batch % dp_size != 0:
        raise WorldSizeError(
            f"global batch size {global_batch} does not divide over {dp_size} data-parallel ranks; use a "
            f"multiple of {dp_size} (for example {max(dp_size, global_batch - global_batch % dp_size)})"
        )
    shuffle = bool(args.pop("shuffle", False))
    drop_last = bool(args.get("drop_last", False))
    if isinstance(dataset, IterableDataset):
        if shuffle or sampler_cls is not None:
            raise ValueError("an IterableDataset cannot be shuffled or sampled by atorch; shard it yourself")
        sampler = None
    else:
        sampler_cls = sampler_cls or DistributedSampler
        sampler = sampler_cls(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    if torch.cuda.is_available():
        args.setdefault("pin_memory", True)
    return GlobalBatchDataLoader(
        dataset, batch_size=global_batch // dp_size, sampler=sampler, global_batch_size=global_batch, **args
    )
