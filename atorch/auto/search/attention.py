"""Attention as a fused (flash) kernel saves it, for activation probes on the meta device.

On meta (and CPU) tensors ``scaled_dot_product_attention`` runs its math form, which saves the
seq x seq attention probabilities for backward; on an H100 PyTorch picks the flash kernel, which
saves only q, k, v, the output and a log-sum-exp per row. Under :class:`FlashAttentionProbe` an
unmasked (or causal) SDPA call runs ``aten._scaled_dot_product_flash_attention`` instead, so the
saved bytes a probe counts are the flash kernel's; its FLOPs are counted the same. A call with an
explicit mask runs as before (the flash kernel takes none).

Dropout likewise: on meta and CPU tensors ``F.dropout`` runs unfused (an fp32 noise tensor drawn,
scaled and multiplied in, the noise saved); on a GPU PyTorch runs one ``native_dropout`` kernel,
which saves a bool mask. The probe runs that kernel's op (a BERT-base step's traffic read 1.29x
the fused kernel's, its saved activations 1.08x, until 2026-11-29).
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class FlashAttentionProbe(TorchFunctionMode):
    """Route SDPA calls without a mask to the flash kernel's op (it has meta and autograd rules),
    and dropout in training to the fused kernel's (``native_dropout``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.dropout:
            return _fused_dropout(func, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        if bound.get("attn_mask") is not None or q.dim() != 4:
            return func(*args, **kwargs)
        # grouped-query attention (enable_gqa): a GPU's flash kernel reads the k/v heads as they are
        # and saves them so; the meta op takes them so too (expanded, a Llama's saved k and v had
        # been counted at q's heads: 1.05x a small Llama's saved bytes, until 2026-11-29)
        if k.shape[1] != q.shape[1] and not q.is_meta:  # other devices' op wants as many as q
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, bound.get("dropout_p", 0.0), bool(bound.get("is_causal", False)), scale=bound.get("scale"))
        return out[0]


def _fused_dropout(func, args, kwargs):
    bound = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
    p, training = bound.get("p", 0.5), bound.get("training", True)
    if training and 0 < p < 1:
        return torch.native_dropout(bound["input"], p, True)[0]
    return func(*args, **kwargs)
