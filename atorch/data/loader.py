"""Dataloaders over a global batch: each data-parallel rank gets its share (strong scaling)."""

import itertools
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from atorch.errors import AtorchConfigError, WorldSizeError


class GlobalBatchDataLoader(DataLoader):
    """A DataLoader whose distributed sampler moves to the next epoch each time it is iterated.

    Shuffling with a :class:`DistributedSampler` repeats the same order every epoch unless
    ``set_epoch`` is called; this loader calls it for you (epoch 0, 1, 2, ... per ``iter``).
    Call :meth:`set_epoch` to jump to a given epoch (for example when resuming).

    It also knows its position: :meth:`state_dict` returns the epoch and how many batches of it
    were handed out, and after :meth:`load_state_dict` the next ``iter`` starts at the following
    batch of that epoch (skipped by index, no data is read). ``atorch.checkpoint`` saves it.
    """

    def __init__(self, *args, global_batch_size: int, seed: tuple[int, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.global_batch_size = global_batch_size
        # (sampler seed, data-parallel rank): each epoch's iterator draws its worker seeds from
        # its own generator instead of the global stream, so iterating (or resuming) never moves
        # the random numbers the model sees. None when the user passed a generator.
        self._seed = seed if self.generator is None else None
        self._next_epoch = 0
        self._epoch = -1  # the epoch of the latest iterator; -1 before the first
        self._served = 0  # batches of that epoch handed out so far
        self._skip = 0  # batches the next iterator skips (set by load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    def __iter__(self):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._next_epoch)
        self._epoch, self._served = self._next_epoch, self._skip
        if self._seed is not None:
            self.generator = torch.Generator().manual_seed(hash((*self._seed, self._epoch)) & (2**63 - 1))
        self._next_epoch += 1
        skip, self._skip = self._skip, 0
        if skip and isinstance(self.dataset, IterableDataset):
            iterator = super().__iter__()
            for _ in range(skip):  # no indices to skip: read the batches and drop them
                next(iterator, None)
            return _Counting(iterator, self)
        self._pending_skip = skip
        try:
            return _Counting(super().__iter__(), self)
        finally:
            self._pending_skip = 0

    @property
    def _index_sampler(self):
        # DataLoader's iterators draw batch indices from this property when they are created;
        # resuming skips the batches already served here, before any sample is loaded.
        sampler = super()._index_sampler
        skip = getattr(self, "_pending_skip", 0)
        return _SkipBatches(sampler, skip) if skip else sampler

    def state_dict(self) -> dict:
        """Where this loader stands: ``{"epoch", "batches", "global_batch_size"}`` (plain data)."""
        if self._epoch < 0:
            return {"epoch": self._next_epoch, "batches": self._skip, "global_batch_size": self.global_batch_size}
        epoch, served = self._epoch, self._served
        try:
            if served >= len(self):  # the epoch is over: the next iter starts the following one
                epoch, served = self._next_epoch, 0
        except TypeError:  # an IterableDataset without a length
            pass
        return {"epoch": epoch, "batches": served, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter`` continue where ``state`` (from :meth:`state_dict`) stood.

        The position is counted in global batches, so it carries over to another number of
        data-parallel ranks as long as the global batch size is the same.
        """
        if int(state["global_batch_size"]) != self.global_batch_size:
            raise AtorchConfigError(
                f"the saved dataloader position counts global batches of {state['global_batch_size']} samples, "
                f"this loader's global batch is {self.global_batch_size}; resume with "
                f"dataloader_args={{'batch_size': {state['global_batch_size']}}} or do not restore the position"
            )
        self._next_epoch, self._skip = int(state["epoch"]), int(state["batches"])
        self._epoch, self._served = -1, 0


class _Counting:
    """A loader iterator that tells its loader how many batches it has handed out."""

    def __init__(self, iterator, loader: GlobalBatchDataLoader):
        self.iterator, self.loader = iterator, loader

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        self.loader._served += 1
        return batch

    def __len__(self) -> int:
        return len(self.iterator)


class _SkipBatches:
    """A batch sampler without its first ``skip`` batches."""

    def __init__(self, batch_sampler, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self):
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


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
        dataset, batch_size=global_batch // dp_size, sampler=sampler, global_batch_size=global_batch,
        seed=(seed, dp_rank), **args
    )
