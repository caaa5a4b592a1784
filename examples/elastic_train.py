"""Elastic training: a job that survives a killed rank by restarting from its last checkpoint.

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/elastic_train.py \\
        --ckpt-dir /tmp/elastic_ckpt --steps 40 --save-every 10

When a rank dies, torchrun stops the others and starts all ranks again (up to --max-restarts
times); each start loads ``--ckpt-dir`` if a checkpoint is there and continues from its step,
with the same weights, optimizer state, learning rate, data position and random streams, so the
losses are those of a run that never stopped. ``--kill-at-step N`` makes rank 1 kill itself once,
at step N of the first attempt, to try it.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

import atorch
import atorch.checkpoint as ckpt

VOCAB, DIM, SEQ = 64, 64, 16


class TinyLM(nn.Module):
    """Embedding, two MLP blocks with dropout, and a head: small enough to restart in seconds."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * DIM, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class NextToken(torch.utils.data.Dataset):
    """Sequences that count up by a per-sample stride: predict the next token."""

    def __init__(self, n: int = 256):
        gen = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, VOCAB, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def loss_func(batch, logits):
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))


def train(ckpt_dir: str, steps: int, save_every: int, strategy: str = "fsdp", kill_at_step: int | None = None,
          timeout_s: float | None = None) -> dict:
    """The training job: resumes from ``ckpt_dir`` when a checkpoint is there; returns the global
    loss of each step it ran (``{step: loss}``). ``timeout_s``: how long a collective may wait."""
    # A collective that waits on a dead rank fails after timeout_s, and torchrun restarts the job.
    atorch.init_distributed(timeout_s=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    _, result, _ = atorch.auto_accelerate(
        TinyLM(), torch.optim.AdamW, NextToken(), loss_func, optim_args={"lr": 3e-3},
        dataloader_args={"batch_size": 16, "shuffle": True}, model_input_format="unpack_dict",
        load_strategy=["parallel_mode"] + ([] if strategy == "ddp" else [strategy]),
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 10, "gamma": 0.7},
    )
    model, optim, scheduler, loader = result.model, result.optim, result.lr_scheduler, result.dataloader
    step, losses = 0, {}
    if ckpt.exists(ckpt_dir):
        step = ckpt.load(ckpt_dir, model, optim, scheduler, loader)["step"]
        if atorch.rank() == 0:
            print(f"attempt {attempt}: resumed from step {step}", flush=True)
    if step >= steps:  # a finished job started again (by hand, or by torchrun after a late failure)
        if atorch.rank() == 0:
            print(f"done: the checkpoint in {ckpt_dir} is at step {step} of {steps}; nothing to train", flush=True)
        return losses

    batches = iter(loader)
    while step < steps:
        batch = next(batches, None)
        if batch is None:  # end of an epoch
            batches = iter(loader)
            continue
        batch = result.prepare_input(batch, atorch.device())
        loss = result.loss_func(batch, model(**batch))
        loss.backward()
        optim.step()
        optim.zero_grad()
        scheduler.step()
        step += 1
        loss = loss.detach()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
            loss /= atorch.world_size()
        losses[step] = loss.item()
        if atorch.rank() == 0:
            print(f"step {step:4d} loss {losses[step]:.7f}", flush=True)
        if step == kill_at_step and attempt == 0 and atorch.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no goodbye
        if step % save_every == 0 or step == steps:
            ckpt.save(ckpt_dir, model, optim, scheduler, loader, extra={"step": step})
    if atorch.rank() == 0:
        print(f"done: {step} steps, final loss {losses[step]:.7f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True, help="where the latest checkpoint lives")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--strategy", default="fsdp", choices=["ddp", "fsdp", "zero1"])
    parser.add_argument("--kill-at-step", type=int, default=None, help="rank 1 SIGKILLs itself here on the first attempt")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before failing")
    args = parser.parse_args()
    train(args.ckpt_dir, args.steps, args.save_every, args.strategy, args.kill_at_step, args.timeout)
    atorch.shutdown()  # every rank leaves together, so a finished job exits 0


if __name__ == "__main__":
    main()
