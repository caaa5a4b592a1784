import json

import pytest
import torch

from atorch.auto import Strategy
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed
from tests.helpers.models import train_losses


@pytest.mark.parametrize("shuffle", [False, True])
def test_ddp_on_2_ranks_matches_single_process(shuffle):
    reference = train_losses(["parallel_mode"], shuffle=shuffle, optim=torch.optim.AdamW, lr=1e-2)
    results = run_distributed(train_losses, 2, ["parallel_mode"], shuffle=shuffle, optim=torch.optim.AdamW, lr=1e-2)
    assert_ranks_agree(results)
    assert results[0]["model_type"] == "DistributedDataParallel"
    assert reference["model_type"] == "TinyTransformer"
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
    assert Strategy.from_json(results[0]["strategy"]).get("parallel_mode").dims == [("data", 2)]
    assert Strategy.from_json(reference["strategy"]).opt_names == []


def test_zero_and_data_dims_on_4_ranks_match_single_process():
    strategy = [("parallel_mode", ([("zero", 2), ("data", 2)], None))]
    reference = train_losses(strategy)
    results = run_distributed(train_losses, 4, strategy)
    assert_ranks_agree(results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)


def test_data_dim_rescaled_and_reported():
    results = run_distributed(train_losses, 2, [("parallel_mode", ([("data", 8)], None))], steps=5)
    dims = json.loads(results[0]["strategy"])["methods"][0]["config"]["dims"]
    assert dims == [["data", 2]]


def test_the_original_atorch_dim_names_are_read_as_atorchs():
    from atorch.auto import Strategy

    strategy = Strategy([("parallel_mode", ([("model", 2), ("pipe", 2), ("data", 2)], None)), "tensor_parallel"])
    assert strategy.get("parallel_mode").dims == [("tensor", 2), ("pipeline", 2), ("data", 2)]
    assert "model" not in strategy.to_json()  # the saved strategy names what runs


@pytest.mark.parametrize("size", [0, -2])
def test_a_dim_of_size_below_one_is_refused_by_name(size):
    # Issue 56: dims [["pipeline", 0]] with tensor_parallel on 2 ranks ended in ZeroDivisionError.
    from atorch.auto.strategy import parse_strategy
    from atorch.errors import MethodConfigError

    with pytest.raises(MethodConfigError, match=r"every dim's size must be at least 1, got \[\('pipeline', "):
        parse_strategy([("parallel_mode", {"dims": [["pipeline", size]]}), "tensor_parallel"])
