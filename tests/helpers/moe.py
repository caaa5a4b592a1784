"""Mixture-of-experts test models: the tiny transformers-5 Mixtral of the MoE tests with its
blocks rebuilt as a router plus a ModuleList of expert MLPs (transformers 4's and hand-written
models' shape), holding the same weights, so both compute the same function."""

import torch
from torch import nn
from torch.nn import functional as F


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListedMoeBlock(nn.Module):
    """A router (``gate``, a Linear) and ``experts`` (a ModuleList), top-k of a softmax with the
    weights renormalized, written as transformers 4's Mixtral wrote it; ``tuple_out`` also
    returns the router logits, as that block did."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int, tuple_out: bool = False):
        super().__init__()
        self.top_k, self.tuple_out = top_k, tuple_out
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inner) for _ in range(experts))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(flat)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, choice = torch.where(chosen == index)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, choice, None])
        out = out.reshape(shape)
        return (out, logits) if self.tuple_out else out


class SigmoidRoutedBlock(ListedMoeBlock):
    """The same parts routed otherwise (independent sigmoids, DeepSeek-V3's scores): refused."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        weights, chosen = torch.topk(torch.sigmoid(self.gate(flat)), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, choice = torch.where(chosen == index)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, choice, None])
        return out.reshape(shape)


def listed_mixtral(block_cls=ListedMoeBlock):
    """tiny_moe("mixtral") with each fused MoE block rebuilt as ``block_cls``, weights copied."""
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    model = tiny_moe("mixtral")
    config = model.config
    for layer in model.model.layers:
        fused = layer.mlp
        block = block_cls(config.hidden_size, config.intermediate_size, config.num_local_experts,
                          config.num_experts_per_tok)
        inner = config.intermediate_size
        with torch.no_grad():
            block.gate.weight.copy_(fused.gate.weight)
            for index, expert in enumerate(block.experts):
                expert.w1.weight.copy_(fused.experts.gate_up_proj[index, :inner])
                expert.w3.weight.copy_(fused.experts.gate_up_proj[index, inner:])
                expert.w2.weight.copy_(fused.experts.down_proj[index])
        layer.mlp = block
    return model
