import pytest

from atorch import parallel_state
from tests.helpers.dist import run_distributed


def _state(tp):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    out = {
        "init": parallel_state.model_parallel_is_initialized(),
        "tp": (parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()),
        "dp": (parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()),
        "pp": (parallel_state.get_pipeline_model_parallel_size(), parallel_state.get_pipeline_model_parallel_rank()),
        "tp_groups": parallel_state.get_tensor_model_parallel_group(as_list=True),
        "dp_groups": parallel_state.get_data_parallel_group(as_list=True),
        "pp_groups": parallel_state.get_pipeline_model_parallel_group(as_list=True),
    }
    parallel_state.destroy_model_parallel()
    out["after_destroy"] = parallel_state.model_parallel_is_initialized()
    return out


def test_tensor_groups_are_contiguous_on_4_ranks():
    results = run_distributed(_state, 4, 2)
    assert [r["tp"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [r["dp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert results[0]["tp_groups"] == [[0, 1], [2, 3]]
    assert results[0]["dp_groups"] == [[0, 2], [1, 3]]
    assert results[0]["pp_groups"] == [[0], [1], [2], [3]]
    assert all(r["init"] and not r["after_destroy"] for r in results)


def _bad_sizes():
    from atorch.errors import WorldSizeError

    with pytest.raises(WorldSizeError, match="divide the world size 2"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=3)
    return "ok"


def test_sizes_must_divide_the_world():
    assert run_distributed(_bad_sizes, 2) == ["ok", "ok"]


def test_getters_before_initialization_say_what_to_do():
    parallel_state.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.get_tensor_model_parallel_size()


GRIDS = [  # (AxoNN grid sizes, data-parallel groups, tensor-parallel groups) on 4 ranks
    ({"G_intra_r": 2, "G_intra_d": 2}, [[0, 2], [1, 3]], [[0, 1, 2, 3]]),  # depth ranks see different samples
    ({"G_intra_r": 2, "G_data": 2}, [[0, 2], [1, 3]], [[0, 1], [2, 3]]),
    ({"G_intra_d": 2, "G_data": 2}, [[0, 1, 2, 3]], [[0, 1], [2, 3]]),
]


def _grid_groups():
    import torch.distributed as dist

    from atorch import intra_layer

    out = []
    for sizes, _, _ in GRIDS:  # one spawn for every grid: spawning costs more than what runs
        topology = intra_layer.init(**sizes)
        out.append({
            "dp_groups": parallel_state.get_data_parallel_group(as_list=True),
            "tp_groups": parallel_state.get_tensor_model_parallel_group(as_list=True),
            "dp_ranks": dist.get_process_group_ranks(topology.data_parallel_group),
            "dp": (parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()),
        })
    parallel_state.destroy_model_parallel()
    return out


def test_data_parallel_groups_include_depth_and_match_the_real_groups():
    runs = run_distributed(_grid_groups, 4)
    for index, (sizes, dp_groups, tp_groups) in enumerate(GRIDS):
        results = [run[index] for run in runs]
        assert results[0]["dp_groups"] == dp_groups, sizes
        assert results[0]["tp_groups"] == tp_groups, sizes
        for rank, result in enumerate(results):
            # The listed group of each rank is the group its collectives really use, in its order.
            mine = next(group for group in dp_groups if rank in group)
            assert sorted(result["dp_ranks"]) == sorted(mine), sizes
            assert result["dp"] == (len(mine), mine.index(rank)), sizes
