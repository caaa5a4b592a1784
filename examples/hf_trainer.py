"""Fine-tune a GPT-2 with the Hugging Face Trainer under an atorch strategy (docs/integrations.md).

    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py --strategy fsdp,checkpoint --steps 20
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py --strategy auto          # search
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py --strategy parallel_mode \\
        --resume out/hf_trainer/checkpoint-10                # resume a run saved under another strategy

A small GPT-2 built from its config (nothing is downloaded) learns generated counting sequences.
The Trainer runs its own loop (warmup, schedule, accumulation, clipping, evaluation, logging);
``--strategy`` is a comma-separated list of atorch methods, a strategy file, or ``auto``. The
strategy as applied is written to ``<output-dir>/atorch_strategy.json`` (and the search report
beside it), checkpoints every ``--save-steps`` to ``<output-dir>/checkpoint-N``.
"""

import argparse
import os

import torch

import atorch


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
    parser.add_argument("--strategy", default="fsdp,checkpoint",
                        help="comma-separated methods, a strategy file, or 'auto' to search")
    parser.add_argument("--output-dir", default="out/hf_trainer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--resume", default=None, help="a checkpoint-N folder saved by AtorchTrainer")
    parser.add_argument("--memory-budget", default="4GiB", help="for --strategy auto")
    args = parser.parse_args()

    atorch.init_distributed()
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from atorch.integrations.transformers import AtorchTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    if args.strategy == "auto":
        strategy, search = None, {"memory_budget": args.memory_budget, "time_limit": 120}
    elif os.path.exists(args.strategy):
        strategy, search = args.strategy, {}
    else:
        strategy, search = args.strategy.split(","), {}
    training = TrainingArguments(
        args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, logging_steps=5,
        eval_strategy="steps", eval_steps=10, save_steps=args.save_steps, use_cpu=not torch.cuda.is_available(),
        report_to=[], disable_tqdm=True, seed=0,
    )
    trainer = AtorchTrainer(model=model, args=training, train_dataset=CountingTokens(256, 32, 1024),
                            eval_dataset=CountingTokens(256, 32, 64), strategy=strategy, **search)
    if trainer.is_world_process_zero():
        print("atorch strategy:", trainer.strategy.opt_names, flush=True)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model()  # the serial model's weights: GPT2LMHeadModel.from_pretrained(output_dir)


if __name__ == "__main__":
    main()
