"""The cost model's H100 profile against published, measured H100 BF16 training runs: each run's
model and layout costed as ``atorch plan --search`` costs it, its estimated MFU beside the one
published, under the publisher's own MFU convention.

    .venv/bin/python benchmarks/published_mfu.py

The runs are llm-foundry's "H100 80GB BF16" table (mosaicml/llm-foundry,
scripts/train/benchmarking/README.md): MPT models on 8-64 H100s, FSDP FULL_SHARD under bf16 amp,
with and without activation checkpointing, MFU = (6 N + 6 x attention's forward FLOPs per token) x
tokens/s / (GPUs x 989.5 TFLOP/s). An MPT block (attention, a 4 x d_model GELU MLP, tied
embeddings) is costed as a Llama block of the same parameter count and FLOPs (a gated MLP 8/3 x
d_model wide); its FSDP all-gathers and reduce-scatters run per microbatch, as Composer's FSDP does
with gradient accumulation, so one microbatch's step is costed and the optimizer step left out.
The profile's efficiency terms were set once against all of these points together (see the
profile's sources); this prints each point's error and writes benchmarks/results/published_mfu.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md, table 'H100 80GB BF16'"
# MPT sizes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): d_model, n_layers, n_heads
MPT = {"1b": (2048, 24, 16), "3b": (2560, 32, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
       "30b": (7168, 48, 64), "70b": (8192, 80, 64)}
VOCAB = 50368
PEAK = 989.5e12  # llm-foundry's GPU_AVAILABLE_FLOPS for h100_80gb bf16
# (model, sequence, GPUs, microbatch, activation checkpointing, published MFU %, published NumParams)
POINTS = [
    ("1b", 2048, 64, 20, False, 40.85, 1315950592),
    ("3b", 4096, 8, 5, False, 42.31, 2657080320),
    ("7b", 2048, 8, 6, False, 46.44, 6658859008),
    ("7b", 4096, 8, 16, True, 40.42, 6667247616),
    ("7b", 32768, 8, 2, True, 30.94, 6784688128),
    ("13b", 2048, 64, 2, False, 39.86, 12853954560),
    ("13b", 4096, 8, 10, True, 41.6, 12864440320),
    ("30b", 2048, 32, 14, True, 43.92, 29975214080),
    ("70b", 2048, 64, 8, True, 42.57, 64862437376),
]
# Rows of the same table left out of the fit, to check it on runs it did not see.
HELD_OUT = [
    ("1b", 4096, 8, 7, False, 40.26, 1320144896),
    ("3b", 8192, 8, 3, False, 40.31, 2667566080),
    ("7b", 8192, 8, 8, True, 37.14, 6684024832),
    ("13b", 16384, 8, 3, True, 35.55, 12927354880),
    ("30b", 4096, 8, 1, True, 35.86, 29989894144),
    ("70b", 2048, 32, 2, True, 36.15, 64862437376),
]


def mpt_as_llama(size: str, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    d_model, layers, heads = MPT[size]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=d_model, intermediate_size=round(8 * d_model / 3),
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=seq, tie_word_embeddings=True)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def estimated_mfu(point, profile) -> dict:
    step = costed(point, profile)
    step.profile = profile
    return mfu_row(point, step.seconds())


def costed(point, profile):
    """The point's one-microbatch step as the cost model builds it (its ``profile`` still to set:
    benchmarks/fit_h100_profile.py prices the same steps at many)."""
    size, seq, gpus, micro, checkpoint, published, params = point
    methods = ["parallel_mode", ("amp_native", "bf16"), *(["checkpoint"] if checkpoint else []), "fsdp"]
    return fsdp_step(mpt_as_llama(size, seq), methods, seq, gpus, micro, profile)


def fsdp_step(model, methods: list, seq: int, gpus: int, micro: int, profile):
    """``methods`` on ``gpus`` data ranks, ``micro`` sequences of ``seq`` a rank, as ``atorch plan``
    costs it: the model probed on meta with flash attention's saved tensors."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.attention import FlashAttentionProbe
    from atorch.auto.strategy import Strategy
    from atorch.utils.log import quiet

    ctx = DeviceContext(gpus, min(gpus, profile.gpus_per_node), torch.device("cpu"), None, profile.memory)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with quiet():
        strategy = resolve_strategy(model, Strategy(methods))
        counts: list = []
        with FlashAttentionProbe():
            saved = cost.activation_bytes(model, strategy, {"input_ids": ids, "labels": ids}, "unpack_dict", None, ctx,
                                          counts)
        flops, ops, _, hooked, _, attention, traffic, whole = cost.scaled_counts(counts, micro)
        return cost.build_cost(model, strategy, {"data": gpus}, 2.0, saved * micro, flops, micro * seq, "cuda",
                               ops, 0.0, (), hooked, (), attention, forward_traffic=traffic, whole_traffic=whole)


