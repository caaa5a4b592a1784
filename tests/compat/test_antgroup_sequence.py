"""ATorch's sequence parallelism with sp_size (Ulysses: all-to-all over the sequence around attention)
on 2 gloo ranks: each rank's output and input gradients equal its chunk of the serial attention's."""

import pytest
import torch

from atorch.compat.antgroup import distributed as atd
from atorch.compat.antgroup.sequence import UlyssesAttention
from atorch.errors import WorldSizeError
from tests.helpers.dist import run_distributed

SEQ, BATCH, HEADS, DIM = 8, 2, 4, 4


def attention(q, k, v):
    """Causal softmax attention over the sequence, layout [s, b, h, d]."""
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / DIM ** 0.5
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    return torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen) for _ in range(3)]
    weight = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen)
    return qkv, weight


def _serial():
    (q, k, v), weight = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    (out * weight).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def _ranked() -> dict:
    atd.create_sequence_parallel_group(2)
    size, rank = atd.get_sequence_parallel_size(), atd.get_sequence_parallel_rank()
    (q, k, v), weight = _inputs()
    chunk = SEQ // size
    q, k, v = (t[rank * chunk:(rank + 1) * chunk].clone().requires_grad_() for t in (q, k, v))
    out = UlyssesAttention(attention)(q, k, v)
    (out * weight[rank * chunk:(rank + 1) * chunk]).sum().backward()
    alone = attention(q.detach(), k.detach(), v.detach())  # control: the chunk without the all-to-all
    with pytest.raises(WorldSizeError, match="heads must divide"):
        UlyssesAttention(attention)(*(torch.zeros(chunk, BATCH, 3, DIM) for _ in range(3)))
    atd.destroy_sequence_parallel_group()
    return {"size_rank": (size, rank), "out": out.detach(), "grads": [t.grad for t in (q, k, v)], "alone": alone,
            "after": atd.get_sequence_parallel_size()}


def test_ulysses_attention_on_2_ranks_matches_serial():
    ref_out, ref_grads = _serial()
    for rank, result in enumerate(run_distributed(_ranked, 2)):
        assert result["size_rank"] == (2, rank) and result["after"] == 1
        rows = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
        torch.testing.assert_close(result["out"], ref_out[rows], rtol=1e-5, atol=1e-6)
        for got, want in zip(result["grads"], ref_grads, strict=True):
            torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-6)
        if rank == 1:  # rank 0's causal chunk sees only itself either way; rank 1's needs rank 0's keys
            assert (result["alone"] - ref_out[rows]).abs().max() > 1e-3
