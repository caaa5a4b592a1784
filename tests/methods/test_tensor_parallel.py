"""tensor_parallel on real models against the single-process run."""

import pytest
import torch

from atorch.auto import Strategy
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed
from tests.helpers.models import train_losses

TP2 = [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"]


def test_plain_mlp_blocks_tp2_match_single_process():
    reference = train_losses([], optim=torch.optim.AdamW, lr=1e-2, clip=1e9)
    results = run_distributed(train_losses, 2, TP2, optim=torch.optim.AdamW, lr=1e-2, clip=1e9)
    assert_ranks_agree(results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
    # clip_grad_norm sums the split weights' norms over the tensor group: the serial norm
    assert results[0]["norms"] == pytest.approx(reference["norms"], rel=FP32_RTOL)
    # each rank holds half of every MLP matrix and of the embedding
    assert results[0]["param_numel"] < reference["param_numel"]
    assert Strategy.from_json(results[0]["strategy"]).opt_names == ["parallel_mode", "tensor_parallel"]


def _llama_param_kinds():
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import tiny_llama

    _, result, _ = auto_accelerate(tiny_llama(), load_strategy=TP2)
    return sorted({type(m).__name__ for m in result.model.modules() if "Parallel" in type(m).__name__})


def test_llama_layers_are_replaced():
    pytest.importorskip("transformers")
    kinds = run_distributed(_llama_param_kinds, 2)[0]
    assert kinds == ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear"]


def _trained_with_norm_inputs(strategy) -> dict:
    """Train the tiny Llama; also return the shapes every RMSNorm received (the activations
    between the blocks, where sequence parallelism splits the sequence dim)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from tests.helpers.hf import train_hf

    shapes = set()

    def record(module, args):
        if type(module).__name__ == "LlamaRMSNorm":
            shapes.add(tuple(args[0].shape))

    handle = register_module_forward_pre_hook(record)
    try:
        result = train_hf(strategy)
    finally:
        handle.remove()
    return {**result, "norm_input_shapes": sorted(shapes)}


def _llama_tp2_with_and_without_sequence_parallel():
    return {"tp": _trained_with_norm_inputs(TP2), "sp": _trained_with_norm_inputs(TP2 + ["sequence_parallel"])}


@pytest.fixture(scope="module")
def llama_tp2_runs():
    """Llama on 2 tensor-parallel ranks, with and without sequence parallelism (one spawn)."""
    pytest.importorskip("transformers")
    return run_distributed(_llama_tp2_with_and_without_sequence_parallel, 2)


def sequence_dims_between_blocks(result) -> set[int]:
    return {shape[1] for shape in result["norm_input_shapes"]}


def test_llama_tp2_matches_single_process(llama_tp2_runs):
    from tests.helpers.hf import train_hf

    reference = train_hf([])
    results = [rank["tp"] for rank in llama_tp2_runs]
    assert_ranks_agree(results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)


def test_llama_tp2_with_fsdp_over_data2_on_4_ranks():
    pytest.importorskip("transformers")
    from tests.helpers.hf import train_hf

    reference = train_hf([])
    strategy = [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel", "fsdp"]
    results = run_distributed(train_hf, 4, strategy)
    # fsdp replicates nothing: each rank's own loss is its data share's, checked on micro-batches.
    assert sorted(r["data_rank"] for r in results) == [0, 0, 1, 1]
    assert_ranks_agree(results, train_hf([], micro_batches=2), FP32_RTOL)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)


def _unshardable():
    from atorch.auto import auto_accelerate
    from atorch.errors import MethodConfigError

    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3))
    with pytest.raises(MethodConfigError, match="found nothing it can split in Sequential"):
        auto_accelerate(model, load_strategy=TP2)
    return "raised"


def test_models_it_cannot_split_get_an_error():
    assert run_distributed(_unshardable, 2) == ["raised", "raised"]


def test_without_a_tensor_dim_one_is_chosen_never_dropped():
    """Trained on 2 ranks against the serial run: tests/auto/test_fit_dims.py."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import plan_strategy

    strategy, notes = plan_strategy(Strategy(["parallel_mode", "tensor_parallel"]),
                                    DeviceContext(2, 2, torch.device("cpu"), None, 2**30))
    assert strategy.opt_names == ["parallel_mode", "tensor_parallel"]
    assert strategy.get("parallel_mode").dims == [("tensor", 2), ("data", 1)]
    assert any("no 'tensor' dim; chose tensor=2" in n and n.warning for n in notes)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_gpt2_and_bert_tp2_match_single_process(family):
    pytest.importorskip("transformers")
    from tests.helpers.hf import train_family

    reference = train_family(family, [])
    results = run_distributed(train_family, 2, family, TP2)
    assert_ranks_agree(results)
    assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(results[0]["parallel_modules"])
    # GPT-2's Conv1D slices were transposed views kept by clone: FSDP over them refused to start
    assert all(not rank["non_contiguous"] for rank in results), results[0]["non_contiguous"]
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)


def test_llama_tp2_with_sequence_parallel_matches_single_process(llama_tp2_runs):
    from tests.helpers.hf import SEQ, train_hf

    reference = train_hf([])
    results = [rank["sp"] for rank in llama_tp2_runs]
    # The norms run on each rank's own tokens and their grads are summed over the tensor group:
    # a rank that missed that sum would end on other norm weights than its peer.
    assert_ranks_agree(results)
    assert Strategy.from_json(results[0]["strategy"]).opt_names[-1] == "sequence_parallel"
    # Between the blocks each rank holds half of the sequence (batch, SEQ / 2, hidden) ...
    assert all(sequence_dims_between_blocks(r) == {SEQ // 2} for r in results), results[0]["norm_input_shapes"]
    # ... which is what tells it from plain tensor parallelism (negative control: whole sequence).
    assert all(sequence_dims_between_blocks(rank["tp"]) == {SEQ} for rank in llama_tp2_runs)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)


def _sequence_parallel_on_bert():
    from atorch.errors import MethodConfigError
    from tests.helpers.hf import train_family

    with pytest.raises(MethodConfigError, match="sequence_parallel supports Llama-style"):
        train_family("bert", TP2 + ["sequence_parallel"])
    return "raised"


def test_sequence_parallel_refuses_models_it_cannot_run():
    assert run_distributed(_sequence_parallel_on_bert, 2) == ["raised", "raised"]
