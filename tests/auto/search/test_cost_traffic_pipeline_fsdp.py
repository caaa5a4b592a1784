"""fsdp and zero2 beside a pipeline: the collectives a step really makes over the data ranks
(pipeline=2 x data=2 on 4 gloo ranks, tests/helpers/comms.Collectives) against what the cost
model charges (fsdp's and zero2's terms after pipeline_parallel's)."""

import pytest

from tests.auto.search.test_cost_traffic import PP2_DP2, _cost, _sync_charged, _traffic
from tests.helpers.dist import run_distributed

AMP = ("amp_native", "bf16")
# (fsdp in fp32 moves the same calls as under amp, its bytes as the other fp32 cases')
SHARDED = {"fsdp amp": [*PP2_DP2, AMP, "fsdp"], "zero2": [*PP2_DP2, "zero2"],
           "fsdp 4 microbatches": [PP2_DP2[0], ("pipeline_parallel", {"num_microbatches": 4}), "fsdp"]}


def _runs() -> dict:
    return {name: _traffic(methods) for name, methods in SHARDED.items()}


def test_a_sharded_pipeline_charges_the_gathers_and_reduce_scatters_its_stages_make():
    """Each stage gathers its units (and itself, the root) in forward and again in backward, and
    reduce-scatters them once after the last microbatch (torch's PipelineStage defers the sync);
    under amp the gathers move bf16 and the reduce-scatters fp32."""
    pytest.importorskip("transformers")
    runs = run_distributed(_runs, 4, timeout_s=600)
    for name, methods in SHARDED.items():
        ranks = [r[name]["data"] for r in runs]
        # the rank with the larger stage, as the cost model costs it
        largest = max(ranks, key=lambda r: r["reduce_scatter"][1])
        charged = _sync_charged(_cost(methods, {"pipeline": 2, "data": 2}))
        seen = {k: v for k, v in largest.items() if k != "broadcast"}  # the module states' first broadcast
        assert set(charged) == set(seen), (name, charged, seen)
        for kind, (calls, payload) in charged.items():
            assert calls == seen[kind][0], (name, kind, charged, seen)
            assert payload == pytest.approx(seen[kind][1], rel=0.05), (name, kind, charged, seen)
