"""NxD's parallel layers, in NxD's argument order, on atorch's region mappings.

Weights: the full (unsharded) weight is made in fp32 and filled by ``init_method`` (nn.Linear's
kaiming-uniform when None), then this rank keeps its slice (``stride`` interleaves slices as NxD
does). Biases are drawn in full too and sliced where they are split, with the full layer's
fan-in as bound, so the layer on N ranks equals the layer on one rank under the same seed. (NxD
draws each rank's bias piece on its own, and bounds RowParallelLinear's bias by the local
fan-in: there the ranks' layers together are not the one-rank layer.)
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from atorch import parallel_state as _state
from atorch.errors import NotSupportedError
from atorch.parallel_layers import ParallelEmbedding as _CoreEmbedding
from atorch.parallel_layers.layers import _divide, _mark, _size_rank, row_parallel_matmul
from atorch.parallel_layers.mappings import copy_to_region, gather_from_region, gather_from_sequence


def _tensor_group():
    return _state.get_tensor_model_parallel_group() if _state.model_parallel_is_initialized() else None


def _refuse(layer: str, pad: bool, device) -> None:
    if pad:
        raise NotSupportedError(f"{layer}(pad=True) (NxD's inference-only padding) is not ported; pad the model "
                                "with atorch.parallel_layers.pad_model before building the layers")
    if device is not None and torch.device(device).type not in ("cpu", "cuda", "meta"):
        raise NotSupportedError(f"{layer}(device={device!r}): XLA/Neuron devices are not supported; use the CPU or "
                                "CUDA (atorch.device())")


def _kaiming(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's default


def _local(full: torch.Tensor, dim: int, world: int, rank: int, stride: int) -> torch.Tensor:
    """This rank's slice: ``stride`` x ``world`` chunks along ``dim``, rank r takes chunks r, r+world, ..."""
    if world == 1:
        return full.clone()
    chunk = _divide(full.shape[dim], world * stride, "the split dim (with stride)")
    return torch.cat(full.split(chunk, dim=dim)[rank::world], dim=dim).clone()


def _init_full(shape, init_method, dtype, device, use_cpu_initialization) -> torch.Tensor:
    where = "cpu" if use_cpu_initialization or device is None else device
    full = torch.empty(*shape, dtype=torch.float32, device=where)  # initialized in fp32, as NxD does
    (init_method or _kaiming)(full)
    return full.to(dtype=dtype, device=device if device is not None else full.device)


def _bias(size: int, fan_in: int, dtype, device) -> torch.Tensor:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    return torch.empty(size, dtype=torch.float32, device=device).uniform_(-bound, bound).to(dtype)


class ColumnParallelLinear(nn.Module):
    """NxD's ``ColumnParallelLinear(input_size, output_size, bias, gather_output, dtype, device,
    stride, init_method, sequence_parallel_enabled, keep_master_weight, skip_bias_add, pad)``.

    The output features are split over the tensor-parallel group (from ``parallel_state``, or
    ``group=``). ``use_cpu_initialization`` (Megatron's name) makes the full weight on the CPU
    first; the values are the same either way. ``params_dtype`` is Megatron's name for ``dtype``.

    Example::

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        up = ColumnParallelLinear(512, 2048, gather_output=False, init_method=nn.init.xavier_normal_)
        down = RowParallelLinear(2048, 512, input_is_parallel=True)
        y = down(F.gelu(up(x)))      # equal to the serial pair built under the same seed
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Callable[[torch.Tensor], object] | None = None, sequence_parallel_enabled: bool = False,
                 keep_master_weight: bool = False, skip_bias_add: bool = False, pad: bool = False, *,
                 use_cpu_initialization: bool = False, params_dtype: torch.dtype | None = None, group=None):
        super().__init__()
        _refuse("ColumnParallelLinear", pad, device)
        if sequence_parallel_enabled and gather_output:
            raise NotSupportedError("ColumnParallelLinear(sequence_parallel_enabled=True, gather_output=True): the "
                                    "output stays split under sequence parallelism; pass gather_output=False")
        dtype = params_dtype or dtype
        self.group = group if group is not None else _tensor_group()
        self.world, rank = _size_rank(self.group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, self.world, "output_size")
        self.gather_output, self.skip_bias_add, self.stride = gather_output, skip_bias_add, stride
        self.sequence_parallel_enabled = sequence_parallel_enabled
        full = _init_full((output_size, input_size), init_method, dtype, device, use_cpu_initialization)
        self.weight = _mark(nn.Parameter(_local(full, 0, self.world, rank, stride)), 0, self.group)
        self.weight.partition_stride = stride
        self.master_weight = full if keep_master_weight else None
        if bias:
            full_bias = _bias(output_size, input_size, dtype, full.device)
            if gather_output:  # added after the gather: the whole bias on every rank (NxD's shape)
                self.bias = nn.Parameter(full_bias)
            else:
                self.bias = _mark(nn.Parameter(_local(full_bias, 0, self.world, rank, stride)), 0, self.group)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor):
        if self.sequence_parallel_enabled:
            input = gather_from_sequence(input, self.group)
        else:
            input = copy_to_region(input, self.group)
        output = F.linear(input, self.weight)
        if self.gather_output:
            output = gather_from_region(output, self.group)
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition}), tp={self.world}"


class RowParallelLinear(nn.Module):
    """NxD's ``RowParallelLinear(input_size, output_size, bias, input_is_parallel, dtype, device,
    stride, init_method, sequence_parallel_enabled, keep_master_weight, skip_bias_add, pad)``:
    the input features are split; partial products are summed (or reduce-scattered on the
    sequence dim under ``sequence_parallel_enabled``) and the whole bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 init_method: Callable[[torch.Tensor], object] | None = None, sequence_parallel_enabled: bool = False,
                 keep_master_weight: bool = False, skip_bias_add: bool = False, pad: bool = False, *,
                 use_cpu_initialization: bool = False, params_dtype: torch.dtype | None = None, group=None):
        super().__init__()
        _refuse("RowParallelLinear", pad, device)
        if sequence_parallel_enabled and not input_is_parallel:
            raise NotSupportedError("RowParallelLinear(sequence_parallel_enabled=True) needs input_is_parallel=True "
                                    "(NxD's and Megatron's layout)")
        dtype = params_dtype or dtype
        self.group = group if group is not None else _tensor_group()
        self.world, rank = _size_rank(self.group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, self.world, "input_size")
        self.input_is_parallel, self.skip_bias_add, self.stride = input_is_parallel, skip_bias_add, stride
        self.sequence_parallel_enabled = sequence_parallel_enabled
        full = _init_full((output_size, input_size), init_method, dtype, device, use_cpu_initialization)
        self.weight = _mark(nn.Parameter(_local(full, 1, self.world, rank, stride)), 1, self.group)
        self.weight.partition_stride = stride
        self.master_weight = full if keep_master_weight else None
        if bias:
            self.bias = nn.Parameter(_bias(output_size, input_size, dtype, full.device))
            # each rank adds it to its own tokens under sequence parallelism: the gradient is summed
            # over the group by atorch.parallel_layers.allreduce_sequence_parallel_grads
            self.bias.sequence_parallel = self.bias.sequence_parallel_enabled = sequence_parallel_enabled
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor):
        output = row_parallel_matmul(input, self.weight, self.group, self.input_is_parallel,
                                     self.sequence_parallel_enabled)
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output

    def extra_repr(self) -> str:
        return f"in={self.input_size} (local {self.input_size_per_partition}), out={self.output_size}, tp={self.world}"


