"""Train a small Llama (built from a transformers config, nothing downloaded) with auto_accelerate.

    # fully automatic: search, print the report, train with the winner, save it
    torchrun --nproc_per_node=2 examples/train_llama.py --save-strategy best.json
    # semi-automatic: apply a strategy file
    torchrun --nproc_per_node=2 examples/train_llama.py --strategy strategies/ddp_bf16_checkpoint.json

Any strategy file works unchanged on 1 or N processes; atorch fits it to the world size and logs
what it adjusted.
"""

import argparse
import time

import torch
from torch.utils.data import Dataset

import atorch


def build_model(vocab_size: int, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


class CountingSequences(Dataset):
    """Token sequences that count up by a per-sample step (mod vocab): easy to learn, generated locally."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab_size, (n, 1), generator=gen)
        steps = torch.randint(1, 4, (n, 1), generator=gen)
        self.tokens = (starts + steps * torch.arange(seq_len)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def loss_func(batch, output):
    return output.loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto", help="a strategy file, or 'auto' to search for the best one")
    parser.add_argument("--memory-budget", default=None, help="per-rank memory for the search, e.g. 2GiB")
    parser.add_argument("--report", default=None, help="write the search report here (JSON)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-strategy", default=None, help="write the applied strategy here (JSON)")
    args = parser.parse_args()

    atorch.init_distributed()
    torch.manual_seed(0)
    vocab = 128
    model = build_model(vocab, args.hidden, args.layers)
    dataset = CountingSequences(args.global_batch * args.steps, args.seq_len, vocab)

    status, result, strategy = atorch.auto_accelerate(
        model,
        torch.optim.AdamW,
        dataset,
        loss_func,
        optim_args={"lr": args.lr},
        dataloader_args={"batch_size": args.global_batch, "shuffle": True},
        model_input_format="unpack_dict",
        load_strategy=None if args.strategy == "auto" else args.strategy,
        save_strategy_to_file=args.save_strategy,
        # planned_steps: the job's length, over which the search charges a compile it tries on its
        # pick (a compile cannot pay for itself in a job of tens of steps, so it is not tried)
        **({"verbose": True, "memory_budget": args.memory_budget, "report_file": args.report,
            "dryrun_steps": 2, "planned_steps": args.steps} if args.strategy == "auto" else {}),
    )
    if not status:
        raise SystemExit("no strategy could be applied; see the report above")
    if atorch.rank() == 0:
        print(f"world size {atorch.world_size()}, applied {strategy}", flush=True)

    model = result.model
    start, step = time.perf_counter(), 0
    for batch in result.dataloader:
        batch = result.prepare_input(batch, atorch.device())
        loss = result.loss_func(batch, model(**batch))
        result.backward(loss)  # the same two calls under every strategy atorch may pick
        stepped = result.sync_gradients  # False on a micro-batch of gradient accumulation
        result.step()
        if not stepped:
            continue
        step += 1  # optimizer steps, not loader batches
        if step % 5 == 1 or step == args.steps:
            last = result.last_step  # the global batch's token mean, the same on every rank
            if atorch.rank() == 0 and last.loss is not None:
                print(f"step {step:3d}  loss {last.loss:.4f}  ({last.tokens} tokens)", flush=True)
        if step == args.steps:
            break
    if atorch.rank() == 0:
        print(f"done: {step} optimizer steps in {time.perf_counter() - start:.1f}s", flush=True)
    atorch.shutdown()  # every rank leaves together, so a finished job exits 0


if __name__ == "__main__":
    main()
