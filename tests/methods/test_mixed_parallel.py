"""mixed_parallel (tensor x pipeline x data) through auto_accelerate against the serial run."""

import pytest

from atorch.auto import Strategy
from atorch.errors import WorldSizeError
from atorch.methods.mixed_parallel import choose_sizes
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed
from tests.pipeline.models import train_pipelined


def test_llama_tensor2_pipeline2_on_4_ranks_matches_single_process():
    pytest.importorskip("transformers")
    from tests.helpers.hf import train_hf

    reference = train_hf([])
    # no sizes given: mixed_parallel chooses tensor 2 x pipeline 2 on 4 ranks
    results = run_distributed(train_pipelined, 4, [("mixed_parallel", {"num_microbatches": 2})])
    for result in results:
        assert result["losses"] == results[0]["losses"]
        assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(result["parallel_modules"])
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
    config = Strategy.from_json(results[0]["strategy"]).get("mixed_parallel")
    assert (config.tensor_size, config.pipeline_size) == (2, 2)


def test_sizes_are_chosen_or_checked():
    assert choose_sizes(4, None, None) == (2, 2)
    assert choose_sizes(8, None, None) == (2, 2)
    assert choose_sizes(2, None, None) == (1, 2)
    assert choose_sizes(8, 4, None) == (4, 2)
    with pytest.raises(WorldSizeError, match="does not divide the world size 4"):
        choose_sizes(4, 3, 1)
