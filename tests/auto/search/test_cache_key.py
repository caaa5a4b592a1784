"""The search cache is keyed by the job: another model, sample shape, batch, world or budget is
another entry, so a search never answers from another job's result (issue 36: a newcomer's first
search came from another job's cache)."""

from types import SimpleNamespace

import torch

from atorch.auto.search import cache
from atorch.auto.search.report import SearchReport
from atorch.auto.strategy import Strategy


class Tokens(torch.utils.data.Dataset):
    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"input_ids": torch.zeros(self.length, dtype=torch.long)}


def _key(width: int = 8, length: int = 16, batch: int = 8, world: int = 2, budget: int = 2**30) -> str:
    model = torch.nn.Sequential(torch.nn.Embedding(32, width), torch.nn.Linear(width, 32))
    ctx = SimpleNamespace(optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3}, loss_func=len, dataset=Tokens(length),
                          dataloader_args={"batch_size": batch}, model_input_format="unpack_dict")
    device = SimpleNamespace(world_size=world, device=torch.device("cpu"), capability=None)
    return cache.cache_key(model, ctx, device, budget, {})


def test_the_key_is_the_job():
    assert _key() == _key()
    others = [_key(width=16), _key(length=32), _key(batch=16), _key(world=4), _key(budget=2**31)]
    assert len({_key(), *others}) == 1 + len(others)


def test_an_entry_of_another_job_is_not_used(tmp_path):
    strategy = Strategy([("parallel_mode", {"dims": [["data", 2]]})])
    cache.store(tmp_path, _key(length=16), strategy, SearchReport(world_size=2, device="cpu", memory_budget_bytes=2**30))
    assert cache.load(tmp_path, _key(length=16)) is not None
    assert cache.load(tmp_path, _key(length=32)) is None  # the same dataset class and length, longer sequences
