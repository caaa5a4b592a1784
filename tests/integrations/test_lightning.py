"""AtorchStrategy on 2 gloo ranks: a LightningModule trains as under Lightning's own DDP.

The same tiny GPT-2 (from a GPT2Config), data and seed; Lightning runs gradient accumulation (2),
clipping at 1.0, a step-wise warmup schedule and validation. Global batch 8 in every run
(tensor parallel: one data rank reading 4 x 2).
"""

import json

import pytest

from tests.helpers.compare import FP32_RTOL, LOW_PRECISION_RTOL, assert_losses_close, assert_sensitive
from tests.helpers.dist import run_distributed
from tests.integrations.lightning_runs import BATCH, train_lightning

pytest.importorskip("lightning")
pytest.importorskip("transformers", minversion="5.0")

TP2 = [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"]


def _runs(tmp: str) -> dict:
    return {
        "reference": train_lightning(f"{tmp}/reference"),
        "reference lr=0": train_lightning(f"{tmp}/lr0", lr=0.0),
        "ddp": train_lightning(f"{tmp}/ddp", strategy=["parallel_mode"]),
        "fsdp + checkpoint": train_lightning(f"{tmp}/fsdp", strategy=["fsdp", "checkpoint"]),
        "tensor_parallel": train_lightning(f"{tmp}/tp", strategy=TP2, batch=2 * BATCH),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_runs, 2, str(tmp_path_factory.mktemp("lightning")), timeout_s=400)


@pytest.mark.parametrize("name", ["ddp", "fsdp + checkpoint", "tensor_parallel"])
def test_atorch_strategy_matches_lightning_ddp(runs, name):
    reference, run = runs[0]["reference"], runs[0][name]
    assert_losses_close(run["losses"], reference["losses"], FP32_RTOL)
    assert abs(run["val_loss"] - reference["val_loss"]) <= FP32_RTOL * reference["val_loss"]
    assert_sensitive(run["losses"], {"lr=0": runs[0]["reference lr=0"]["losses"]}, FP32_RTOL)
    assert runs[1][name]["losses"] == run["losses"]


def test_the_applied_strategy_is_reported(runs):
    assert '"fsdp"' in runs[0]["fsdp + checkpoint"]["strategy"]
    assert runs[0]["ddp"]["wrapped"] == "DistributedDataParallel"


def _bf16_runs(tmp: str) -> dict:
    return {
        "reference bf16": train_lightning(f"{tmp}/reference", precision="bf16-mixed", steps=6),
        "reference fp32": train_lightning(f"{tmp}/fp32", steps=6),
        "ddp + amp bf16": train_lightning(f"{tmp}/ddp", strategy=["parallel_mode", ("amp_native", "bf16")], steps=6),
    }


def test_amp_bf16_matches_lightnings_own_bf16_mixed(tmp_path):
    """amp_native bf16 autocasts the forward as Lightning's precision="bf16-mixed" does."""
    runs = run_distributed(_bf16_runs, 2, str(tmp_path), timeout_s=400)[0]
    run, reference = runs["ddp + amp bf16"], runs["reference bf16"]
    assert run["compute_dtypes"] == reference["compute_dtypes"] == ["torch.bfloat16"]
    assert runs["reference fp32"]["compute_dtypes"] == ["torch.float32"]
    assert_losses_close(run["losses"], reference["losses"], LOW_PRECISION_RTOL)
    assert_sensitive(run["losses"], {"fp32": runs["reference fp32"]["losses"]}, LOW_PRECISION_RTOL)


def test_the_search_runs_from_lightning(tmp_path):
    """strategy=None: the search dry-runs training_step on fit's data; its report is in the
    Trainer's default_root_dir, and fit trains with the winner."""
    run = run_distributed(train_lightning, 2, str(tmp_path), search={"memory_budget": "4GiB", "time_limit": 120},
                          timeout_s=400)[0]
    from atorch.auto import Strategy
    from atorch.auto.search.report import SearchReport

    report = SearchReport.load(tmp_path / "atorch_search_report.json")
    assert report.winner is not None and len(report.candidates) > 1
    assert all(c.status != "failed" for c in report.candidates), [c.reason for c in report.candidates if c.status == "failed"]
    applied = Strategy.load(tmp_path / "atorch_strategy.json")
    assert set(report.candidates[report.winner].names) == set(applied.opt_names)
    assert json.loads(run["strategy"]) == json.loads(applied.to_json())
    assert run["losses"][-1] < 0.85 * run["losses"][0]  # it trained under the winner


def _resume(tmp: str) -> dict:
    return {
        "lightning saved": train_lightning(f"{tmp}/ref", save_at=4),
        "lightning resumed": train_lightning(f"{tmp}/ref2", resume=f"{tmp}/ref/step=4.ckpt"),
        "saved": train_lightning(f"{tmp}/a", strategy=["parallel_mode"], save_at=4),
        "resumed": train_lightning(f"{tmp}/b", strategy=["fsdp", "checkpoint"], resume=f"{tmp}/a/step=4.ckpt"),
    }


@pytest.mark.slow  # the Trainer's resume test stays in the default run
def test_a_run_saved_under_ddp_resumes_under_fsdp(tmp_path):
    """Saved by ModelCheckpoint at the end of epoch 0 (step 4) under ddp, resumed under fsdp: the
    same losses as Lightning's own DDP resumed from its own checkpoint. (Lightning resumes from an
    epoch-end checkpoint with one more batch of epoch 0 and 5 optimizer steps, not on the
    uninterrupted curve; AtorchStrategy resumes exactly as Lightning does.)"""
    runs = run_distributed(_resume, 2, str(tmp_path), timeout_s=400)[0]
    assert_losses_close(runs["saved"]["losses"], runs["lightning saved"]["losses"], FP32_RTOL)
    assert_losses_close(runs["resumed"]["losses"], runs["lightning resumed"]["losses"], FP32_RTOL)
    # Control: had the checkpoint not been loaded, the curve would start over.
    assert_sensitive(runs["resumed"]["losses"], {"fresh start": runs["saved"]["losses"][:5]}, FP32_RTOL)
    # An atorch checkpoint (a folder of shards), where Lightning's own is one file.
    assert (tmp_path / "a" / "step=4.ckpt").is_dir() and (tmp_path / "ref" / "step=4.ckpt").is_file()


def test_step_changing_strategies_are_refused():
    from atorch.integrations.common import TrainerStrategyError
    from atorch.integrations.lightning import AtorchStrategy

    with pytest.raises(TrainerStrategyError, match="pipeline_parallel.*supports"):
        AtorchStrategy(["pipeline_parallel"])
    with pytest.raises(TrainerStrategyError, match="use_ds_zero"):
        AtorchStrategy([("zero1", {"use_ds_zero": True})])
