"""The benchmarked job: a small Llama from a transformers config, generated tokens, its loss.

Every benchmark trains this same job so results compare; nothing is downloaded.
"""

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Size:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    vocab: int = 512
    seq: int = 64
    global_batch: int = 8

    def as_dict(self) -> dict:
        return asdict(self)


TINY = Size(hidden=32, layers=2, heads=2, vocab=64, seq=16, global_batch=4)
# An fp32 step of 250-390 ms on 2 CPU ranks: large enough that compute and communication, not per-step
# framework overhead, decide a comparison (issue 19 asks for steps of at least 100 ms).
MEDIUM = Size(hidden=256, layers=4, heads=4, vocab=1024, seq=128, global_batch=8)


def build_llama(size: Size, seed: int = 0) -> torch.nn.Module:
    """A Llama with ``size``'s dims, the same weights for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=int(2.75 * size.hidden),
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=max(1, size.heads // 2), max_position_embeddings=size.seq,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


class Tokens(Dataset):
    """Sequences counting up by a per-sample stride (mod vocab), generated from a seed."""

    def __init__(self, size: Size, n: int = 4096, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, size.vocab, (n, 1), generator=gen)
        stride = torch.randint(1, 4, (n, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(size.seq)) % size.vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def loss_func(batch, output):
    return output.loss


def hand_loader(dataset: Dataset, global_batch: int) -> DataLoader:
    """What a user writes without a framework: a DistributedSampler and the per-rank batch."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    sampler = DistributedSampler(dataset, shuffle=True, seed=0) if world > 1 else None
    return DataLoader(dataset, batch_size=global_batch // world, sampler=sampler, shuffle=sampler is None)


def batches(loader):
    """Batches forever (a new epoch when one ends)."""
    epoch = 0
    while True:
        if isinstance(getattr(loader, "sampler", None), DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def plain_step(model, optim, loader, autocast_dtype=None):
    """One step of the ordinary loop: forward, loss.backward(), step, zero_grad."""
    it = batches(loader)

    def step():
        batch = next(it)
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()

    return step


def atorch_step(model, size: Size, load_strategy, lr: float = 1e-3):
    """auto_accelerate on ``model`` with ``load_strategy``; one step of the documented loop (a
    pipeline runs its backward inside the model's call: ``backward_in_forward``)."""
    import atorch

    status, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, Tokens(size), loss_func, optim_args={"lr": lr},
        dataloader_args={"batch_size": size.global_batch, "shuffle": True}, model_input_format="unpack_dict",
        load_strategy=load_strategy,
    )
    if not status:
        raise RuntimeError(f"atorch could not apply {load_strategy}")
    it = batches(result.dataloader)
    optim_backward = result.args.get("use_optim_backward", False)
    in_forward = result.args.get("backward_in_forward", False)

    def step():
        batch = result.prepare_input(next(it), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        if optim_backward:
            result.optim.backward(loss)
        elif not in_forward:
            loss.backward()
        result.optim.step()
        result.optim.zero_grad()

    return step
