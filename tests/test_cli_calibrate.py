"""``atorch calibrate``: measures this machine's rates, caches them, prints them."""

import json

import pytest

from atorch.cli.main import main


def test_calibrate_one_rank_caches_and_reuses(tmp_path, capsys):
    assert main(["calibrate", "--nproc", "1", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "cpu-world1.json"
    assert "matmul: fp32" in out and "GFLOP/s" in out and str(path) in out
    written = path.read_text()
    assert main(["calibrate", "--nproc", "1", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(written)  # read back, not measured again
    assert path.read_text() == written


@pytest.mark.slow  # -m slow (6 s): a second measurement; by default the one above measures and reads back
def test_calibrate_refresh_measures_again_and_rewrites_the_file(tmp_path, capsys):
    assert main(["calibrate", "--nproc", "1", "--cache-dir", str(tmp_path), "--json"]) == 0
    path = tmp_path / "cpu-world1.json"
    written = path.read_text()
    capsys.readouterr()
    # --refresh measures again and rewrites the file (the rates of two measurements differ)
    assert main(["calibrate", "--nproc", "1", "--cache-dir", str(tmp_path), "--refresh", "--json"]) == 0
    refreshed = json.loads(capsys.readouterr().out)
    assert path.read_text() != written and json.loads(path.read_text()) == refreshed


@pytest.mark.slow  # -m slow; by default: tests/auto/search/test_calibrate.py calibrates on 2 ranks
def test_calibrate_spawns_gloo_ranks_and_prints_each_collective(tmp_path, capsys, monkeypatch):
    assert main(["calibrate", "--nproc", "2", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        assert f"{kind} over   2 ranks" in out
    data = json.loads((tmp_path / "cpu-world2.json").read_text())
    assert data["calibration"]["world_size"] == 2 and data["calibration"]["threads"] == 1
    # A second call reads the cache here, without spawning the ranks again (that took seconds).
    import atorch.distributed.local

    def no_spawn(*args, **kwargs):
        raise ValueError("spawned ranks")

    monkeypatch.setattr(atorch.distributed.local, "run_local", no_spawn)
    assert main(["calibrate", "--nproc", "2", "--cache-dir", str(tmp_path)]) == 0
    assert "all_reduce over   2 ranks" in capsys.readouterr().out
    # Another number of threads per rank does not match the cache: measured again (spawned).
    assert main(["calibrate", "--nproc", "2", "--threads", "2", "--cache-dir", str(tmp_path)]) == 2
    assert "spawned ranks" in capsys.readouterr().err


def test_calibrate_refuses_no_ranks(capsys):
    assert main(["calibrate", "--nproc", "0"]) == 2
    assert "--nproc" in capsys.readouterr().err
