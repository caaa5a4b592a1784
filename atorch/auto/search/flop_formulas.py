"""FLOP formulas for the operators torch's table (``torch.utils.flop_counter``) leaves out, which
a probe on a real device reaches: without them a probe counted their FLOPs as 0, where the same
model on meta tensors (decomposed into matmuls) counted them all (tests/auto/search/test_ops.py).

- grouped matmuls: transformers' fused MoE experts (``_grouped_mm``, and its fallback op);
- fused fast paths torch takes where nothing needs a gradient (a frozen encoder in eval mode):
  ``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``;
- recurrent layers' fused kernels: ``mkldnn_rnn_layer`` (CPU), ``_cudnn_rnn``, ``miopen_rnn``;
- matrix-vector products and the rest of the matmul family: ``mv``, ``addmv``, ``addbmm``,
  ``_int_mm``, ``_scaled_mm_v2``, nn.Bilinear's ``_trilinear``.

Each counts 2 FLOPs a multiply-add, as torch's own formulas do. Every formula takes the shapes
``torch.utils.flop_counter.shape_wrapper`` gives (a tensor's shape, a list's shapes).
"""

import functools
import math

import torch


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A 2-D input whose rows the offsets split over a 3-D stack of weights (S x K by E x K x N:
    2 S K N, however the rows split), or a batch of matmuls; two 2-D operands grouped along K (a
    weight's gradient) make E outputs of M x N over K in all."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * math.prod(out_shape[1:]) * a_shape[-1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _lengths(x: torch.Tensor) -> list[int]:
    """The sequence lengths of a batch-first input: a nested tensor's own (a padding mask makes
    one in the fast paths), else the padded length of each sequence."""
    if x.is_nested:
        return [int(size[0]) for size in x._nested_tensor_size()]
    return [x.shape[1]] * x.shape[0]


def _native_mha(query, key, value, embed_dim, num_head, qkv_weight, *args, out_val=None, **kwargs) -> int:
    """nn.MultiheadAttention's fast path (batch first): q, k and v projected (each width x width),
    the scores and their weighted sum, the output projected; 2 FLOPs a multiply-add."""
    width = qkv_weight.shape[-1]
    return sum(2 * width * width * (2 * q + 2 * k) + 4 * q * k * width
               for q, k in zip(_lengths(query), _lengths(key), strict=True))


def _encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first,
                   eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                   *args, out_val=None, **kwargs) -> int:
    """nn.TransformerEncoderLayer's fast path (batch first): attention and the feed-forward."""
    weights = sum(w.numel() for w in (qkv_weight, proj_weight, ffn_weight_1, ffn_weight_2))
    width = qkv_weight.shape[-1]
    return sum(2 * length * weights + 4 * length * length * width for length in _lengths(src))


def _mkldnn_rnn_layer(input, weight0, weight1, *args, out_shape=None, **kwargs) -> int:
    """One layer and direction of an LSTM or GRU on a CPU: its input and hidden weights (gates x
    hidden rows) applied at every step of every sequence."""
    return 2 * math.prod(input[:-1]) * (math.prod(weight0) + math.prod(weight1))


def _fused_rnn(input, weight, *args, out_shape=None, **kwargs) -> int:
    """cuDNN's (or MIOpen's) whole RNN: every layer's and direction's matrices (the 2-D weights;
    biases are 1-D) applied at every step of every sequence."""
    steps = math.prod(input[:-1])
    return 2 * steps * sum(math.prod(shape) for shape in weight if len(shape) == 2)


def _trilinear(i1, i2, i3, expand1, expand2, expand3, *args, out_shape=None, **kwargs) -> int:
    """nn.Bilinear's kernel: the three operands, each unsqueezed where ``expand`` says, multiplied
    over their broadcast shape and summed: 2 FLOPs an element of it."""
    shapes = []
    for shape, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        full = list(shape)
        for dim in sorted(expand):
            full.insert(dim, 1)
        shapes.append(full)
    return 2 * math.prod(max(sizes) for sizes in zip(*shapes))


def _mv(matrix, vector, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(matrix)


def _addmv(bias, matrix, vector, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(matrix)


def _addbmm(bias, batch1, batch2, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(batch1) * batch2[-1]


def _mm(a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(a) * b[-1]


@functools.cache
def _wrapped(formula):
    from torch.utils.flop_counter import shape_wrapper

    return shape_wrapper(formula)


# by shapes (torch's shape_wrapper), or (the fast paths, whose inputs may be nested) by tensors
_BY_SHAPES = {"_grouped_mm": _grouped_mm, "mkldnn_rnn_layer": _mkldnn_rnn_layer, "_cudnn_rnn": _fused_rnn,
              "miopen_rnn": _fused_rnn, "mv": _mv, "addmv": _addmv, "addbmm": _addbmm, "_int_mm": _mm,
              "_scaled_mm_v2": _mm, "_trilinear": _trilinear}
_BY_TENSORS = {"_native_multi_head_attention": _native_mha, "_transformer_encoder_layer_fwd": _encoder_layer}


def extra_formulas() -> dict:
    """The formulas above by operator, as ``OpCounter`` looks them up: those this torch has
    (``_grouped_mm`` and ``_scaled_mm_v2`` are younger than torch 2.6), and transformers'
    fallback op once transformers has registered it."""
    found = {}
    for names, wrap in ((_BY_SHAPES, _wrapped), (_BY_TENSORS, lambda formula: formula)):
        for name, formula in names.items():
            op = getattr(torch.ops.aten, name, None)
            if op is not None:
                found[op] = wrap(formula)
    fallback = getattr(torch.ops.transformers, "grouped_mm_fallback", None)  # where grouped_mm cannot run
    if fallback is not None:
        found[fallback] = _wrapped(_grouped_mm)
    return found
