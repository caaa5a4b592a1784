"""ds_3d_parallel: DeepSpeed's pipeline engine on CPU with gloo, against the serial run."""

import importlib.util

import pytest
import torch

from atorch.auto import Strategy
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed
from tests.pipeline.models import serial_losses, train_chain

DS_PP2 = [("parallel_mode", ([("pipeline", 2)], None)), ("ds_3d_parallel", {"num_microbatches": 4})]


def test_deepspeed_pipeline2_matches_single_process():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    reference = serial_losses()
    results = run_distributed(train_chain, 2, DS_PP2)
    for result in results:
        assert_losses_close(result["losses"], reference, FP32_RTOL)
        assert result["args"]["backward_in_forward"] and result["args"]["step_in_forward"]
    assert Strategy.from_json(results[0]["strategy"]).opt_names == ["parallel_mode", "ds_3d_parallel"]


def test_dropped_without_deepspeed_and_given_a_pipeline_dim_without_one():
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import plan_strategy
    from atorch.methods.ds_3d_parallel import Ds3dParallelConfig, _unsupported

    strategy, notes = plan_strategy(Strategy(["parallel_mode", "ds_3d_parallel"]),
                                    DeviceContext(2, 2, torch.device("cpu"), None, 2**30))
    if _unsupported(None, Ds3dParallelConfig()) is None:  # installed: a pipeline dim is chosen for it
        assert strategy.opt_names == ["parallel_mode", "ds_3d_parallel"]
        assert strategy.get("parallel_mode").dims == [("pipeline", 2), ("data", 1)]
        assert any("no 'pipeline' dim; chose pipeline=2" in n and n.warning for n in notes)
    else:
        assert strategy.opt_names == ["parallel_mode"]
        assert any("needs DeepSpeed" in n and n.warning for n in notes)
