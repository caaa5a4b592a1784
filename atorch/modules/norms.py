"""RMSNorm through ``torch.nn.functional.rms_norm`` (one fused kernel on CUDA)."""

import torch
import torch.nn.functional as F
from torch import nn


def is_hf_style_rmsnorm(module: nn.Module) -> bool:
    """Hugging Face's per-family RMSNorm classes (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, ...):
    a class named ``*RMSNorm`` with a 1-D ``weight`` and an epsilon, computing in fp32."""
    name = type(module).__name__
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    return (
        name.endswith("RMSNorm")
        and not isinstance(module, FusedRMSNorm)
        and isinstance(eps, float)
        and isinstance(weight, nn.Parameter)
        and weight.ndim == 1
    )


class FusedRMSNorm(nn.Module):
    """``weight * rms_norm(x in fp32)`` cast back to the input dtype, as Hugging Face computes it.

    The parameter is called ``weight`` like the module it replaces, so state dicts still load.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    @classmethod
    def from_original(cls, module: nn.Module) -> "FusedRMSNorm":
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        new = cls(module.weight.shape[0], eps, device=module.weight.device, dtype=module.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(module.weight)
        new.weight.requires_grad_(module.weight.requires_grad)
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=self.eps)
        return self.weight * normed.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
