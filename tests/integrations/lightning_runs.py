"""Training runs of a tiny GPT-2 LightningModule under Lightning's DDP and AtorchStrategy."""

import torch

from tests.helpers.hf import CountingTokens, tiny_gpt2

BATCH = 4  # per data-parallel rank


def _module_cls():
    import lightning as L

    class TinyGPT2(L.LightningModule):
        def __init__(self, lr: float):
            super().__init__()
            self.model, self.lr = tiny_gpt2(), lr

        def forward(self, batch):
            return self.model(**batch)

        def training_step(self, batch, batch_idx):
            return self(batch).loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self(batch).loss, sync_dist=True)

        def configure_optimizers(self):
            optim = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
            warmup = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 3))
            return {"optimizer": optim, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return TinyGPT2


def train_lightning(output_dir, strategy=None, steps: int = 10, lr: float = 1e-2, batch: int = BATCH,
                    resume: str | None = None, save_at: int | None = None, precision: str = "32-true",
                    search: dict | None = None) -> dict:
    """Fit the tiny GPT-2; the global loss of every optimizer step (mean over the ranks' micro-batches)."""
    import lightning as L
    import torch.distributed as dist

    losses, compute_dtypes = [], set()
    micro: list[torch.Tensor] = []

    wrapped = []

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            wrapped.append(type(trainer.strategy.model).__name__)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch_, batch_idx):
            loss = outputs["loss"].detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            micro.append(loss)
            if len(micro) == trainer.accumulate_grad_batches:
                losses.append(float(torch.stack(micro).mean()))
                micro.clear()

    module = _module_cls()(lr)
    module.model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda m, i, o: compute_dtypes.add(str(o.dtype)) if torch.is_grad_enabled() else None)
    if search is not None:  # strategy=None: AtorchStrategy searches
        from atorch.integrations.lightning import AtorchStrategy

        lightning_strategy = AtorchStrategy(None, save_strategy_to=f"{output_dir}/atorch_strategy.json", **search)
    elif strategy is None:
        from lightning.pytorch.strategies import DDPStrategy

        lightning_strategy = DDPStrategy(process_group_backend="gloo")
    else:
        from atorch.integrations.lightning import AtorchStrategy

        lightning_strategy = AtorchStrategy(strategy, save_strategy_to=f"{output_dir}/atorch_strategy.json")
    callbacks = [Record()]
    if save_at:  # Lightning's own checkpoints, at the end of each epoch (4 steps)
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=output_dir, filename="{step}", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=lightning_strategy, precision=precision, max_steps=steps,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=callbacks,
                        default_root_dir=output_dir, logger=False, enable_checkpointing=bool(save_at),
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
                        val_check_interval=5, check_val_every_n_epoch=None)
    loader = torch.utils.data.DataLoader(CountingTokens(64), batch_size=batch)
    val = torch.utils.data.DataLoader(CountingTokens(16), batch_size=batch)
    trainer.fit(module, loader, val, ckpt_path=resume)
    return {"losses": losses, "compute_dtypes": sorted(compute_dtypes),
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "strategy": None if strategy is None and search is None else lightning_strategy.strategy.to_json(),
            "wrapped": wrapped[0]}
