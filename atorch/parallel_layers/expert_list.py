"""Expert parallelism for a mixture-of-experts block that holds its experts as a ``ModuleList``
beside a router (``gate`` or ``router``): the shape of transformers 4's Mixtral and Qwen2-MoE,
and of hand-written models.

The block's own forward loops over every expert; under expert parallelism a rank holds some of
them only. :class:`RoutedBlock` computes the block as such blocks do: router logits, a softmax
in fp32, the top-k, their weights renormalized or not, each (token, choice) pair through its
expert and weighted, summed per token, plus a shared expert (gated by a sigmoid where the block
has ``shared_expert_gate``). Which of those the block does is not read from its code:
:func:`match_block` runs the block's own forward and :class:`RoutedBlock` (all experts, on this
rank) on the same probe and keeps the variant that gives the same output, or refuses the block
with the reason. What differs (another router, jitter, a capacity of its own) is refused, not
trained otherwise.
"""

import torch
from torch import nn
from torch.nn import functional as F

from atorch.parallel_layers.expert_dispatch import Dispatch, mark_slice, over_copies

ROUTERS = ("gate", "router")
PROBE_TOKENS = 64


class RoutedBlock:
    """The forward of a ModuleList MoE block: ``block(hidden_states)`` -> output, with the router
    logits beside it where the block returns them. ``experts`` is called as
    ``experts(hidden_states, top_k_index, top_k_weights)``: :class:`_SerialExperts`, or a
    :class:`Dispatch` over the ranks."""

    def __init__(self, block: nn.Module, top_k: int, normalize: bool, returns_logits: bool, experts):
        self.block, self.top_k, self.normalize, self.returns_logits = block, top_k, normalize, returns_logits
        self.experts = experts

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        block = self.block
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = router_of(block)(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, index, weights.to(flat.dtype))
        shared = getattr(block, "shared_expert", None)
        if shared is not None:
            gate = getattr(block, "shared_expert_gate", None)
            extra = shared(flat)
            out = out + (torch.sigmoid(gate(flat)) * extra if gate is not None else extra)
        out = out.reshape(hidden_states.shape)
        return (out, logits) if self.returns_logits else out


def router_of(block: nn.Module) -> nn.Module:
    return next(getattr(block, name) for name in ROUTERS if isinstance(getattr(block, name, None), nn.Module))


def top_k_of(block: nn.Module, config) -> int | None:
    for owner, name in ((block, "top_k"), (block, "num_experts_per_tok"), (config, "num_experts_per_tok")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class _SerialExperts:
    """Every expert of ``experts`` on this rank: the reference :func:`match_block` checks against."""

    def __init__(self, experts: nn.ModuleList):
        self.experts = experts

    def __call__(self, flat: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(flat)
        for expert, module in enumerate(self.experts):
            token, choice = torch.where(index == expert)
            if token.numel():
                out = out.index_add(0, token, (module(flat[token]) * weights[token, choice, None]).to(out.dtype))
        return out


def match_block(block: nn.Module, experts: nn.ModuleList, config) -> tuple[RoutedBlock | None, str | None]:
    """(the :class:`RoutedBlock` that computes what ``block``'s own forward does, None) or (None,
    why none does)."""
    name = type(block).__name__
    if not any(isinstance(getattr(block, r, None), nn.Module) for r in ROUTERS):
        return None, f"{name} has no router module (gate or router)"
    top_k = top_k_of(block, config)
    if top_k is None:
        return None, f"{name} says nowhere how many experts a token goes to (top_k or num_experts_per_tok)"
    weight = next(experts.parameters(), None)
    if weight is None or weight.is_meta:
        return None, f"{name}'s experts hold no weights to probe"
    hidden = getattr(config, "hidden_size", None) or in_features(experts[0])
    if hidden is None:
        return None, f"{name}: the experts' input width is not known (no hidden_size, no first Linear)"
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(2, PROBE_TOKENS // 2, hidden, generator=generator).to(weight.device, weight.dtype)
    training = block.training
    block.eval()  # no jitter, no dropout: the same draw on both sides
    try:
        with torch.no_grad():
            try:
                expected = block(probe)
            except Exception as error:  # noqa: BLE001 - the block's own forward on a probe: reported
                return None, f"{name}'s forward failed on a probe of {tuple(probe.shape)}: {error}"
            returns_logits = isinstance(expected, tuple)
            target = expected[0] if returns_logits else expected
            for normalize in (True, False):
                routed = RoutedBlock(block, top_k, normalize, returns_logits, _SerialExperts(experts))
                got = routed(probe)
                got = got[0] if returns_logits else got
                if torch.is_tensor(target) and got.shape == target.shape and torch.allclose(got, target, atol=1e-5,
                                                                                             rtol=1e-4):
                    return routed, None
    finally:
        block.train(training)
    return None, (f"{name}'s forward is not a softmax top-{top_k} routing over its experts (with or without "
                  "renormalized weights, plus a shared expert) as expert_parallel computes it: it would train "
                  "another model; leave expert_parallel out for this model")


def in_features(module: nn.Module) -> int | None:
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else None


class _ListedSlice:
    """The rows sent to this rank through its experts of a ModuleList (``ids`` local)."""

    def __init__(self, experts: nn.ModuleList, first: int):
        self.experts, self.first = experts, first

    def __call__(self, rows: torch.Tensor, ids: torch.Tensor, local: int) -> torch.Tensor:
        out = rows.new_zeros(rows.shape)
        for expert in range(local):
            # Every expert is called, with no rows where none came: its (zero) gradients and, under
            # fsdp, its gathers and reduce-scatters run on every rank alike.
            where = (ids == expert).nonzero().squeeze(-1)
            out = out.index_add(0, where, self.experts[self.first + expert](rows[where]).to(out.dtype))
        return out


def shard_listed_experts(block: nn.Module, experts: nn.ModuleList, routed: RoutedBlock, group, replicas=None,
                         capacity_factor: float | None = None, copies_of: int | None = None) -> None:
    """Keep this rank's experts of ``experts`` (the others become empty placeholders, so the kept
    ones keep their names: ``experts.5.w1.weight`` on the rank that holds expert 5) and compute
    ``block`` as ``routed`` does, its tokens dispatched over ``group``. With ``copies_of`` (the
    data-parallel ranks), fsdp shards each kept expert over ``replicas`` (:func:`over_copies`)."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = len(experts) // size
    first = rank * local
    for index in range(len(experts)):
        if first <= index < first + local:
            for param in experts[index].parameters():
                mark_slice(param, block, group, replicas, hooks=copies_of is None)
            if copies_of is not None:
                over_copies(experts[index], group, replicas, copies_of)
        else:
            experts[index] = nn.Module()  # another rank's expert: nothing held here
    routed.experts = Dispatch(group, local, _ListedSlice(experts, first), capacity_factor)
    block.forward = routed
