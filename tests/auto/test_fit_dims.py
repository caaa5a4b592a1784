"""A method named without the parallel dim it needs is fitted or refused, never dropped in silence.

``["parallel_mode", "tensor_parallel"]`` once trained plain DDP with status True and one INFO
line; now the planner picks the largest size the ranks and the model allow (WARNING, and
``result.notes``) or raises, naming the fix. A strategy file written for more ranks still runs on
fewer, its drops at WARNING and in ``result.notes``.
"""

import logging

import pytest
import torch

from atorch.auto import Strategy, auto_accelerate
from atorch.auto.environment import DeviceContext
from atorch.auto.fit_dims import FitJob
from atorch.auto.plan import plan_strategy
from atorch.errors import StrategyConflictError, WorldSizeError
from tests.conftest import messages
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss, train_losses
from tests.pipeline.models import chain_model, serial_losses, train_chain


def device_ctx(world: int, local: int | None = None) -> DeviceContext:
    return DeviceContext(world, local or world, torch.device("cpu"), None, 2**30)


def dims_of(strategy: Strategy) -> list[tuple[str, int]]:
    return strategy.get("parallel_mode").dims


# ---------------------------------------------------------------- planning (one process)


def test_tensor_gets_the_largest_size_the_ranks_and_the_model_allow():
    job = FitJob(TinyTransformer(), 8, "unpack_dict")  # 4 heads, MLP 128, vocabulary 64
    strategy, notes = plan_strategy(Strategy(["parallel_mode", "tensor_parallel"]), device_ctx(4), job=job)
    assert dims_of(strategy) == [("tensor", 4), ("data", 1)]
    # a tensor group stays on one machine: 2 ranks a node leave tensor 2 and data 2
    strategy, _ = plan_strategy(Strategy(["parallel_mode", "tensor_parallel"]), device_ctx(4, 2), job=job)
    assert dims_of(strategy) == [("tensor", 2), ("data", 2)]
    # another fixed dim keeps its ranks; the tensor dim fits in what is left
    strategy, _ = plan_strategy(Strategy([("parallel_mode", [("zero", 2)]), "tensor_parallel"]), device_ctx(4),
                                job=job)
    assert dims_of(strategy) == [("tensor", 2), ("zero", 2)]
    [fitted] = [n for n in notes if n.warning]
    assert "tensor_parallel: parallel_mode has no 'tensor' dim; chose tensor=4" in fitted
    assert "TinyTransformer allows" in fitted and "Write ('tensor', N)" in fitted


def test_tensor_size_skips_what_the_model_does_not_divide():
    # 6 ranks: tensor 6 and 3 split neither the 4 heads nor the 128 MLP features; 2 does
    strategy, notes = plan_strategy(Strategy(["parallel_mode", "tensor_parallel"]), device_ctx(6),
                                    job=FitJob(TinyTransformer(), 6))
    assert dims_of(strategy) == [("tensor", 2), ("data", 3)]


def test_pipeline_depth_is_capped_by_the_microbatches_and_the_blocks():
    job = FitJob(chain_model(4), 16, "unpack_dict")  # 6 units
    one = plan_strategy(Strategy(["parallel_mode", "pipeline_parallel"]), device_ctx(4), job=job)[0]
    assert dims_of(one) == [("pipeline", 2), ("data", 2)]  # 1 microbatch: no deeper than 2
    four = plan_strategy(Strategy(["parallel_mode", ("pipeline_parallel", {"num_microbatches": 4})]),
                         device_ctx(4), job=job)[0]
    assert dims_of(four) == [("pipeline", 4), ("data", 1)]
    # the microbatches must divide each data rank's batch: 16 / data 1 = 16 by 4, fine; 6 by 4 not
    with pytest.raises(WorldSizeError, match="4 microbatches do not divide the 6 samples"):
        plan_strategy(Strategy(["parallel_mode", ("pipeline_parallel", {"num_microbatches": 4})]), device_ctx(4),
                      job=FitJob(chain_model(4), 6, "unpack_dict"))


def test_no_size_fits_raises_with_the_reason_and_the_fix():
    with pytest.raises(WorldSizeError) as error:
        plan_strategy(Strategy(["parallel_mode", "tensor_parallel"]), device_ctx(3), job=FitJob(TinyTransformer()))
    text = str(error.value)
    assert "tensor=3: blocks.0.mlp.0: 128 features do not divide over 3" in text
    assert "Add ('tensor', N) to parallel_mode's dims" in text and "or remove tensor_parallel" in text


def test_a_dim_written_as_1_is_refused_not_dropped():
    with pytest.raises(StrategyConflictError, match="sets the 'tensor' dim to 1; write \\('tensor', N\\) with N > 1"):
        plan_strategy(Strategy([("parallel_mode", [("tensor", 1), ("data", 2)]), "tensor_parallel"]), device_ctx(2))


