"""Train a small Mixtral (a mixture of experts, built from a transformers config, nothing
downloaded) with its experts spread over the ranks: expert_parallel, with fsdp sharding the rest.

    # 4 experts over 2 ranks (2 each), the other weights sharded by fsdp, bf16
    torchrun --nproc_per_node=2 examples/train_moe.py
    # groups of 2 on 4 ranks: each slice of experts lives on 2 ranks, and fsdp shards it over them
    torchrun --nproc_per_node=4 examples/train_moe.py --expert-group 2
    # the same model without expert parallelism, to compare
    torchrun --nproc_per_node=2 examples/train_moe.py --strategy plain

Each rank prints the experts it holds; the losses are those of the whole global batch, the same
whatever the strategy (docs/methods/expert_parallel.md).
"""

import argparse
import time

import torch

import atorch
from examples.train_llama import CountingSequences, loss_func


def build_model(vocab_size: int, hidden: int, layers: int, experts: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=256)
    return MixtralForCausalLM(config)


def strategy(name: str, group: int | None) -> list:
    if name == "plain":
        return ["parallel_mode"]
    expert = ("expert_parallel", {"size": group}) if group else "expert_parallel"
    return ["parallel_mode", ("amp_native", {"dtype": "bf16"}), "fsdp", expert]


def held_experts(model: torch.nn.Module) -> int:
    """The experts of one block this rank holds (the first dim of its fused expert weights; under
    fsdp over the slice's copies a DTensor, whose shape is the slice's)."""
    weight = next(m.gate_up_proj for m in model.modules() if hasattr(m, "gate_up_proj"))
    return weight.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["experts", "plain"], default="experts")
    parser.add_argument("--expert-group", type=int, default=None, help="ranks in each expert group (default: all)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    atorch.init_distributed()
    torch.manual_seed(0)
    vocab = 128
    model = build_model(vocab, 64, 2, args.experts)
    dataset = CountingSequences(args.global_batch * args.steps, args.seq_len, vocab)
    _, result, applied = atorch.auto_accelerate(
        model, torch.optim.AdamW, dataset, loss_func, optim_args={"lr": args.lr},
        dataloader_args={"batch_size": args.global_batch, "shuffle": True}, model_input_format="unpack_dict",
        load_strategy=strategy(args.strategy, args.expert_group))
    print(f"rank {atorch.rank()}: {held_experts(result.model)} of {args.experts} experts a block, "
          f"applied {applied.opt_names}", flush=True)

    start, step = time.perf_counter(), 0
    for batch in result.dataloader:
        batch = result.prepare_input(batch, atorch.device())
        result.backward(result.loss_func(batch, result.model(**batch)))
        stepped = result.sync_gradients
        result.step()
        if not stepped:
            continue
        step += 1
        if (step % 5 == 1 or step == args.steps) and atorch.rank() == 0:
            print(f"step {step:3d}  loss {result.last_step.loss:.4f}", flush=True)
        if step == args.steps:
            break
    if atorch.rank() == 0:
        print(f"done: {step} optimizer steps in {time.perf_counter() - start:.1f}s", flush=True)
    atorch.shutdown()


if __name__ == "__main__":
    main()
