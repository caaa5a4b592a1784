import pytest
import torch
from torch.utils.data import TensorDataset

from atorch.data import build_dataloader
from atorch.errors import WorldSizeError

DATA = TensorDataset(torch.arange(16))


def _global_batches(shuffle, dp_size, epochs=1, seed=0):
    loaders = [build_dataloader(DATA, {"batch_size": 4, "shuffle": shuffle}, dp_size, r, seed=seed) for r in range(dp_size)]
    out = []
    for _ in range(epochs):
        per_rank = [[b[0].tolist() for b in loader] for loader in loaders]
        out.append([sorted(sum((rank[i] for rank in per_rank), [])) for i in range(len(per_rank[0]))])
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_batches_do_not_depend_on_dp_size(shuffle):
    assert _global_batches(shuffle, 1, epochs=2) == _global_batches(shuffle, 2, epochs=2) == _global_batches(shuffle, 4, epochs=2)


def test_each_rank_gets_its_share():
    loader = build_dataloader(DATA, {"batch_size": 4}, 2, 1)
    assert loader.batch_size == 2 and loader.global_batch_size == 4
    assert next(iter(loader))[0].tolist() == [1, 3]


def test_epochs_advance_and_can_be_set():
    one, two = _global_batches(True, 2, epochs=2)
    assert one != two
    loader = build_dataloader(DATA, {"batch_size": 4, "shuffle": True}, 1, 0)
    first = [b[0].tolist() for b in loader]
    loader.set_epoch(0)
    assert [b[0].tolist() for b in loader] == first


def test_batch_that_does_not_divide():
    with pytest.raises(WorldSizeError, match="does not divide over 4.*multiple of 4"):
        build_dataloader(DATA, {"batch_size": 6}, 4, 0)


def test_user_sampler_is_refused_with_a_pointer():
    with pytest.raises(ValueError, match="distributed_sampler_cls"):
        build_dataloader(DATA, {"batch_size": 4, "sampler": [0, 1]}, 1, 0)


def test_custom_sampler_class():
    class EveryOther(torch.utils.data.DistributedSampler):
        pass

    loader = build_dataloader(DATA, {"batch_size": 2}, 2, 0, sampler_cls=EveryOther)
    assert isinstance(loader.sampler, EveryOther) and loader.sampler.num_replicas == 2
