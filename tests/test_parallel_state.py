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