# torchtitan's Llama 3.1 8B on 8 H100s (pytorch/torchtitan docs/performance.md; arXiv 2410.06511):
# FSDP, selective activation checkpointing, bf16, local batch 1 x 8192, eager: 5,762 tokens/s a GPU,
# on H100s of the 96 GB HBM2e, 500 W kind (the profile is the 700 W SXM's): set beside, not a check.
TORCHTITAN_8B = {"run": "torchtitan Llama 3.1 8B, selective AC", "seq": 8192, "gpus": 8, "published_tps": 5762}


def torchtitan_row(profile) -> dict:
    """torchtitan's Llama 3.1 8B run costed as ``atorch plan`` costs it (FSDP, amp, selective
    checkpointing): estimated tokens/s a GPU beside the published."""
    from transformers import LlamaConfig, LlamaForCausalLM

    run = TORCHTITAN_8B
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=run["seq"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    methods = ["parallel_mode", ("amp_native", "bf16"), ("checkpoint", {"selective": True}), "fsdp"]
    step = fsdp_step(model, methods, run["seq"], run["gpus"], 1, profile)
    step.profile = profile
    estimated = run["seq"] / step.seconds()
    return {**run, "estimated_tps": estimated, "ratio": estimated / run["published_tps"]}


def mfu_row(point, seconds: float) -> dict:
    """The point's estimated MFU, under llm-foundry's convention, for a step of ``seconds``."""
    size, seq, gpus, micro, checkpoint, published, params = point
    tokens_per_s = micro * seq * gpus / seconds
    d_model, layers, _ = MPT[size]
    model_flops = 6 * params + 3 * layers * 2 * 2 * d_model * seq  # per token, llm-foundry's MFU convention
    mfu = model_flops * tokens_per_s / (gpus * PEAK)
    return {"model": f"MPT-{size}", "seq": seq, "gpus": gpus, "microbatch": micro, "checkpointing": checkpoint,
            "published_mfu": published / 100, "estimated_mfu": mfu, "ratio": mfu / (published / 100)}


def main(argv: list[str] | None = None) -> str:
    from atorch.auto.search.profiles import load_profile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="h100_80gb")
    parser.add_argument("--tiny", action="store_true", help="the first two points only")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                                            "published_mfu"))
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    fitted, held = (POINTS[:2], HELD_OUT[:1]) if args.tiny else (POINTS, HELD_OUT)
    rows = [{**estimated_mfu(point, profile), "set": "fit"} for point in fitted]
    rows += [{**estimated_mfu(point, profile), "set": "held out"} for point in held]
    worst = {name: max(abs(r["ratio"] - 1) for r in rows if r["set"] == name) for name in ("fit", "held out")}
    table = harness.table(
        ["run", "sequence", "GPUs", "microbatch", "checkpointing", "published MFU", "estimated MFU",
         "estimated / published", "set"],
        [[r["model"], r["seq"], r["gpus"], r["microbatch"], "yes" if r["checkpointing"] else "no",
          f"{r['published_mfu']:.1%}", f"{r['estimated_mfu']:.1%}", f"{r['ratio']:.2f}", r["set"]] for r in rows])
    markdown = (f"Estimated (profile {profile.name}, estimated) against measured ({SOURCE}); worst error "
                f"{worst['fit']:.0%} on the runs the profile was fitted to, {worst['held out']:.0%} on those held out."
                "\n\n" + table)
    titan = None if args.tiny else torchtitan_row(profile)
    if titan is not None:
        markdown += (f"\n\nBeside another publisher's run, on other H100s (500 W, not the profile's 700 W SXM): "
                     f"{titan['run']}, {titan['gpus']} GPUs x {titan['seq']} tokens, FSDP: estimated "
                     f"{titan['estimated_tps']:,.0f} tokens/s a GPU, published {titan['published_tps']:,} "
                     f"(estimated / published {titan['ratio']:.2f}).")
    harness.write(args.out, {"profile": profile.name, "source": SOURCE, "rows": rows, "worst_error": worst,
                             "torchtitan": titan}, markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
