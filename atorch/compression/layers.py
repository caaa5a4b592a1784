"""Which layer types have g-nets, and how: a registry of ``(init_fn, build_fn)`` per layer type.

``init_fn(module)`` returns ``{param_name: [matrix shapes]}``: the parameters of ``module`` a
g-net predicts, each seen as one or more 2-D matrices (a convolution's weight is one matrix of
``(out, in * kh * kw)``; an attention input projection is three ``(embed, embed)`` matrices for
q, k and v, so that no tile straddles two of them). ``build_fn(module, param_name, matrices)``
puts the predicted matrices together into a tensor of the parameter's shape.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from atorch.errors import CompressionError

InitFn = Callable[[nn.Module], dict[str, list[tuple[int, int]]]]
BuildFn = Callable[[nn.Module, str, list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class GNetType:
    """How g-nets cover one layer type."""

    layer_type: type
    init_fn: InitFn
    build_fn: BuildFn


_GNET_TYPES: dict[type, GNetType] = {}


def register_gnet_type(layer_type: type, init_fn: InitFn, build_fn: BuildFn) -> GNetType:
    """Let :class:`GenomicBottleneck` cover the weights of ``layer_type`` modules.

    A type that is already registered is an error (unregister it first to replace it).
    Subclasses of a registered type use its entry unless registered themselves.

    Example (a layer whose ``kernel`` of shape ``(a, b, c)`` is one ``(a, b * c)`` matrix)::

        register_gnet_type(
            MyLayer,
            init_fn=lambda m: {"kernel": [(m.kernel.shape[0], m.kernel[0].numel())]},
            build_fn=lambda m, name, mats: mats[0].reshape(m.kernel.shape),
        )
    """
    if not isinstance(layer_type, type) or not issubclass(layer_type, nn.Module):
        raise CompressionError(f"register_gnet_type needs an nn.Module subclass, got {layer_type!r}")
    if layer_type in _GNET_TYPES:
        raise CompressionError(
            f"a g-net type for {layer_type.__qualname__} is already registered; call "
            f"unregister_gnet_type({layer_type.__qualname__}) first to replace it"
        )
    entry = GNetType(layer_type, init_fn, build_fn)
    _GNET_TYPES[layer_type] = entry
    return entry


def unregister_gnet_type(layer_type: type) -> None:
    """Remove ``layer_type``'s entry (for tests and plugins replacing their own)."""
    _GNET_TYPES.pop(layer_type, None)


def gnet_type_for(module: nn.Module) -> GNetType | None:
    """The entry for ``module``'s class, or for its nearest registered base class."""
    for cls in type(module).__mro__:
        if cls in _GNET_TYPES:
            return _GNET_TYPES[cls]
    return None


def _linear_init(module: nn.Linear) -> dict[str, list[tuple[int, int]]]:
    return {"weight": [tuple(module.weight.shape)]}


def _single_matrix(module: nn.Module, name: str, matrices: list[torch.Tensor]) -> torch.Tensor:
    return matrices[0].reshape(module.get_parameter(name).shape)


def _conv2d_init(module: nn.Conv2d) -> dict[str, list[tuple[int, int]]]:
    weight = module.weight
    return {"weight": [(weight.shape[0], weight[0].numel())]}


def _attention_init(module: nn.MultiheadAttention) -> dict[str, list[tuple[int, int]]]:
    # out_proj is an nn.Linear submodule and gets its own g-net through the Linear entry.
    if module.in_proj_weight is not None:
        rows = module.embed_dim
        return {"in_proj_weight": [(rows, module.embed_dim)] * 3}
    return {name: [tuple(module.get_parameter(name).shape)] for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight")}


def _attention_build(module: nn.Module, name: str, matrices: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(matrices, dim=0) if name == "in_proj_weight" else matrices[0]


register_gnet_type(nn.Linear, _linear_init, _single_matrix)
register_gnet_type(nn.Conv2d, _conv2d_init, _single_matrix)
register_gnet_type(nn.MultiheadAttention, _attention_init, _attention_build)
