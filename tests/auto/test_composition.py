"""The composition matrix (issue 16): every pair of methods planned in both list orders; every
pair the planner accepts trained on gloo ranks against a serial reference, its compute dtype
asserted; every refused pair refused by name. The default run trains a representative share of
the pairs; the full matrix (every pair on 2 and 4 ranks, both orders, triples):
``pytest -m slow tests/auto/test_composition.py``."""

import math
from pathlib import Path

import pytest

from atorch.auto.compatibility import compatibility_markdown
from tests.auto import composition as C
from tests.helpers.dist import run_distributed

# Measured on the tiny Llama (4 AdamW steps, lr 1e-2, global batch 8), max relative loss gap to
# the serial reference of the same precision: fp32 pairs 0 to 1.9e-7; bf16 autocast pairs under
# DDP/TP/pipeline 2.6e-4 to 3.1e-4, under FSDP2 mixed precision (bf16 parameters) 1.6e-3; a bf16
# model (half) 4e-4 to 1.3e-3. expert_parallel's cases train a tiny Mixtral (4 experts, top-2)
# against its own serial run. Training moves the loss 8% per step, so a run that does not
# train, or trains another model, is far outside (the negative controls below show it).
FP32_RTOL = 1e-5
BF16_RTOL = 3e-3
DTYPE = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "half": "torch.bfloat16"}


def runnable(world: int, cases=None) -> list[tuple[str, ...]]:
    cases = C.pairs() if cases is None else cases
    out = [case for case in cases if C.plan_case(case, world)["outcome"] == "accepted"
           and all(C.HAS.get(C.NEEDS.get(v), True) for v in case)]
    return ds_pipeline_last(out)