class ParallelEmbedding(_CoreEmbedding):
    """NxD's ``ParallelEmbedding(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
    scale_grad_by_freq, sparse, init_method, device, dtype, shard_across_embedding, pad)``, and the
    2023 signature ``ParallelEmbedding(num_embeddings, embedding_dim, init_method, *, params_dtype,
    use_cpu_initialization)``: a callable third positional is the 2023 ``init_method``.

    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` change per-row maths that a split table
    cannot keep; they are refused rather than ignored.

    Example (both generations build the same table under the same seed)::

        ParallelEmbedding(vocab, hidden, init.normal_, use_cpu_initialization=True)   # NxD 2023
        ParallelEmbedding(vocab, hidden, init_method=init.normal_)                    # NxD today
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, init_method=nn.init.normal_, device=None, dtype: torch.dtype = torch.float32,
                 shard_across_embedding: bool = False, pad: bool = False, *, params_dtype: torch.dtype | None = None,
                 use_cpu_initialization: bool = False, group=None):
        if callable(padding_idx):  # NxD 2023: (num_embeddings, embedding_dim, init_method, *, ...)
            if init_method is not nn.init.normal_:
                raise NotSupportedError("ParallelEmbedding got init_method twice: third positional (NxD 2023's "
                                        "init_method) and init_method=; pass one")
            padding_idx, init_method = None, padding_idx
        if params_dtype is not None:  # NxD 2023's name for dtype
            if dtype != torch.float32 and dtype != params_dtype:
                raise NotSupportedError(f"ParallelEmbedding(dtype={dtype}, params_dtype={params_dtype}): two dtypes; "
                                        "pass one (params_dtype is NxD 2023's name for dtype)")
            dtype = params_dtype
        _refuse("ParallelEmbedding", pad, device)
        for name, value, default in (("max_norm", max_norm, None), ("scale_grad_by_freq", scale_grad_by_freq, False),
                                     ("sparse", sparse, False)):
            if value != default:
                raise NotSupportedError(f"ParallelEmbedding({name}={value!r}) is not supported on a split table; "
                                        f"leave {name} at {default!r}")
        # drawn in fp32 and cast, as NxD does (the same values in every dtype); use_cpu_initialization:
        # drawn on the CPU, then moved (the same values)
        super().__init__(num_embeddings, embedding_dim, init_method=init_method, dtype=torch.float32,
                         device=None if use_cpu_initialization else device,
                         shard_across_embedding=shard_across_embedding,
                         group=group if group is not None else _tensor_group())
        self.weight.data = self.weight.data.to(dtype=dtype, device=device if device is not None else "cpu")
        self.padding_idx = padding_idx
        if padding_idx is not None:  # nn.Embedding's zero row: zero it where this rank holds it
            with torch.no_grad():
                if shard_across_embedding:
                    self.weight[padding_idx].zero_()
                elif self.vocab_start <= padding_idx < self.vocab_end:
                    self.weight[padding_idx - self.vocab_start].zero_()
