"""create_dataloader takes AxoNN's positional order (dataset, global_batch_size, micro_batch_size,
num_workers): a micro batch size in third place is never read as a number of workers."""

import pytest
import torch
from torch.utils.data import TensorDataset

from atorch.data import create_dataloader
from atorch.errors import AtorchConfigError, WorldSizeError

DATA = TensorDataset(torch.arange(256))


def test_third_positional_is_the_micro_batch_size():
    loader = create_dataloader(DATA, 64, 16)  # AxoNN's tutorial: (dataset, batch_size, micro_batch_size)
    assert loader.num_workers == 0
    assert (loader.batch_size, loader.micro_batch_size, loader.num_micro_batches) == (64, 16, 4)
    loader = create_dataloader(DATA, 64, 16, 2)
    assert (loader.micro_batch_size, loader.num_workers) == (16, 2)


def test_keyword_callers_keep_working():
    loader = create_dataloader(DATA, global_batch_size=32, num_workers=1, shuffle=True, drop_last=True)
    assert (loader.batch_size, loader.num_workers, loader.micro_batch_size, loader.num_micro_batches) == (32, 1, 32, 1)
    assert loader.sampler.shuffle and loader.sampler.drop_last
    assert create_dataloader(DATA, 32).micro_batch_size == 32  # default: one micro batch per rank batch


def test_misuse_is_an_error():
    with pytest.raises(WorldSizeError, match=r"micro_batch_size=3 does not divide each rank's batch of 64 samples.*"
                                             r"num_workers= by keyword"):
        create_dataloader(DATA, 64, 3)
    with pytest.raises(WorldSizeError, match="micro_batch_size=128 does not divide"):
        create_dataloader(DATA, 64, 128)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(AtorchConfigError, match=r"micro_batch_size=.* must be an integer >= 1"):
            create_dataloader(DATA, 64, bad)
    with pytest.raises(AtorchConfigError, match=r"num_workers=-1 must be an integer >= 0"):
        create_dataloader(DATA, 64, 16, -1)
    with pytest.raises(AtorchConfigError, match=r"positional arguments after num_workers.*by keyword"):
        create_dataloader(DATA, 64, 16, 0, True)
