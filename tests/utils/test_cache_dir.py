"""atorch's own cache folder moves with ATORCH_CACHE_DIR alone: the suite isolates it there, and
torch's cache (compiled extensions such as DeepSpeed's ops) stays put between runs."""

from pathlib import Path

from atorch.auto.search import cache, calibrate
from atorch.utils.cache_dir import cache_root


def test_the_suite_leaves_torch_extension_builds_in_place(tmp_path_factory):
    import torch.utils.cpp_extension as cpp

    # tests/conftest.py isolates atorch's cache: torch's must stay where a previous run built it
    assert not Path(cpp.get_default_build_root()).is_relative_to(tmp_path_factory.getbasetemp())


def test_atorch_cache_dir_moves_atorch_files_only(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path / "own"))
    assert cache.default_dir() == tmp_path / "own" / "search"
    assert calibrate.default_dir() == tmp_path / "own" / "calibration"
    monkeypatch.delenv("ATORCH_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "atorch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "atorch"
