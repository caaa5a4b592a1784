"""tensor_parallel with algorithm "3d" (atorch.intra_layer) against the single-process run."""

import pytest

from atorch.auto import Strategy
from atorch.errors import MethodConfigError, StrategyConflictError
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.models import train_losses


def _3d(dims, **grid):
    return [("parallel_mode", (dims, None)), ("tensor_parallel", {"algorithm": "3d", **grid})]


TENSOR4 = _3d([("tensor", 4)], row=2, depth=2)                 # batch over depth 2
TENSOR2_DATA2 = _3d([("tensor", 2), ("data", 2)], col=2)         # batch over data 2
CLIP = 0.5


def _linear_kinds(model):
    return sorted({type(m).__module__ for m in model.modules() if hasattr(m, "in_features")})


def _runs_and_errors():
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer

    # clipped with atorch.auto.clip_grad_norm: the norm must be the serial model's
    results = [train_losses(TENSOR4, clip=CLIP), train_losses(TENSOR2_DATA2, clip=CLIP)]
    with pytest.raises(MethodConfigError, match=r"row x col x depth = 2 x 1 x 1 = 2 but parallel_mode's tensor dim "
                                                r"has size 4; set row, col and depth so they multiply to 4"):
        auto_accelerate(TinyTransformer(), load_strategy=_3d([("tensor", 4)], row=2))
    with pytest.raises(StrategyConflictError, match="cannot be combined with fsdp"):
        auto_accelerate(TinyTransformer(), load_strategy=_3d([("tensor", 2), ("data", 2)], row=2) + ["fsdp"])
    _, result, _ = auto_accelerate(TinyTransformer(), load_strategy=TENSOR4)
    return results, _linear_kinds(result.model), type(result.model).__name__


def test_3d_trains_like_single_process_on_4_ranks():
    from tests.helpers.dist import run_distributed

    reference = train_losses([], clip=CLIP)
    assert min(reference["norms"]) > CLIP  # clipping is active
    per_rank = run_distributed(_runs_and_errors, 4)
    for strategy_index in range(2):
        results = [rank[0][strategy_index] for rank in per_rank]
        assert_ranks_agree(results)
        assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
        assert_losses_close(results[0]["norms"], reference["norms"], FP32_RTOL)
        # weights are sharded: each rank holds less than the whole model
        assert results[0]["param_numel"] < reference["param_numel"]
    _, kinds, model_type = per_rank[0]
    # every plain Linear (MLPs and head) replaced; MultiheadAttention's out_proj is a subclass and stays
    assert kinds == ["atorch.intra_layer.linear", "torch.nn.modules.linear"]
    assert model_type == "TinyTransformer"  # no DDP wrapper: gradient hooks take its place


def test_grid_sizes_need_algorithm_3d():
    with pytest.raises(MethodConfigError, match=r"\['row'\] only apply to algorithm '3d'"):
        Strategy([("tensor_parallel", {"row": 2})])
    with pytest.raises(MethodConfigError, match="greater than or equal to 1"):
        Strategy([("tensor_parallel", {"algorithm": "3d", "depth": 0})])
    assert Strategy([("tensor_parallel", {"algorithm": "3d", "row": 2, "depth": 2})]).get("tensor_parallel").grid == (2, 1, 2)


def test_1d_default_and_megatron_alias_unchanged():
    assert Strategy(["tensor_parallel"]).get("tensor_parallel").algorithm == "1d"
    assert Strategy([("tensor_parallel", {"algorithm": "megatron"})]).get("tensor_parallel").algorithm == "megatron"
