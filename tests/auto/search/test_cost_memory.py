"""Memory terms of the sharding methods against peaks measured on 2 gloo ranks, on a Llama whose
root unit (embedding, final norm, head) outweighs its blocks, as a 32k-vocabulary model's does on
many ranks: what FSDP2 keeps whole of the root and at each reduce-scatter decides its peak."""

import importlib.util

import pytest
import torch

from tests.helpers.dist import run_distributed

VOCAB, SEQ = 2048, 16
AMP = ("amp_native", "bf16")
BLOCK = 4 * 64 * 64 + 3 * 64 * 172 + 2 * 64  # parameters of one decoder layer
ZERO2 = ("zero2", {"bucket_params": 3 * BLOCK // 2})  # groups of 2 blocks; the root is the largest unit
CASES = {"fsdp": ["fsdp"], "amp + fsdp": [AMP, "fsdp"], "fsdp kept whole": [("fsdp", {"reshard_after_forward": False})],
         "zero2": [ZERO2], "amp + zero2": [AMP, ZERO2]}


def _wide_vocab_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        tokens = (torch.arange(SEQ) * 7 + i) % VOCAB
        return {"input_ids": tokens, "labels": tokens}


def _ratios() -> dict:
    from atorch.auto.search import measure

    report = measure(_wide_vocab_llama(), [["parallel_mode", *m] for m in CASES.values()], torch.optim.AdamW,
                     _Tokens(), lambda batch, out: out.loss, optim_args={"lr": 1e-3},
                     dataloader_args={"batch_size": 4}, model_input_format="unpack_dict", timed_steps=1)
    return {name: c.estimated_peak_bytes / c.measured_peak_bytes for name, c in zip(CASES, report.candidates)}


def test_fsdp2_units_count_the_root_its_reduce_buffers_and_what_stays_gathered():
    """fsdp: estimated / measured peak 0.93, 0.87 and 0.99 (2026-11-25). Before, with the root
    left out, gathered units in fp32 under amp, two units kept whole with
    reshard_after_forward=False and no reduce-scatter buffer: 0.74, 0.76 and 0.74. zero2 on
    FSDP2: 1.03 and 1.02; with its largest unit taken as bucket_params (1.5 blocks, where the
    groups hold 2 and the root the embedding and head) 1.02 and 0.91."""
    pytest.importorskip("transformers")
    ratios = run_distributed(_ratios, 2)[0]
    assert all(0.8 <= r <= 1.1 for r in ratios.values()), ratios
    assert all(0.95 <= ratios[name] for name in ("zero2", "amp + zero2")), ratios


def _llama_4_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _measured_ratios(cases: dict) -> dict:
    from atorch.auto.search import measure
    from tests.helpers.hf import CountingTokens

    report = measure(_llama_4_layers(), list(cases.values()), torch.optim.AdamW, CountingTokens(),
                     lambda batch, out: out.loss, optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8},
                     model_input_format="unpack_dict", timed_steps=1)
    return {name: c.estimated_peak_bytes / c.measured_peak_bytes for name, c in zip(cases, report.candidates)}


TENSOR2 = ("parallel_mode", ([("tensor", 2), ("data", 1)], None))
PIPELINE2 = ("parallel_mode", ([("pipeline", 2), ("data", 1)], None))
GRIDS = {"row 2": [TENSOR2, ("tensor_parallel", {"algorithm": "3d", "row": 2})],
         "depth 2": [TENSOR2, ("tensor_parallel", {"algorithm": "3d", "depth": 2})]}
ENGINES = {"ds_3d_parallel": [PIPELINE2, ("ds_3d_parallel", {"num_microbatches": 2})],
           "pipeline_parallel": [PIPELINE2, ("pipeline_parallel", {"num_microbatches": 2})]}


SEQUENCE = {"tensor": [TENSOR2, "tensor_parallel"], "sequence": [TENSOR2, "tensor_parallel", "sequence_parallel"],
            "sequence + checkpoint": [TENSOR2, "tensor_parallel", "checkpoint", "sequence_parallel"]}


def test_sequence_parallelism_splits_the_activations_between_the_blocks():
    """Estimated / measured peak on 2 tensor ranks: 1.03 (tensor), 1.00 (sequence), 1.03 (sequence
    + checkpoint) on 2026-11-28; with the norms' and residuals' activations left whole under
    sequence parallelism (the term before it was searched), sequence read 1.11."""
    pytest.importorskip("transformers")
    ratios = run_distributed(_measured_ratios, 2, SEQUENCE)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
    assert 0.95 <= ratios["sequence"] <= 1.06, ratios


@pytest.mark.slow  # 10 s
def test_the_3d_algorithm_splits_its_linears_and_keeps_the_gathered_blocks():
    """Estimated / measured 1.00 for both grids (2026-11-25); the term split nothing before: 1.45
    (row 2) and 1.42 (depth 2, whose gathered blocks autograd keeps for backward)."""
    pytest.importorskip("transformers")
    ratios = run_distributed(_measured_ratios, 2, GRIDS)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


@pytest.mark.slow  # DeepSpeed's import and engine: 35 s
def test_deepspeeds_pipeline_engine_is_costed_as_the_pipeline_it_runs():
    """ds_3d_parallel had no cost term: the whole model on every rank, 1.90 of its measured peak
    (0.97 now, beside pipeline_parallel's 0.98)."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("deepspeed") is None:  # imported in the ranks only (it sets environment variables)
        pytest.skip("needs deepspeed")
    ratios = run_distributed(_measured_ratios, 2, ENGINES)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


DS_ZERO = {"zero2 amp": ["parallel_mode", AMP, ("zero2", {"use_ds_zero": True})],
           "zero2": ["parallel_mode", ("zero2", {"use_ds_zero": True})],
           "zero1 amp": ["parallel_mode", AMP, ("zero1", {"use_ds_zero": True})]}


@pytest.mark.slow  # DeepSpeed's import and engine
def test_deepspeed_zero_holds_its_gradient_bucket_and_a_bf16_model():
    """DeepSpeed allocates its gradient bucket whole (reduce_bucket_size, 5e8 elements, in the
    compute dtype): 1.0 GB under bf16 and 2.0 GB in fp32, whatever the model's size. The
    estimate had left it out: 0.005-0.01 of the measured peaks; 1.00 with it (2026-11-25)."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    ratios = run_distributed(_measured_ratios, 2, DS_ZERO)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


def test_a_deepspeed_bucket_size_in_ds_config_is_the_one_counted():
    from atorch.auto.search.cost import build_cost
    from atorch.auto.strategy import Strategy

    with torch.device("meta"):
        model = _llama_4_layers()
    for bucket, methods in ((None, [AMP]), (2**20, [AMP]), (2**20, [])):
        ds_config = {"zero_optimization": {"reduce_bucket_size": bucket}} if bucket else None
        strategy = Strategy(["parallel_mode", *methods, ("zero2", {"use_ds_zero": True, "ds_config": ds_config})])
        memory = build_cost(model, strategy, {"data": 2}, 2.0, 0).memory()
        assert memory.buckets == (bucket or 500_000_000) * (2 if methods else 4)


PIPELINE2_DATA2 = ("parallel_mode", ([("pipeline", 2), ("data", 2)], None))
PIPELINES = {"1f1b": [PIPELINE2_DATA2, ("pipeline_parallel", {"num_microbatches": 2})],
             "1f1b + zero1": [PIPELINE2_DATA2, ("pipeline_parallel", {"num_microbatches": 2}), "zero1"],
             "interleaved": [PIPELINE2_DATA2, ("pipeline_parallel", {"num_microbatches": 2, "virtual_pipeline_size": 2})]}


@pytest.mark.slow  # 4 ranks, 14 s; the pipeline's zero1 traffic and training stay in the default run
def test_pipelines_with_zero1_and_virtual_stages_are_estimated_within_10_percent():
    """pipeline=2 x data=2 on 4 ranks: 0.98, 0.97 and 1.06 of the measured peaks (2026-11-25)."""
    pytest.importorskip("transformers")
    ratios = run_distributed(_measured_ratios, 4, PIPELINES, timeout_s=400)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


ACCUMULATED = {"ddp": ["parallel_mode"], "fsdp": ["parallel_mode", "fsdp"], "zero2": ["parallel_mode", "zero2"]}


def _accumulated_ratios() -> dict:
    """Estimated / measured peak of a step of 1 and of 2 micro-batches (gradient_accumulation_steps),
    each micro-batch 4 sequences a rank; the estimate from the search's real-tensor probe."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.engine import cost_candidate
    from atorch.auto.strategy import Strategy
    from tests.helpers.comms import step_traffic
    from tests.helpers.hf import CountingTokens, tiny_llama

    data, ctx, out = CountingTokens(), DeviceContext.detect(), {}
    micro = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    for name, methods in ACCUMULATED.items():
        for steps in (1, 2):
            measured = step_traffic(tiny_llama(), methods, data, 8, accumulation=steps, peak=True)["peak"]
            model = tiny_llama()

            def probe(strategy, counts, dims, steps=steps, model=model):
                saved = cost.activation_bytes(model, strategy, micro, "unpack_dict", lambda b, o: o.loss, ctx, counts)
                counts[0] *= steps  # the step's FLOPs: every micro-batch's
                return saved, 4 * steps * micro["input_ids"].shape[1]

            step, _ = cost_candidate(model, resolve_strategy(model, Strategy(methods)), {"data": 2}, 2.0, probe, "cpu",
                                     accumulation=steps)
            out[f"{name} x{steps}"] = step.memory().total / measured
    return out


def test_gradient_accumulation_is_estimated_within_10_percent():
    """DDP accumulates in .grad (no more memory); FSDP2 (fsdp, zero2) keeps its accumulated
    unsharded gradients apart from those backward makes: one more whole copy. Estimated / measured
    0.99-1.05 for 1 and 2 micro-batches (2026-11-25); zero2 x2 was 0.90 before the accumulated
    gradients were counted beside the unit's new ones."""
    pytest.importorskip("transformers")
    ratios = run_distributed(_accumulated_ratios, 2)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
