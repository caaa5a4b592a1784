"""Ulysses-style sequence parallelism, ATorch's meaning of ``sequence_parallel`` with ``sp_size``.

Each of ``sp_size`` ranks holds a chunk of the sequence. Around attention, an all-to-all trades
the sequence split for a head split (every rank then attends over the whole sequence for
``heads / sp_size`` heads) and a second all-to-all trades it back. This is not atorch's
``sequence_parallel`` method, which is Megatron-style (the sequence split between
tensor-parallel blocks); the names here say ``ulysses`` / ``seq_all_to_all`` so the two are not
confused.

    from atorch.compat.antgroup.distributed import create_sequence_parallel_group, get_sequence_parallel_group
    from atorch.compat.antgroup.sequence import UlyssesAttention

    create_sequence_parallel_group(2)
    attn = UlyssesAttention(local_attention, get_sequence_parallel_group())   # [s/p, b, h, d] in and out
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atorch.distributed import env
from atorch.errors import WorldSizeError


class _Sequence:
    mesh: DeviceMesh | None = None
    size = 1


def create_sequence_parallel_group(sp_size: int) -> None:
    """ATorch's ``create_sequence_parallel_group``: groups of ``sp_size`` contiguous ranks."""
    sp_size, world = int(sp_size), env.world_size()
    if sp_size <= 1:
        _Sequence.mesh, _Sequence.size = None, 1
        return
    if world % sp_size:
        raise WorldSizeError(f"sequence parallel size {sp_size} does not divide the world size {world}")
    _Sequence.mesh = DeviceMesh("cpu" if not torch.cuda.is_available() else "cuda",
                                torch.arange(world).reshape(-1, sp_size), mesh_dim_names=("sp_replica", "sequence"))
    _Sequence.size = sp_size


def destroy_sequence_parallel_group() -> None:
    _Sequence.mesh, _Sequence.size = None, 1


def get_sequence_parallel_group():
    return None if _Sequence.mesh is None else _Sequence.mesh.get_group("sequence")


def get_sequence_parallel_size() -> int:
    return _Sequence.size


def get_sequence_parallel_rank() -> int:
    return 0 if _Sequence.mesh is None else _Sequence.mesh.get_local_rank("sequence")


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_idx, gather_idx, group):
        ctx.args = (scatter_idx, gather_idx, group)
        return _all_to_all(x, scatter_idx, gather_idx, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_idx, gather_idx, group = ctx.args
        return _all_to_all(grad, gather_idx, scatter_idx, group), None, None, None


def _all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[scatter_idx] % size:
        raise WorldSizeError(f"dim {scatter_idx} of size {x.shape[scatter_idx]} does not split over {size} "
                             "sequence-parallel ranks (the heads must divide by sp_size)")
    inputs = [t.contiguous() for t in torch.tensor_split(x, size, scatter_idx)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_idx).contiguous()


def seq_all_to_all(input: torch.Tensor, scatter_idx: int, gather_idx: int, group=None) -> torch.Tensor:
    """ATorch's ``seq_all_to_all``: split ``scatter_idx`` over the group, gather ``gather_idx``
    (backward: the reverse)."""
    group = group if group is not None else get_sequence_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return input
    return _SeqAllToAll.apply(input, scatter_idx, gather_idx, group)


class UlyssesAttention(nn.Module):
    """``local_attention(q, k, v, *args)`` over the whole sequence for this rank's heads.

    ``q``, ``k``, ``v``: this rank's sequence chunk, shaped ``[s/p, b, h, d]`` by default
    (``scatter_idx`` is the head dim, ``gather_idx`` the sequence dim, as in DeepSpeed-Ulysses);
    the output has the same layout. The result equals ``local_attention`` on the whole sequence,
    chunked: heads do not interact, so splitting them is exact.
    """

    def __init__(self, local_attention: nn.Module, sequence_process_group=None, scatter_idx: int = 2,
                 gather_idx: int = 0):
        super().__init__()
        self.local_attn, self.group = local_attention, sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        group = self.group if self.group is not None else get_sequence_parallel_group()
        q, k, v = (seq_all_to_all(t, self.scatter_idx, self.gather_idx, group) for t in (query, key, value))
        out = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(out, self.gather_idx, self.scatter_idx, group)
