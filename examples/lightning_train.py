"""Train a LightningModule under an atorch strategy (docs/integrations.md).

    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py --strategy fsdp,checkpoint --steps 20

A small GPT-2 built from its config (nothing is downloaded) in a LightningModule, trained by
``L.Trainer(strategy=AtorchStrategy(...))``: Lightning runs its loop (accumulation, clipping,
validation, schedulers, ModelCheckpoint); atorch holds the model and the checkpoints, so
``--resume`` may name a checkpoint saved under another strategy.
"""

import argparse
import os

import torch


class CountingTokens(torch.utils.data.Dataset):
    """Sequences that count up by a per-sample stride (mod vocab): learnable in a few steps."""

    def __init__(self, vocab: int, seq: int, n: int):
        gen = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, vocab, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="fsdp,checkpoint", help="comma-separated methods or a strategy file")
    parser.add_argument("--output-dir", default="out/lightning")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume", default=None, help="a checkpoint saved by this script")
    args = parser.parse_args()

    import lightning as L
    from transformers import GPT2Config, GPT2LMHeadModel

    from atorch.integrations.lightning import AtorchStrategy

    class GPT2Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))

        def forward(self, batch):
            return self.model(**batch)

        def training_step(self, batch, batch_idx):
            loss = self(batch).loss
            self.log("loss", loss, prog_bar=True, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self(batch).loss, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    strategy = args.strategy if args.strategy.endswith((".json", ".yaml")) else args.strategy.split(",")
    atorch_strategy = AtorchStrategy(strategy, save_strategy_to=f"{args.output_dir}/atorch_strategy.json")
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=atorch_strategy,
        max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0, default_root_dir=args.output_dir,
        val_check_interval=10, limit_val_batches=2, logger=False, enable_progress_bar=False, log_every_n_steps=5,
    )
    data = torch.utils.data.DataLoader(CountingTokens(256, 32, 1024), batch_size=4)
    val = torch.utils.data.DataLoader(CountingTokens(256, 32, 64), batch_size=4)
    trainer.fit(GPT2Module(), data, val, ckpt_path=args.resume)
    if trainer.is_global_zero:
        print("atorch strategy:", trainer.strategy.strategy.opt_names, "loss", float(trainer.callback_metrics["loss"]))


if __name__ == "__main__":
    main()
