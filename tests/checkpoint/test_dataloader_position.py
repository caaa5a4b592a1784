"""The loader auto_accelerate builds knows its position and resumes there, at any dp size."""

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from atorch.data import build_dataloader
from atorch.errors import AtorchConfigError

DATA = TensorDataset(torch.arange(16))


def _loader(dp_size=1, rank=0, **args):
    return build_dataloader(DATA, {"batch_size": 4, "shuffle": True, **args}, dp_size, rank, seed=3)


def _ids(batches):
    return [b[0].tolist() for b in batches]


def test_position_is_saved_and_resumed_mid_epoch_and_at_epoch_end():
    straight = _loader()
    expected = _ids(straight) + _ids(straight)  # epochs 0 and 1
    loader = _loader()
    batches = iter(loader)
    seen = _ids([next(batches), next(batches)])
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 2, "global_batch_size": 4}
    resumed = _loader()
    resumed.load_state_dict(state)
    rest = iter(resumed)
    assert len(rest) == 2
    assert seen + _ids(rest) + _ids(resumed) == expected
    # A finished epoch resumes at the start of the next one, not with an empty epoch.
    assert resumed.state_dict() == {"epoch": 2, "batches": 0, "global_batch_size": 4}


def test_position_carries_over_to_another_number_of_ranks():
    one = _loader()
    batches = iter(one)
    next(batches)
    state = one.state_dict()
    halves = []
    for rank in range(2):
        loader = _loader(2, rank)
        loader.load_state_dict(state)
        halves.append(_ids(loader))
    straight = _ids(_loader())
    assert [sorted(a + b) for a, b in zip(*halves)] == [sorted(b) for b in straight[1:]]


def test_workers_resume_too_and_the_global_random_stream_is_untouched():
    straight = _loader()
    epoch_1 = [_ids(straight), _ids(straight)][1]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = _loader(num_workers=1)
    loader.load_state_dict({"epoch": 1, "batches": 3, "global_batch_size": 4})
    assert _ids(loader) == epoch_1[3:] and len(epoch_1) == 4
    assert torch.equal(torch.get_rng_state(), before)


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(12))


def test_iterable_datasets_skip_by_reading_and_batch_sizes_must_match():
    loader = build_dataloader(Counting(), {"batch_size": 4}, 1, 0)
    loader.load_state_dict({"epoch": 0, "batches": 1, "global_batch_size": 4})
    assert [b.tolist() for b in loader] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(AtorchConfigError, match="global batches of 8 samples.*batch_size': 8"):
        loader.load_state_dict({"epoch": 0, "batches": 1, "global_batch_size": 8})
