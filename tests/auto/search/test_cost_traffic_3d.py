"""tensor_parallel's 3d algorithm: the collectives its cost term charges against those one
training step makes on 2 gloo ranks (tests/helpers/comms.Collectives), grid by grid. Until this
term the 3d algorithm charged none (atorch/intra_layer/cost.py lists them)."""

import pytest

from tests.auto.search.test_cost_traffic import _cost, _traffic
from tests.helpers.dist import run_distributed

CASES = {
    "row 2": ({"row": 2}, []),
    "column 2, checkpoint": ({"col": 2}, ["checkpoint"]),
    "depth 2, selective checkpoint": ({"depth": 2}, [("checkpoint", {"selective": True})]),
    "depth 2, amp": ({"depth": 2}, [("amp_native", "bf16")]),
}


def _strategy(grid: dict, extra: list, data: int = 1) -> list:
    return [("parallel_mode", ([("tensor", 2), ("data", data)], None)),
            ("tensor_parallel", {"algorithm": "3d", **grid}), *extra]


def _summed(by_dim: dict) -> dict:
    """{kind: (calls, payload bytes)} over every group (the grid's groups are the tensor ranks')."""
    out: dict = {}
    for kinds in by_dim.values():
        for kind, (calls, payload) in kinds.items():
            before = out.get(kind, (0, 0))
            out[kind] = (before[0] + calls, before[1] + payload)
    return out


def _charged(cost) -> dict:
    out: dict = {}
    for c in cost.comms:
        before = out.get(c.kind, (0, 0))
        out[c.kind] = (before[0] + c.messages, before[1] + round(c.elements * cost.comm_element_bytes(c)))
    return out


def _runs() -> dict:
    return {name: _summed(_traffic(_strategy(*case))) for name, case in CASES.items()}


def test_the_3d_algorithm_charges_the_collectives_its_layers_make():
    """Row: each layer's output gathered, its input's gradient all-reduced; column: the partial
    sums all-reduced, the input's gradient gathered; depth: each weight block gathered (fp32 under
    amp too) and its gradient reduce-scattered, the replicated parameters' gradients all-reduced
    one by one, and the step's loss count. A checkpointed block reruns its weight gathers and the
    activation collectives of all its layers but the last (selective checkpointing too)."""
    pytest.importorskip("transformers")
    seen = run_distributed(_runs, 2)[0]
    for name, case in CASES.items():
        charged = _charged(_cost(_strategy(*case), {"tensor": 2, "data": 1}))
        assert charged == seen[name], (name, seen[name])
    # 15 Linears; a checkpointed Llama layer reruns 6 of its 7 layers' forward collectives
    assert seen["column 2, checkpoint"]["all_reduce"][0] == 15 + 2 * 6
    # ... and all 7 weight gathers; the 2 x 2 norms, the final norm and the embedding, and the count
    assert seen["depth 2, selective checkpoint"]["all_gather"][0] == 15 + 2 * 7
    assert seen["depth 2, amp"]["all_reduce"][0] == 6 + 1


# Beside data ranks (4 ranks: the grid's 2 x data 2) the gradient hooks are the data-parallel sync:
# each parameter all-reduced, every backward, over data x depth (replicated) or data (3D shards).
DATA_CASES = {"depth 2 x data 2": {"depth": 2}, "row 2 x data 2": {"row": 2}}


def _data_runs() -> dict:
    return {name: _summed(_traffic(_strategy(grid, [], data=2))) for name, grid in DATA_CASES.items()}


@pytest.mark.slow  # a 4-rank spawn, 15 s; the 2-rank grids above stay in the default run
def test_beside_data_ranks_the_3d_gradient_hooks_are_the_data_sync():
    """Until 2026-11-29 the 3d algorithm with data ranks was charged DDP's sync (one bucketed
    all-reduce a step, hidden behind the backward) where its hooks all-reduce each parameter."""
    pytest.importorskip("transformers")
    seen = run_distributed(_data_runs, 4)[0]
    for name, grid in DATA_CASES.items():
        cost = _cost(_strategy(grid, [], data=2), {"tensor": 2, "data": 2})
        charged = _charged(cost)
        for kind, payload, calls in cost.data_sync_collectives() + cost.loss_count_collectives():
            before = charged.get(kind, (0, 0))
            charged[kind] = (before[0] + calls, before[1] + round(payload))
        assert charged == seen[name], (name, charged, seen[name])
