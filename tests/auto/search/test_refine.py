"""Stage 5b: methods tried on the pick alone (atorch/auto/search/refine.py), on 2 gloo processes."""

import torch

from atorch.auto.registry import unregister_method
from atorch.auto.search.refine import pick_behind
from atorch.auto.search.report import SearchReport
from atorch.methods.native_dynamo import NativeDynamoConfig, cannot_pay
from tests.helpers.dist import run_distributed

# data parallelism only, a few short dry runs: the trials are what this file checks
ONLY_DDP = ["amp_native", "module_replace", "tensor_parallel", "pipeline_parallel", "mixed_parallel", "checkpoint",
            "gradient_accumulation", "zero2", "fsdp", "fused_optimizer", "native_dynamo"]
FAST = {"dryrun_warmup_steps": 1, "dryrun_steps": 2, "use_search_cache": False, "max_dryruns": 2}


def search_with(report_file, method: str, excluded: list, **kwargs) -> list:
    from atorch.auto import auto_accelerate
    from tests.auto.search.refining_method import NappingTransformer, register
    from tests.helpers.models import TokenDataset, lm_loss

    register(method)
    torch.manual_seed(0)
    status, result, strategy = auto_accelerate(
        NappingTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=report_file,
        excluded=excluded, **FAST, **kwargs)
    unregister_method(method)
    nap = result.model.module.nap if hasattr(result.model, "module") else result.model.nap
    return [status, strategy.opt_names, nap]


def _trial_rows(path, name):
    return [c for c in SearchReport.load(path).candidates if name in c.names]


def test_a_method_that_makes_the_pick_faster_is_kept_and_one_that_slows_it_is_not(tmp_path):
    path = str(tmp_path / "report.json")
    status, names, nap = run_distributed(search_with, 2, path, "_wakes", ONLY_DDP)[0]
    assert status and "_wakes" in names and nap == 0.0, names  # the returned job runs it
    [row] = _trial_rows(path, "_wakes")
    report = SearchReport.load(path)
    assert row.status == "measured" and report.candidates[report.winner] is not None
    assert report.candidates[report.winner].names == names
    assert "kept on the pick" in row.reason and "band" in row.reason
    # the report says which pick the trial refined, and its tie (or none) is that pick's
    base = report.candidates[report.refined_from]
    assert base.names == [n for n in names if n != "_wakes"] and base.status == "measured"
    assert not report.tied or report.refined_from not in report.tied
    flat = " ".join(report.table(width=120).split())
    assert "the pick with _wakes tried on it and kept" in flat
    # the pick's own line comes with a close call timed side by side (or a tie); the timings decide
    # whether there was one (the lines themselves: test_side_by_side.py)
    side_by_side = sum(bool(c.side_by_side) for c in report.candidates if c.status == "measured") > 1
    assert (f"pick {base.name}:" in flat) == (side_by_side or bool(report.tied)), flat
    # the negative control: the same stage, a method that slows the step, is left out with its figures
    status, names, nap = run_distributed(search_with, 2, path, "_naps", ONLY_DDP)[0]
    assert "_naps" not in names and nap > 0
    [row] = _trial_rows(path, "_naps")
    assert row.status == "pruned" and row.pruned_by == "not_faster" and "0." in row.reason


def test_a_method_kept_unless_slower_is_kept_where_as_fast_and_not_where_slower(tmp_path):
    # The fused step's rule: as fast (the band covers the tie) is kept, so a gain near the tie is
    # not kept in one search and dropped in the next; clearly slower is not kept, with its figures.
    path = str(tmp_path / "report.json")
    status, names, _ = run_distributed(search_with, 2, path, "_idles", ONLY_DDP)[0]
    [row] = _trial_rows(path, "_idles")
    assert status and "_idles" in names and row.status == "measured", row.reason
    assert "not slower beyond the tie" in row.reason
    status, names, nap = run_distributed(search_with, 2, path, "_naps_free", ONLY_DDP)[0]
    [row] = _trial_rows(path, "_naps_free")
    assert "_naps_free" not in names and nap > 0
    assert row.status == "pruned" and row.pruned_by == "slower_than_pick" and "band" in row.reason


def test_an_excluded_method_is_not_tried_on_the_pick(tmp_path):
    path = str(tmp_path / "report.json")
    run_distributed(search_with, 2, path, "_wakes", ONLY_DDP + ["_wakes"])
    assert not _trial_rows(path, "_wakes")


def test_a_compile_that_cannot_pay_over_the_planned_steps_is_not_tried():
    config = NativeDynamoConfig()
    why = cannot_pay(config, 0.005, 1000, "cpu")
    assert "1000 planned steps" in why and "planned_steps" in why
    assert cannot_pay(config, 0.005, 100_000, "cpu") is None  # 250 s of possible saving
    assert cannot_pay(config, 0.030, 1000, "cpu") is not None  # 15 s: less than two 8 s compiles
    assert cannot_pay(NativeDynamoConfig(backend="aot_eager"), 0.005, 10, "cpu") is None  # no C++ compile


def test_the_ratio_that_decides_a_trial():
    median, low, high = pick_behind([1.1] * 6, [1.0] * 6)
    assert round(median, 6) == round(low, 6) == 1.1
    assert pick_behind([1.0, 1.2] * 3, [1.0] * 6)[1] == 1.0  # a turn as fast as the trial: no clear lead


def test_a_released_compiled_copy_leaves_no_graph_for_the_job_to_reuse():
    # The job's own compiled model reused the graph a trial had compiled for its copy, and ran at
    # eager speed (9.9 K tokens/s against 14.1 K compiled afresh, the GPU check's CPU dry path).
    import torch._dynamo.utils

    from atorch.auto.context import ModelContext
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search.dryrun import release
    from tests.helpers.models import TinyTransformer

    def compiled_forward():
        model = TinyTransformer()
        model.compile(backend="eager")
        model(torch.zeros(2, 8, dtype=torch.long))
        return model

    copy = compiled_forward()
    frames = torch._dynamo.utils.counters["frames"]["total"]
    release(ModelContext(copy, DeviceContext.detect()), ran=True)
    compiled_forward()  # the job's model: compiled again, not served the released copy's graph
    assert torch._dynamo.utils.counters["frames"]["total"] > frames


def test_what_is_tried_on_the_pick_follows_the_device(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    from atorch.auto.environment import DeviceContext
    from atorch.auto.registry import get_method
    from atorch.auto.search.refine import _trial_configs
    from atorch.auto.strategy import Strategy
    from tests.helpers.models import TinyTransformer

    def on(device):
        return SimpleNamespace(model=TinyTransformer(), device_ctx=DeviceContext(2, 2, torch.device(device), None, 2**34))

    replace, dynamo, fused = (get_method(n) for n in ("module_replace", "native_dynamo", "fused_optimizer"))
    plain = Strategy(["parallel_mode"])
    assert _trial_configs(on("cpu"), replace, plain, set()) == []  # liger's Triton kernels need CUDA
    assert _trial_configs(on("cpu"), dynamo, plain, set()) == [{}]  # inductor's C++ backend
    assert _trial_configs(on("cpu"), dynamo, plain.with_method("native_dynamo"), set()) == []
    assert _trial_configs(on("cpu"), fused, plain, {"fused_optimizer"}) == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    assert _trial_configs(on("cuda"), replace, plain, set()) == []  # not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a))
    assert _trial_configs(on("cuda"), replace, plain, set()) == [{"kernels": "liger"}]
