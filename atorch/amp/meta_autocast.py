"""Autocast's casts on the meta device, where ``torch.autocast`` does nothing.

``atorch plan`` probes a model on meta tensors to count the activations autograd saves. Under
``amp_native`` a real device runs the forward in ``torch.autocast``: matmuls take and give the
low-precision dtype, a list of ops runs in fp32, and everything else follows type promotion, so a
Hugging Face Llama keeps its residual stream, its norms' inputs and its loss in fp32 while its
projections are bf16. On meta tensors autocast dispatches nothing and every tensor stays fp32.

:class:`MetaAutocast` applies autocast's rules above autograd (a ``TorchFunctionMode``): it
casts the inputs of the ops CUDA's autocast runs in low precision to that dtype and the inputs
of the ops it runs in fp32 to fp32, as differentiable casts, so the tensors autograd saves have
the dtypes a real step's would. The op lists are autocast's (PyTorch's ``autocast_mode.cpp``),
CUDA's by default (a plan is for GPUs; CPU's differ: softmax, layer norm, pow stay in the input's
dtype there), at the level of the Python functions a model calls; an op reached only from inside
another C++ op is not seen.

Each cast of a parameter is cached for the forward (as autocast caches them) and reported to
``on_weight_cast``, so the probe counts it as a weight copy, not an activation.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
_MATMULS = {
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.scaled_dot_product_attention, F.prelu, torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm,
    _T.mm, torch.bmm, _T.bmm, torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, _T.addbmm,
    # a Python function whose projections autocast would cast one by one: this mode sees only the
    # call (a mode is off inside its own handler), so its inputs and weights are cast at once
    F.multi_head_attention_forward,
}
_LOSSES = {F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
           F.binary_cross_entropy_with_logits, F.poisson_nll_loss, F.cosine_embedding_loss, F.margin_ranking_loss,
           F.soft_margin_loss, F.multi_margin_loss, F.multilabel_margin_loss, F.triplet_margin_loss, F.ctc_loss}
# (ops run in the low-precision dtype, ops run in fp32), per device type, as autocast_mode.cpp lists them
RULES = {
    "cuda": (_MATMULS | {torch.mv, _T.mv, torch.addmv, torch.chain_matmul, torch.linalg.multi_dot, torch.einsum},
             _LOSSES | {F.softmax, F.log_softmax, torch.softmax, _T.softmax, torch.log_softmax, _T.log_softmax,
                        F.layer_norm, F.group_norm, torch.norm, _T.norm, F.softplus, torch.exp, _T.exp, torch.log,
                        _T.log, torch.pow, _T.pow, _T.__pow__, torch.rsqrt, _T.rsqrt, torch.reciprocal,
                        _T.reciprocal, torch.cumsum, _T.cumsum, torch.cumprod, _T.cumprod, torch.sum, _T.sum,
                        torch.prod, _T.prod, torch.logsumexp, _T.logsumexp, torch.erfinv, torch.expm1,
                        torch.log1p, torch.log2, torch.log10, torch.acos, torch.asin, torch.cosh, torch.sinh,
                        torch.tan, torch.cdist, torch.dist, F.cosine_similarity}),
    "cpu": (_MATMULS, _LOSSES | {F.binary_cross_entropy, torch.prod, _T.prod, torch.cdist}),
}


class MetaAutocast(TorchFunctionMode):
    """``with MetaAutocast(torch.bfloat16): model(**batch)`` on meta tensors: autocast's dtypes."""

    def __init__(self, dtype: torch.dtype, on_weight_cast: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 device_type: str = "cuda"):
        super().__init__()
        self.dtype, self.on_weight_cast = dtype, on_weight_cast
        self.low, self.full = RULES[device_type]
        self._cache: dict[tuple, torch.Tensor] = {}  # (id(parameter), dtype) -> its cast, for this forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.low:
            args, kwargs = self._cast((args, kwargs), self.dtype)
        elif func in self.full:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        return func(*args, **kwargs)

    def _cast(self, tree, dtype: torch.dtype):
        def one(value):
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
                return value
            if not isinstance(value, torch.nn.Parameter):
                return value.to(dtype)
            key = (id(value), dtype)
            if key not in self._cache:
                self._cache[key] = value.to(dtype)
                if self.on_weight_cast is not None:
                    self.on_weight_cast(value, self._cache[key])
            return self._cache[key]

        return torch.utils._pytree.tree_map(one, tree)


class MetaAutocastForward:
    """``module.forward`` under :class:`MetaAutocast` (what ``amp_native`` installs on a meta
    model instead of ``torch.autocast``); ``on_weight_cast`` may be set before the forward runs."""

    def __init__(self, forward, dtype: torch.dtype, device_type: str = "cuda"):
        self.forward, self.dtype, self.device_type = forward, dtype, device_type
        self.on_weight_cast: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def __call__(self, *args, **kwargs):
        with MetaAutocast(self.dtype, self.on_weight_cast, self.device_type):
            return self.forward(*args, **kwargs)
