"""Small models and data for the genomic bottleneck tests, built from code (nothing downloaded)."""

import torch
import torch.nn.functional as F
from torch import nn

TEXT = (
    "the quick brown fox jumps over the lazy dog. a genomic bottleneck squeezes a network into a few "
    "small networks that write its weights. "
)
CHARS = sorted(set(TEXT))
SEQ = 32


def regression_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 1))


def regression_data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets from a smooth fixed function of the inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * x[:, 4:8].mean(1, keepdim=True)
    return x, y


class CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """A character-level transformer language model: 2 blocks of width 64."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(len(CHARS), dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, len(CHARS))

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def char_batches(steps: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """Random windows of ``SEQ + 1`` characters from the repeated text, as ids."""
    ids = torch.tensor([CHARS.index(c) for c in TEXT * 8])
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - SEQ - 1, (steps, batch), generator=gen)
    return [torch.stack([ids[s:s + SEQ + 1] for s in row.tolist()]) for row in starts]


def lm_loss(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))


# The g-net sizes the language-model tests use: tiles of 64x64, one hidden layer of 32.
LM_GNETS = {"tile_size": 64, "gnet_width": 32, "gnet_depth": 1}
