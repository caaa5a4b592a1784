"""The cost model's communication terms against the collectives the code really makes: one
training step on gloo ranks under tests/helpers/comms.Collectives (every c10d operator, its kind,
group and payload bytes), set beside what the candidate's StepCost charges for the same job."""

import pytest
import torch

from atorch.auto.plan import resolve_strategy
from atorch.auto.search.cost import build_cost
from atorch.auto.strategy import Strategy
from tests.helpers.dist import run_distributed

BATCH = 8  # global


def _tiny_llama(device: str = "cpu"):
    from tests.helpers.hf import tiny_llama

    with torch.device(device):
        return tiny_llama()


def _traffic(load_strategy) -> dict:
    from tests.helpers.comms import step_traffic
    from tests.helpers.hf import CountingTokens

    return step_traffic(_tiny_llama(), load_strategy, CountingTokens(), BATCH)


def _cost(load_strategy, dims: dict):
    from tests.helpers.hf import SEQ

    model = _tiny_llama("meta")
    strategy = resolve_strategy(model, Strategy(load_strategy))
    data = dims.get("data", 1)
    return build_cost(model, strategy, dims, 2.0, 0, 1e9, BATCH // data * SEQ)


def _charged(cost, dim: str) -> dict:
    """{kind: (calls, payload bytes)} the cost charges over ``dim``'s group, each Comm at its width."""
    out: dict = {}
    for c in cost.comms:
        if c.dim == dim:
            calls, payload = out.get(c.kind, (0, 0))
            out[c.kind] = (calls + c.messages, payload + c.elements * cost.comm_element_bytes(c))
    return out


TP2 = [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"]


SELECTIVE = ("checkpoint", {"selective": True})


SP2 = TP2 + ["sequence_parallel"]


def _tensor_runs() -> dict:
    return {"plain": _traffic(TP2), "checkpoint": _traffic(TP2 + ["checkpoint"]),
            "selective": _traffic(TP2 + [SELECTIVE]), "sequence": _traffic(SP2)}


def test_tensor_parallel_charges_the_collectives_its_layers_make():
    """q, k, v, gate and up each all-reduce their input gradient, o and down their output (o's
    again in a checkpointed block's recompute, which stops before down), the embedding its
    output; the head all-reduces its input's gradient and all-gathers its logits. The term had
    charged 4 all-reduces a layer (Megatron's fused count), none more under checkpointing, and
    the gather as an all-reduce: 2 x 4 + 2 = 10 all-reduces here, where the code makes
    2 x 7 + 2 (2 x 8 + 2 checkpointed) and 1 gather. Under sequence parallelism see
    ``_sequence_traffic`` (its term had charged 10 all-reduces where the code makes 15 and 11
    all-gathers)."""
    pytest.importorskip("transformers")
    seen = run_distributed(_tensor_runs, 2)[0]
    for name, methods in (("plain", TP2), ("checkpoint", TP2 + ["checkpoint"]), ("selective", TP2 + [SELECTIVE]),
                          ("sequence", SP2)):
        charged = _charged(_cost(methods, {"tensor": 2, "data": 1}), "tensor")
        assert charged == {kind: seen[name]["tensor"][kind] for kind in ("all_reduce", "all_gather")}, (name, seen)
    assert seen["plain"]["tensor"]["all_reduce"][0] == 2 * 7 + 2
    # sequence parallelism: 4 row outputs, 5 sequence gathers (2 a layer, the head's), the
    # embedding, each one way forward and the other backward, 5 norm weights' gradients
    assert seen["sequence"]["tensor"]["all_reduce"][0] == 4 + 5 + 1 + 5
    assert seen["sequence"]["tensor"]["all_gather"][0] == 4 + 5 + 1 + 1  # and the logits
    # selective checkpointing recomputes o's all-reduce with the element-wise ops, as full does
    assert seen["checkpoint"]["tensor"]["all_reduce"][0] == seen["selective"]["tensor"]["all_reduce"][0] == 2 * 8 + 2


def _sync_charged(cost) -> dict:
    """{kind: (calls, payload bytes)} of the cost's data-parallel sync and its loss normalization's
    count (one all-reduce of 24 bytes a step)."""
    out: dict = {}
    for kind, payload, calls in cost.data_sync_collectives() + cost.loss_count_collectives():
        before_calls, before_payload = out.get(kind, (0, 0))
        out[kind] = (before_calls + calls, before_payload + payload)
    return out


AMP = ("amp_native", "bf16")
SHARDED = {"fsdp": ["parallel_mode", AMP, "fsdp"], "zero2": ["parallel_mode", AMP, "zero2"],
           "fsdp kept whole": ["parallel_mode", ("fsdp", {"reshard_after_forward": False})]}


def _sharded_runs() -> dict:
    return {name: _traffic(methods)["data"] for name, methods in SHARDED.items()}


def test_fsdp2_under_amp_gathers_the_parameters_in_amps_dtype():
    """FSDP2's mixed-precision policy (amp absorbed) all-gathers bf16 parameters and
    reduce-scatters fp32 gradients; the term had charged fp32 gathers (fsdp 1.593 s where the
    code moves 1.169 s on 7B x 64 ranks, estimated). Kept whole after forward, each unit is
    gathered once (the term had charged the bytes of two gathers)."""
    pytest.importorskip("transformers")
    seen = run_distributed(_sharded_runs, 2)[0]
    for name, methods in SHARDED.items():
        charged = _sync_charged(_cost(methods, {"data": 2}))
        assert set(charged) == set(seen[name]), (name, seen[name])
        for kind, (calls, payload) in charged.items():
            assert calls == seen[name][kind][0], (name, kind, charged, seen[name])
            assert payload == pytest.approx(seen[name][kind][1], rel=0.02), (name, kind, charged, seen[name])


PP2_DP2 = [("parallel_mode", ([("pipeline", 2), ("data", 2)], None)), ("pipeline_parallel", {"num_microbatches": 2})]


def _pipeline_run() -> dict:
    return {"plain": _traffic(PP2_DP2), "zero1": _traffic([*PP2_DP2, "zero1"])}


@pytest.mark.slow  # the default suite stays under 15 minutes; run with -m slow
def test_a_pipelines_data_parallel_sync_is_one_all_reduce_a_bucket():
    """The pipeline model all-reduces its stages' gradients a bucket at a time from each stage's
    last microbatch (atorch.pipeline.grad_sync; no DDP): the term had charged DDP's buckets,
    overlapped in every microbatch. With zero1 the same, then one broadcast of updated parameters
    a data rank."""
    pytest.importorskip("transformers")
    runs = run_distributed(_pipeline_run, 4, timeout_s=300)
    for name, methods in (("plain", PP2_DP2), ("zero1", [*PP2_DP2, "zero1"])):
        ranks = [r[name] for r in runs]
        cost = _cost(methods, {"pipeline": 2, "data": 2})
        # the rank with the larger stage, as the cost model costs it
        largest = max(ranks, key=lambda r: r["data"]["all_reduce"][1])
        calls, payload = largest["data"]["all_reduce"]
        # the gradients and the step's [count, sum, samples] (the loss normalization, charged too)
        expected = {"all_reduce": (calls, payload)}
        if name == "zero1":  # then ZeroRedundancyOptimizer broadcasts each rank's updated share
            expected["all_gather"] = largest["data"]["broadcast"]
        charged = _sync_charged(cost)
        assert {k: (c, round(b)) for k, (c, b) in charged.items()} == expected, (name, ranks)
        assert cost.sync_overlap == {"all_reduce": ("backward",)} and not cost.grad_buckets


ACCUMULATED = {"fsdp": ["parallel_mode", "fsdp"], "ddp": ["parallel_mode"]}


def _accumulated_runs() -> dict:
    from tests.helpers.comms import step_traffic
    from tests.helpers.hf import CountingTokens

    return {(name, steps): step_traffic(_tiny_llama(), methods, CountingTokens(), BATCH, accumulation=steps)["data"]
            for name, methods in ACCUMULATED.items() for steps in (1, 2)}


def test_gradient_accumulation_syncs_the_gradients_once_and_fsdp_gathers_every_micro_batch():
    """auto_accelerate's gradient_accumulation_steps=2 on 2 ranks: DDP all-reduces once a step
    whatever the micro-batches; FSDP2 gathers its units again for each micro-batch and
    reduce-scatters once. StepCost.accumulation charges the same."""
    pytest.importorskip("transformers")
    seen = run_distributed(_accumulated_runs, 2)[0]
    for name, methods in ACCUMULATED.items():
        for steps in (1, 2):
            step = _cost(methods, {"data": 2})
            charged = _sync_charged(build_cost(step.model, step_strategy(methods, step.model), {"data": 2}, 2.0, 0,
                                               1e9, BATCH, accumulation=steps))
            # (DDP also broadcasts its buffers, a Llama's rotary frequencies, 124 bytes at each forward)
            counted = {k: v for k, v in seen[(name, steps)].items() if k != "broadcast"}
            assert {k: (c, pytest.approx(b, rel=0.02)) for k, (c, b) in charged.items()} == counted, (name, steps)
    assert seen[("ddp", 2)]["all_reduce"] == seen[("ddp", 1)]["all_reduce"]
    assert seen[("fsdp", 2)]["all_gather"][0] == 2 * seen[("fsdp", 1)]["all_gather"][0]
    assert seen[("fsdp", 2)]["reduce_scatter"] == seen[("fsdp", 1)]["reduce_scatter"]


def step_strategy(methods, model):
    return resolve_strategy(model, Strategy(methods))
