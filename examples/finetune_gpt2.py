"""A GPT-2 job from start to finish, the way docs/user_guide.md walks it.

    torchrun --standalone --nproc_per_node=2 examples/finetune_gpt2.py \\
        --strategy strategies/fsdp_bf16_checkpoint.json --steps 20 --accumulation 2 --ckpt-dir /tmp/gpt2_ckpt

A small GPT-2 built from its config (nothing is downloaded; pass --hf-config for another size),
trained on generated token sequences with a ready strategy file (or ``--strategy auto`` for the
search), gradient accumulation, a progress line every few steps, and a checkpoint that the next
run resumes from, under any strategy and number of ranks.
"""

import argparse

import torch

import atorch
import atorch.checkpoint as ckpt
from atorch.utils.steplog import StepLogger


class CountingTokens(torch.utils.data.Dataset):
    """Sequences that count up by a per-sample stride (mod vocab): learnable in a few steps."""

    def __init__(self, vocab: int, seq: int, n: int = 2048):
        gen = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, vocab, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def build_gpt2(config_path: str | None):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = (GPT2Config.from_json_file(config_path) if config_path
              # GPT-2's bos/eos id (50256) is outside a 256-token vocabulary: the last id instead, as in GPT-2
              else GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                              bos_token_id=255, eos_token_id=255))
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="strategies/ddp_bf16_checkpoint.json",
                        help="a strategy file, or 'auto' to search for the fastest strategy that fits")
    parser.add_argument("--hf-config", default=None, help="a GPT-2 config.json (default: a tiny one)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per micro-step, over all ranks")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--ckpt-dir", default=None, help="resume from here if a checkpoint is there; save at the end")
    parser.add_argument("--save-strategy", default=None, help="write the applied strategy here")
    args = parser.parse_args()

    atorch.init_distributed()
    model = build_gpt2(args.hf_config)
    status, result, strategy = atorch.auto_accelerate(
        model, torch.optim.AdamW, CountingTokens(model.config.vocab_size, args.seq), lambda batch, out: out.loss,
        optim_args={"lr": args.lr}, dataloader_args={"batch_size": args.global_batch, "shuffle": True},
        model_input_format="unpack_dict",
        load_strategy=None if args.strategy == "auto" else args.strategy,
        gradient_accumulation_steps=args.accumulation, save_strategy_to_file=args.save_strategy,
        # planned_steps: the job's length, over which the search charges a compile tried on its pick
        **({"verbose": True, "dryrun_steps": 2, "planned_steps": args.steps} if args.strategy == "auto" else {}),
    )
    if not status:
        raise SystemExit("no strategy could be applied; see the report above")
    if atorch.rank() == 0:
        print(f"world size {atorch.world_size()}, applied {strategy}", flush=True)

    step = 0
    if args.ckpt_dir and ckpt.exists(args.ckpt_dir):
        step = ckpt.load(args.ckpt_dir, result.model, result.optim, result.lr_scheduler, result.dataloader)["step"]
    log = StepLogger(every=args.log_every, start=step)  # samples and tokens come from result.last_step
    batches = iter(result.dataloader)
    while step < args.steps:
        batch = next(batches, None)
        if batch is None:  # end of an epoch
            batches = iter(result.dataloader)
            continue
        batch = result.prepare_input(batch, atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        result.backward(loss)
        stepped = result.sync_gradients  # the last micro-step of this optimizer step
        if stepped:
            atorch.auto.clip_grad_norm(result.model, 1.0)
            step += 1
        # the global batch's token mean, tokens and samples, once per optimizer step
        log.step(result.last_step if stepped else None, stepped=stepped)
        result.step()
    log.flush()
    if args.ckpt_dir:
        ckpt.save(args.ckpt_dir, result.model, result.optim, result.lr_scheduler, result.dataloader,
                  extra={"step": step})
    atorch.shutdown()


if __name__ == "__main__":
    main()
