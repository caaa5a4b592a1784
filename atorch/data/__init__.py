"""Dataloaders that split a global batch over data-parallel ranks."""

from atorch.data.intra_layer import create_dataloader
from atorch.data.loader import GlobalBatchDataLoader, build_dataloader

__all__ = ["GlobalBatchDataLoader", "build_dataloader", "create_dataloader"]