def test_a_file_for_more_ranks_runs_on_one_with_its_drops_at_warning_and_in_the_notes(atorch_logs):
    """Written for 4 ranks (tensor 2 x data 2, fsdp); run in this single process."""
    written = Strategy([("parallel_mode", [("tensor", 2), ("data", 2)]), "tensor_parallel", "fsdp"])
    status, result, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.SGD, TokenDataset(16), lm_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", load_strategy=written)
    assert status and strategy.opt_names == []
    warned = [r.getMessage() for r in atorch_logs if r.levelno == logging.WARNING]
    for name in ("parallel_mode", "tensor_parallel", "fsdp"):
        assert any(m.startswith(f"{name}: dropped because it needs more than one process") for m in warned), warned
        assert any(n.startswith(f"{name}: dropped because") for n in result.notes), result.notes
    # the seven fields still unpack as in ATorch; the notes ride beside them
    model, optim, dataloader, loss_func, prepare_input, lr_scheduler, args = result
    assert len(result) == 7 and "dropped" in messages(atorch_logs)


# ---------------------------------------------------------------- 2 gloo ranks


def _warnings_of(run, *args, **kwargs) -> dict:
    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            if record.levelno == logging.WARNING:
                records.append(record.getMessage())

    handler = _Collect()
    logging.getLogger("atorch").addHandler(handler)
    try:
        return {**run(*args, **kwargs), "warnings": records}
    finally:
        logging.getLogger("atorch").removeHandler(handler)


def _refusal(model, load_strategy) -> str:
    with pytest.raises(WorldSizeError) as error:
        auto_accelerate(model, torch.optim.SGD, TokenDataset(16), lm_loss, optim_args={"lr": 0.1},
                        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                        load_strategy=load_strategy)
    return str(error.value)


def _named_without_dims() -> dict:
    return {
        "tensor": _warnings_of(train_losses, ["parallel_mode", "tensor_parallel"], optim=torch.optim.AdamW,
                               lr=1e-2, clip=1e9),
        "pipeline": _warnings_of(train_chain, ["parallel_mode", ("pipeline_parallel", {"num_microbatches": 2})]),
        "no_tensor": _refusal(torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3)), ["parallel_mode", "tensor_parallel"]),
        "no_pipeline": _refusal(torch.nn.Sequential(torch.nn.Linear(4, 4)), ["parallel_mode", "pipeline_parallel"]),
    }


@pytest.fixture(scope="module")
def two_rank_runs():
    return run_distributed(_named_without_dims, 2)


def test_tensor_parallel_without_a_dim_is_applied_and_equal_to_serial(two_rank_runs):
    reference = train_losses([], optim=torch.optim.AdamW, lr=1e-2, clip=1e9)
    results = [rank["tensor"] for rank in two_rank_runs]
    assert_ranks_agree(results)
    assert all(r["status"] for r in results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
    assert results[0]["norms"] == pytest.approx(reference["norms"], rel=FP32_RTOL)
    # split for real: each rank holds part of the weights (plain DDP would hold all of them)
    assert results[0]["param_numel"] < reference["param_numel"]
    strategy = Strategy.from_json(results[0]["strategy"])
    assert strategy.opt_names == ["parallel_mode", "tensor_parallel"]
    assert dims_of(strategy) == [("tensor", 2), ("data", 1)]


def test_pipeline_parallel_without_a_dim_is_applied_and_equal_to_serial(two_rank_runs):
    reference = serial_losses()
    for rank in two_rank_runs:
        result = rank["pipeline"]
        assert_losses_close(result["losses"], reference, FP32_RTOL)
        assert result["args"]["backward_in_forward"]  # the pipeline model runs the step, not DDP
        strategy = Strategy.from_json(result["strategy"])
        assert strategy.opt_names == ["parallel_mode", "pipeline_parallel"]
        assert dims_of(strategy) == [("pipeline", 2), ("data", 1)]


def test_the_chosen_dim_is_a_warning_and_a_note(two_rank_runs):
    for key, dim in (("tensor", "tensor"), ("pipeline", "pipeline")):
        rank0 = two_rank_runs[0][key]
        expected = f"parallel_mode has no {dim!r} dim; chose {dim}=2"
        assert any(expected in w for w in rank0["warnings"]), rank0["warnings"]
        for rank in two_rank_runs:
            assert any(expected in n for n in rank[key]["notes"]), rank[key]["notes"]


def test_methods_that_cannot_be_fitted_raise_on_every_rank(two_rank_runs):
    for rank in two_rank_runs:
        assert "tensor_parallel needs a 'tensor' dim larger than 1 and parallel_mode has none" in rank["no_tensor"]
        assert "finds no attention or MLP it can split in Sequential" in rank["no_tensor"]
        assert "pipeline_parallel needs a 'pipeline' dim" in rank["no_pipeline"]
        assert "Add ('pipeline', N) to parallel_mode's dims" in rank["no_pipeline"]
