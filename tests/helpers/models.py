"""Small models and data built from code (nothing is downloaded)."""

import torch
import torch.nn.functional as F
from torch import nn

import atorch
from atorch.auto import auto_accelerate

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def lm_loss(batch, logits):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["labels"].reshape(-1))


def global_mean(value: torch.Tensor) -> float:
    import torch.distributed as dist

    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def local_numel(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)


def optimizer_state_numel(optim) -> int:
    """Elements of optimizer state this rank holds (inside AmpOptimizer / ZeroRedundancyOptimizer)."""
    inner = getattr(optim, "optimizer", optim)
    inner = getattr(inner, "optim", inner)
    return local_numel(v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.ndim > 0)


def run_steps(result, steps: int, clip: float | None = None) -> tuple[list[float], list[float]]:
    """The user's training loop over an auto_accelerate result: global losses (and norms when clipping)."""
    from atorch.auto import clip_grad_norm

    losses, norms = [], []
    batches = iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(batches), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        if result.args["use_optim_backward"]:  # DeepSpeed: the engine runs backward and zeroes grads
            result.optim.backward(loss)
            result.optim.step()
        else:
            loss.backward()
            if clip is not None:
                norms.append(clip_grad_norm(result.model, clip).item())
            result.optim.step()
            result.optim.zero_grad()
        losses.append(global_mean(loss))
    return losses, norms


def train_losses(load_strategy, steps: int = 5, batch_size: int = 8, lr: float = 0.05, shuffle: bool = False,
                 optim=torch.optim.SGD, seed: int = 0, clip: float | None = None, freeze_embed: bool = False,
                 **kwargs) -> dict:
    """Train the tiny transformer through auto_accelerate; return global losses and the strategy."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    if freeze_embed:
        model.embed.weight.requires_grad_(False)
    status, result, strategy = auto_accelerate(
        model,
        optim,
        TokenDataset(),
        lm_loss,
        optim_args={"lr": lr},
        dataloader_args={"batch_size": batch_size, "shuffle": shuffle},
        model_input_format="unpack_dict",
        load_strategy=load_strategy,
        **kwargs,
    )
    losses, norms = run_steps(result, steps, clip)
    return {
        "status": status,
        "losses": losses,
        "norms": norms,
        "strategy": strategy.to_json(),
        "model_type": type(result.model).__name__,
        "optim_type": type(result.optim).__name__,
        "state_numel": None if result.args["use_optim_backward"] else optimizer_state_numel(result.optim),
        "args": dict(result.args),
        "param_numel": local_numel(result.model.parameters()),
    }
