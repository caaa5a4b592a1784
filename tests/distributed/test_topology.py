import pytest
import torch.distributed as dist

from atorch.distributed.topology import Topology, resolve_dims
from atorch.errors import WorldSizeError
from tests.helpers.dist import run_distributed


def test_resolve_dims_pure():
    assert resolve_dims([("data", 2)], 2) == ([("data", 2)], [])
    dims, notes = resolve_dims([("tensor", 2)], 4)
    assert dims == [("tensor", 2), ("data", 2)] and notes
    with pytest.raises(WorldSizeError, match="more than once"):
        resolve_dims([("data", 1), ("data", 2)], 2)
    with pytest.raises(WorldSizeError, match=">= 1"):
        resolve_dims([("data", 0)], 2)


def test_single_process_topology():
    topo = Topology.build([("data", 1)])
    assert topo.mesh is None and topo.data_parallel_size == 1 and topo.data_parallel_rank == 0
    assert topo.group("data") is None and topo.size("tensor") == 1
    with pytest.raises(WorldSizeError, match="torchrun"):
        Topology.build([("data", 2)])


def _groups(dims, rank_order):
    topo = Topology.build(dims, rank_order)
    out = {}
    for name, _ in dims:
        out[name] = dist.get_process_group_ranks(topo.group(name))
    out["dp"] = dist.get_process_group_ranks(topo.data_parallel_group)
    out["dp_rank"] = topo.data_parallel_rank
    out["coords"] = {name: topo.coordinate(name) for name, _ in dims}
    return out


def test_innermost_first_groups_on_4_ranks():
    # zero is listed first, so its ranks are neighbours: (0,1) and (2,3); data strides: (0,2), (1,3).
    results = run_distributed(_groups, 4, [("zero", 2), ("data", 2)], None)
    assert [r["zero"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["data"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(sorted(r["dp"]) == [0, 1, 2, 3] for r in results)
    assert sorted(r["dp_rank"] for r in results) == [0, 1, 2, 3]


def test_rank_order_on_2_ranks():
    results = run_distributed(_groups, 2, [("data", 2)], [1, 0])
    assert [r["coords"]["data"] for r in results] == [1, 0]
    assert [atorch_rank for atorch_rank in (r["dp_rank"] for r in results)] == [1, 0]