def ds_pipeline_last(cases: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    # DeepSpeed's pipeline engine leaves process-wide state that its ZeRO engine trips on when
    # both run in one process (never in one job): its cases go last.
    return sorted(cases, key=lambda case: "ds_3d_parallel" in case)


def max_gap(losses, reference) -> float:
    assert len(losses) == len(reference) == C.STEPS
    assert all(math.isfinite(x) for x in losses), losses
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def check(results: dict, world: int) -> list[str]:
    """Every case's problems (an exception, a loss gap, a wrong compute dtype), as lines."""
    references = {}
    problems = []
    for case, result in results.items():
        if "error" in result:
            problems.append(f"{case} on {world} ranks raised:\n{result['error']}")
            continue
        key = C.reference_key(case)
        if key not in references:
            references[key] = C.serial_losses(*key)
        tolerance = FP32_RTOL if key[0] == "fp32" else BF16_RTOL
        gap = max_gap(result["losses"], references[key])
        if gap > tolerance:
            problems.append(f"{case} on {world} ranks: losses {result['losses']} vs serial {references[key]} "
                            f"(gap {gap:.2e} > {tolerance})")
        if result["dtypes"] != [DTYPE[key[0]]]:
            problems.append(f"{case} on {world} ranks: matmuls ran in {result['dtypes']}, expected {DTYPE[key[0]]}")
        problems += check_round_trip(case, result.get("checkpoint"))
    return problems


def check_round_trip(case, checkpoint: dict | None) -> list[str]:
    if checkpoint is None:
        return []
    if "refused" in checkpoint:
        # Only the backends that keep their own partitioned state may be refused, by name.
        reasons = {"zero1_ds": "DeepSpeed", "zero2_ds": "DeepSpeed", "zero2_fairscale": "fairscale",
                   "genomic_bottleneck": "g-nets"}
        if any(reasons.get(variant, "\0") in checkpoint["refused"] for variant in case):
            return []
        return [f"{case}: checkpoint refused: {checkpoint['refused']}"]
    if checkpoint["after"] != pytest.approx(checkpoint["before"], rel=1e-6):
        return [f"{case}: loss {checkpoint['before']} before save, {checkpoint['after']} after load"]
    return []


@pytest.mark.parametrize("world", [2, 4])
def test_every_pair_is_planned_the_same_in_both_list_orders(world):
    outcomes = {}
    for a, b in C.pairs():
        forward, backward = C.plan_case((a, b), world), C.plan_case((b, a), world)
        assert forward["outcome"] == backward["outcome"], (a, b, forward, backward)
        if forward["outcome"] == "accepted":
            assert forward["order"] == backward["order"], (a, b)
            assert forward["strategy"] == backward["strategy"], (a, b)
        if forward["outcome"] == "refused":
            assert forward["error"] == backward["error"], (a, b)
        outcomes[forward["outcome"]] = outcomes.get(forward["outcome"], 0) + 1
    assert outcomes["accepted"] >= 60 and outcomes["refused"] >= 30, outcomes


def test_refused_pairs_name_both_methods():
    for a, b in C.pairs():
        planned = C.plan_case((a, b), 4)
        if planned["outcome"] == "refused" and planned["error"].startswith("StrategyConflictError: methods"):
            names = C.methods_of(a) | C.methods_of(b)
            assert sum(f"'{name}'" in planned["error"] for name in names) >= 2, planned["error"]


def test_a_conflict_says_why_and_what_to_do():
    planned = C.plan_case(("genomic_bottleneck", "fsdp"), 2)
    assert planned["error"] == (
        "StrategyConflictError: methods 'genomic_bottleneck' and 'fsdp' cannot be used together: sharding changes "
        "the shapes and owners of the weights the g-nets generate; remove one of them")


def test_applied_order_is_data_not_the_list():
    # amp_native listed first used to wrap a root forward the pipeline stages never call.
    assert C.plan_case(("amp_native", "pipeline_parallel"), 2)["order"] == [
        "parallel_mode", "pipeline_parallel", "amp_native"]
    assert C.plan_case(("pipeline_parallel", "amp_native"), 2)["order"] == [
        "parallel_mode", "pipeline_parallel", "amp_native"]
    assert C.plan_case(("tensor_parallel", "module_replace"), 2)["order"] == [
        "parallel_mode", "module_replace", "tensor_parallel"]


def test_zero2_absorbs_amp_only_where_its_backend_applies_the_dtype():
    from atorch.auto.registry import get_method

    spec = get_method("zero2")
    assert "amp_native" in spec.related("absorbs", spec.config_cls())
    assert "amp_native" in spec.related("absorbs", spec.config_cls(use_ds_zero=True))
    assert spec.related("absorbs", spec.config_cls(not_use_fsdp=True)) == {}


def test_compatibility_doc_is_generated_from_the_registry():
    path = Path(__file__).resolve().parents[2] / "docs" / "methods" / "compatibility.md"
    assert path.read_text() == compatibility_markdown(), (
        "docs/methods/compatibility.md is stale: python -m atorch.auto.compatibility > docs/methods/compatibility.md")


# The default run's share of the 2-rank matrix (the whole of it, 65 pairs and 5 minutes, runs with
# -m slow): every variant at least once; amp with every method that shards, splits or rewrites the
# model (where a dtype went missing before; mixed_parallel with sequence parallelism inside the
# stages, the plain one beside module_replace); half with a sharded model; checkpoint with a sharded
# and a split one; dynamo with a split one (its aot_eager trace takes 9-30 s); two pairs in
# reversed list order.
DEFAULT_PAIRS = [
    ("amp_native", "zero2"), ("amp_native", "zero2_fairscale"), ("amp_native", "zero2_ds"),
    ("amp_native", "zero1_ds"), ("amp_native", "fsdp"), ("amp_native", "tensor_parallel"),
    ("amp_native", "sequence_parallel"), ("amp_native", "pipeline_parallel"),
    ("amp_native", "mixed_parallel_sp"), ("amp_native", "genomic_bottleneck"),
    ("half", "fsdp"),
    ("checkpoint", "fsdp"), ("checkpoint", "tensor_parallel"), ("checkpoint", "ds_3d_parallel"),
    ("native_dynamo", "tensor_parallel"),
    ("zero1", "module_replace"), ("module_replace", "mixed_parallel"),
    ("fsdp", "amp_native"), ("pipeline_parallel", "checkpoint"),
    ("checkpoint_selective", "tensor_parallel"), ("checkpoint_every_other", "fsdp"), ("gradient_accumulation", "fsdp"),
    ("amp_native", "expert_parallel"), ("expert_parallel", "fsdp"),  # on the tiny Mixtral
    ("fused_optimizer", "zero1"),  # ZeRO builds its own optimizer: it must get the fused step too
]


def check_pairs_on_2_ranks(cases, tmp_path):
    results = run_distributed(C.run_cases, 2, cases, 2, str(tmp_path), timeout_s=900)
    assert results[0].keys() == set(cases)
    problems = check(results[0], 2)
    assert not problems, "\n\n".join(problems)


def test_the_default_pairs_cover_every_variant_and_are_accepted():
    covered = {variant for case in DEFAULT_PAIRS for variant in case}
    assert covered == set(C.VARIANTS), set(C.VARIANTS) - covered
    assert all(C.plan_case(case, 2)["outcome"] == "accepted" for case in DEFAULT_PAIRS)


def test_representative_pairs_on_2_ranks_match_serial_with_their_compute_dtype_and_round_trip(tmp_path):
    cases = runnable(2, DEFAULT_PAIRS)
    # The bug that opened issue 16: zero2 on fairscale listed amp_native but computed in fp32.
    assert not C.HAS["fairscale"] or ("amp_native", "zero2_fairscale") in cases
    assert ("amp_native", "pipeline_parallel") in cases
    check_pairs_on_2_ranks(cases, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_accepted_pair_on_2_ranks_matches_serial_with_its_compute_dtype_and_round_trips(tmp_path):
    check_pairs_on_2_ranks(runnable(2), tmp_path)


def test_the_matrix_check_fails_without_training_and_in_the_wrong_precision():
    # Negative controls: a run that does not train, and an fp32 run held to the bf16 reference's
    # dtype, are both reported; so the checks above can fail.
    frozen = C.serial_losses("fp32", lr=0.0)
    assert check({("checkpoint",): {"losses": frozen, "dtypes": ["torch.float32"]}}, 1)
    fp32 = C.serial_losses("fp32")
    assert check({("amp_native",): {"losses": fp32, "dtypes": ["torch.float32"]}}, 1)
    assert not check({("checkpoint",): {"losses": fp32, "dtypes": ["torch.float32"]}}, 1)
    # A load that restored another state, and a refusal from a backend checkpointing supports.
    assert check_round_trip(("fsdp",), {"before": 3.0, "after": 3.01})
    assert check_round_trip(("fsdp",), {"refused": "atorch.checkpoint cannot save fsdp"})
    assert not check_round_trip(("zero2_ds",), {"refused": "atorch.checkpoint cannot save or load a DeepSpeed engine"})


def test_the_old_mean_of_means_fails_the_matrix_on_padded_batches():
    # Negative control of issue 51: weighting each part as one (data ranks, accumulation
    # micro-batches, pipeline microbatches) trains another model than the whole batch does.
    cases = [("zero1",), ("gradient_accumulation",), ("pipeline_parallel",)]
    results = run_distributed(C.run_cases, 2, cases, 2, None, "per_part_mean", timeout_s=300)
    problems = check(results[0], 2)
    assert len(problems) == len(cases), "\n\n".join(problems)
    assert all("gap" in problem for problem in problems), problems


TRIPLES = [
    ("tensor_parallel", "fsdp", "amp_native", "checkpoint"),
    ("pipeline_parallel", "amp_native", "checkpoint"),
    ("zero2", "amp_native"), ("zero2_fairscale", "amp_native"), ("zero2_ds", "amp_native"),
    ("genomic_bottleneck", "amp_native"),
    ("tensor_parallel", "zero1"),
    ("expert_parallel", "fsdp", "amp_native"),
]


# Tensor 2 x data 2, where the data group is not the world: each trained a wrong model before.
# fairscale's ShardedDDP dropped reduced gradients on their owners (gap 1e-1); DeepSpeed, given no
# mpu, broadcast and averaged over the world, tensor shards included (2.5e-2); FSDP2 replaced the
# norm weights whose hooks summed their sequence-parallel gradients over the tensor ranks (2e-4).
DATA_GROUP_NOT_WORLD = [("tensor_parallel", "zero2_fairscale"), ("tensor_parallel", "zero2_ds"),
                        ("sequence_parallel", "fsdp")]


def test_representative_compositions_on_4_ranks():
    # (pipeline_parallel with amp_native and with checkpoint: the pairs on 2 ranks)
    cases = runnable(4, [("tensor_parallel", "fsdp", "amp_native", "checkpoint"), ("tensor_parallel", "zero1"),
                         ("zero1", "pipeline_parallel"),
                         ("tensor_parallel", "expert_parallel"), *DATA_GROUP_NOT_WORLD])
    assert ("tensor_parallel", "fsdp", "amp_native", "checkpoint") in cases
    assert ("zero1", "pipeline_parallel") in cases  # pipeline=2 x data=2, ZeRO over each stage's data ranks
    assert ("sequence_parallel", "fsdp") in cases
    assert ("tensor_parallel", "expert_parallel") in cases  # attention over tensor, experts over data ranks
    results = run_distributed(C.run_cases, 4, cases, 4, timeout_s=600)
    problems = check(results[0], 4)
    assert not problems, "\n\n".join(problems)


# The 70B plan's methods (docs/plans/llama_layouts.md): tensor 2 x pipeline 2 x data 2 with sequence
# parallelism inside the stages, zero1 over each stage's data ranks, bf16 autocast, selective
# checkpointing; and the grid with zero1 alone. A world of 4 leaves zero1 no data rank beside them.
GRID_CASES = [("mixed_parallel_sp", "zero1", "amp_native", "checkpoint_selective"), ("mixed_parallel_sp", "zero1")]


@pytest.mark.slow  # 8 processes on 2 cores: 43 s
@pytest.mark.timeout(900)
def test_the_70b_plans_methods_on_the_whole_8_rank_grid():
    cases = runnable(8, GRID_CASES)
    assert cases == GRID_CASES
    results = run_distributed(C.run_cases, 8, cases, 8, timeout_s=800)
    problems = check(results[0], 8)
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_matrix_on_4_ranks_both_orders_and_triples():
    cases = ds_pipeline_last(runnable(4) + runnable(4, [tuple(reversed(case)) for case in C.pairs()])
                             + runnable(4, TRIPLES))
    results = run_distributed(C.run_cases, 4, cases, 4, timeout_s=3500)
    problems = check(results[0], 4)
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_matrix_on_2_ranks_in_reversed_list_order():
    cases = ds_pipeline_last(runnable(2, [tuple(reversed(case)) for case in C.pairs()]) + runnable(2, TRIPLES))
    results = run_distributed(C.run_cases, 2, cases, 2, timeout_s=1500)
    problems = check(results[0], 2)
    assert not problems, "\n\n".join(problems)
