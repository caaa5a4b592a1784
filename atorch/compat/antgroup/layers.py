"""ATorch's tensor-parallel layers (``atorch.modules.distributed_modules.layers``) on atorch.

    from atorch.modules.distributed_modules.layers import ColumnParallelLinear, RowParallelLinear
        ->  from atorch.compat.antgroup.layers import ColumnParallelLinear, RowParallelLinear

ATorch's contract, kept here (atorch's own and NxD's ColumnParallelLinear gather by default):

- ``ColumnParallelLinear`` returns this rank's slice of the output features (never gathered);
  its bias is split with them.
- ``RowParallelLinear`` takes the input split on its last dim (``input_is_parallel=True`` by
  default; ``False`` splits a whole input), sums the partial products over the group and adds
  the whole bias once.
- The full weight is drawn by ``init_method`` (xavier-normal by default) and sliced, so the
  layers on N ranks hold the one-rank layer under the same seed; biases start at zero.
- ``orig_module=nn.Linear`` takes that layer's weight and bias (sliced).
- ``process_group`` is a group name of :func:`atorch.compat.antgroup.distributed.create_parallel_group`
  (``"tensor"`` or ATorch's ``"model"``) or a ProcessGroup.
"""

import torch
from torch import nn

from atorch.compat.antgroup.distributed import parallel_group
from atorch.compat.nxd.parallel_layers import layers as _nxd
from atorch.errors import NotSupportedError


def _group(layer: str, process_group, ranks):
    # a name the Topology lacks (or no Topology): one rank holds the whole layer
    group = parallel_group(process_group) if isinstance(process_group, str) else process_group
    if ranks is not None:
        have = list(range(1)) if group is None else torch.distributed.get_process_group_ranks(group)
        if sorted(int(r) for r in ranks) != sorted(have):
            raise NotSupportedError(f"{layer}(ranks={list(ranks)}): groups other than the {process_group!r} group "
                                    f"(ranks {have}) are not ported; create_parallel_group with the layout you want")
    return group


def _check(layer: str, defer_init: bool, orig_module, input_size, output_size):
    if defer_init:
        raise NotSupportedError(f"{layer}(defer_init=True) is not ported: atorch draws the weights when the layer is "
                                "built; build the model under torch.device('meta') and let auto_accelerate materialize it")
    if orig_module is None and (input_size is None or output_size is None):
        raise NotSupportedError(f"{layer} needs input_size and output_size, or orig_module=nn.Linear")


def _from(orig_module, init_method):
    if orig_module is None:
        return init_method
    return lambda weight: weight.copy_(orig_module.weight.detach())


def _finish(layer, orig_module, requires_grad: bool, split_bias: bool) -> None:
    with torch.no_grad():
        if layer.bias is not None:
            if orig_module is not None and orig_module.bias is not None:
                bias = orig_module.bias.detach().to(layer.bias.dtype)
                layer.bias.copy_(bias.chunk(layer.world)[_rank(layer.group)] if split_bias else bias)
            else:
                layer.bias.zero_()  # ATorch starts its biases at zero
    layer.weight.is_tensor_parallel = True
    if split_bias and layer.bias is not None:
        layer.bias.is_tensor_parallel = True
    for param in layer.parameters():
        param.requires_grad_(requires_grad)


def _rank(group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


class ColumnParallelLinear(_nxd.ColumnParallelLinear):
    """ATorch's ``ColumnParallelLinear(input_size, output_size, bias, init_method, stride, orig_module,
    process_group, ranks, async_grad_allreduce, requires_grad, params_dtype, defer_init)``: the
    output stays split over the group, as in ATorch (see the module).

    Example::

        create_parallel_group(([("tensor", 2)], None))
        up, down = ColumnParallelLinear(64, 256), RowParallelLinear(256, 64)
        y = down(F.gelu(up(x)))      # up(x) holds this rank's 128 features
    """

    def __init__(self, input_size=None, output_size=None, bias=True, init_method=nn.init.xavier_normal_, stride=1,
                 orig_module=None, process_group="tensor", ranks=None, async_grad_allreduce=False,
                 requires_grad=True, params_dtype=torch.float32, defer_init=False):
        _check("ColumnParallelLinear", defer_init, orig_module, input_size, output_size)
        if orig_module is not None:
            input_size, output_size = orig_module.in_features, orig_module.out_features
            bias, params_dtype = orig_module.bias is not None, orig_module.weight.dtype
        # async_grad_allreduce overlaps the input-gradient all-reduce in ATorch: the same numbers
        super().__init__(input_size, output_size, bias, gather_output=False, dtype=params_dtype, stride=stride,
                         init_method=_from(orig_module, init_method),
                         group=_group("ColumnParallelLinear", process_group, ranks))
        _finish(self, orig_module, requires_grad, split_bias=True)


class RowParallelLinear(_nxd.RowParallelLinear):
    """ATorch's ``RowParallelLinear(input_size, output_size, bias, input_is_parallel, init_method,
    stride, params_dtype, orig_module, requires_grad, process_group, ranks, defer_init)``."""

    def __init__(self, input_size=None, output_size=None, bias=True, input_is_parallel=True,
                 init_method=nn.init.xavier_normal_, stride=1, params_dtype=torch.float32, orig_module=None,
                 requires_grad=True, process_group="tensor", ranks=None, defer_init=False):
        _check("RowParallelLinear", defer_init, orig_module, input_size, output_size)
        if orig_module is not None:
            input_size, output_size = orig_module.in_features, orig_module.out_features
            bias, params_dtype = orig_module.bias is not None, orig_module.weight.dtype
        super().__init__(input_size, output_size, bias, input_is_parallel, dtype=params_dtype, stride=stride,
                         init_method=_from(orig_module, init_method),
                         group=_group("RowParallelLinear", process_group, ranks))
        _finish(self, orig_module, requires_grad, split_bias=False)
