"""AtorchFabricStrategy on 2 gloo ranks: a Fabric loop trains as under Fabric's own DDP.

The same tiny GPT-2, data and seed; the loop accumulates 2 micro-batches (``no_backward_sync``),
clips at 1.0 and uses two parameter groups (weight decay off for biases and norms). Global batch
8 in every run (tensor parallel: one data rank reading 4 x 2).
"""

import pytest

from tests.helpers.compare import FP32_RTOL, LOW_PRECISION_RTOL, assert_losses_close, assert_sensitive
from tests.helpers.dist import run_distributed

# Slow (run with -m slow): the Trainer and Lightning tests cover the same strategies in the default run.
pytestmark = pytest.mark.slow

pytest.importorskip("lightning")
pytest.importorskip("transformers", minversion="5.0")

BATCH, STEPS, ACCUM = 4, 10, 2
TP2 = [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"]


def train_fabric(output_dir: str, strategy=None, lr: float = 1e-2, batch: int = BATCH, save_at: int | None = None,
                 resume: str | None = None, precision: str = "32-true") -> dict:
    """The global loss of every optimizer step (mean over the ranks' micro-batches)."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from tests.helpers.hf import CountingTokens, tiny_gpt2

    if strategy is None:
        from lightning.fabric.strategies import DDPStrategy

        fabric_strategy = DDPStrategy(process_group_backend="gloo")
    else:
        from atorch.integrations.fabric import AtorchFabricStrategy

        fabric_strategy = AtorchFabricStrategy(strategy, save_strategy_to=f"{output_dir}/atorch_strategy.json")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy, precision=precision)
    fabric.launch()
    model = tiny_gpt2()
    compute_dtypes = set()
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: compute_dtypes.add(str(o.dtype)))
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln_" in n]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(CountingTokens(STEPS * ACCUM * 8), batch_size=batch))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if resume:
        fabric.load(resume, state)
    losses, batches = [], iter(loader)
    for _ in range(state["step"] * ACCUM):  # the micro-batches already trained on
        next(batches)
    while state["step"] < STEPS:
        micro = []
        for i in range(ACCUM):
            with fabric.no_backward_sync(model, enabled=i < ACCUM - 1):
                loss = model(**next(batches)).loss
                fabric.backward(loss / ACCUM)
            micro.append(loss.detach())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        total = torch.stack(micro).mean()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(float(total))
        if state["step"] == save_at:
            fabric.save(f"{output_dir}/step{save_at}", state)
    return {"losses": losses, "wrapped": type(model._forward_module).__name__, "compute_dtypes": sorted(compute_dtypes),
            "strategy": None if strategy is None else fabric_strategy.strategy.to_json()}


def _runs(tmp: str) -> dict:
    return {
        "reference": train_fabric(f"{tmp}/reference"),
        "reference lr=0": train_fabric(f"{tmp}/lr0", lr=0.0),
        "ddp": train_fabric(f"{tmp}/ddp", strategy=["parallel_mode"], save_at=4),
        "fsdp + checkpoint": train_fabric(f"{tmp}/fsdp", strategy=["fsdp", "checkpoint"]),
        "tensor_parallel": train_fabric(f"{tmp}/tp", strategy=TP2, batch=2 * BATCH),
        "resumed under fsdp": train_fabric(f"{tmp}/resumed", strategy=["fsdp"], resume=f"{tmp}/ddp/step4"),
        "reference bf16": train_fabric(f"{tmp}/reference_bf16", precision="bf16-mixed"),
        "ddp + amp bf16": train_fabric(f"{tmp}/bf16", strategy=["parallel_mode", ("amp_native", "bf16")]),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_runs, 2, str(tmp_path_factory.mktemp("fabric")), timeout_s=400)


@pytest.mark.parametrize("name", ["ddp", "fsdp + checkpoint", "tensor_parallel"])
def test_atorch_fabric_strategy_matches_fabric_ddp(runs, name):
    reference, run = runs[0]["reference"], runs[0][name]
    assert_losses_close(run["losses"], reference["losses"], FP32_RTOL)
    assert_sensitive(run["losses"], {"lr=0": runs[0]["reference lr=0"]["losses"]}, FP32_RTOL)
    assert runs[1][name]["losses"] == run["losses"]


def test_a_fabric_run_saved_under_ddp_resumes_under_fsdp(runs):
    saved, resumed = runs[0]["ddp"], runs[0]["resumed under fsdp"]
    assert_losses_close(resumed["losses"], saved["losses"][4:], FP32_RTOL)
    assert_sensitive(resumed["losses"], {"fresh start": saved["losses"][:6]}, FP32_RTOL)
    assert runs[0]["ddp"]["wrapped"] == "DistributedDataParallel"
    assert '"fsdp"' in runs[0]["fsdp + checkpoint"]["strategy"]


def test_amp_bf16_matches_fabrics_own_bf16_mixed(runs):
    run, reference = runs[0]["ddp + amp bf16"], runs[0]["reference bf16"]
    assert run["compute_dtypes"] == reference["compute_dtypes"] == ["torch.bfloat16"]
    assert runs[0]["reference"]["compute_dtypes"] == ["torch.float32"]
    assert_losses_close(run["losses"], reference["losses"], LOW_PRECISION_RTOL)
    assert_sensitive(run["losses"], {"fp32": runs[0]["reference"]["losses"]}, LOW_PRECISION_RTOL)


def test_fabric_refuses_what_it_cannot_run():
    from atorch.integrations.common import TrainerStrategyError
    from atorch.integrations.fabric import AtorchFabricStrategy

    with pytest.raises(TrainerStrategyError, match="pipeline_parallel.*supports"):
        AtorchFabricStrategy(["pipeline_parallel"])
    with pytest.raises(TrainerStrategyError, match="named strategy"):
        AtorchFabricStrategy(None)
