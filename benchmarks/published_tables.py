"""Published, measured training runs that the hardware profiles are fitted to and checked against
(read by benchmarks/published_mfu.py and benchmarks/fit_profile.py). Each table names its source;
../shared/reference/published_runs.md lists them too.

llm-foundry rows: (MPT size, sequence, GPUs, microbatch, activation checkpointing, published MFU %,
published NumParams), from mosaicml/llm-foundry scripts/train/benchmarking/README.md; FSDP
FULL_SHARD under amp_bf16. torchtitan rows: Llama runs under FSDP2 alone, bf16, eager, tokens/s a
GPU as published.
"""

LLM_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"

# per profile: the llm-foundry table, its GPU_AVAILABLE_FLOPS (the MFU convention's peak), the rows
# the profile's efficiency terms are fitted to, rows of the same table left out of the fit, and
# rows left out that the cost model misses by more than 15%, shown so (the cause is not known)
FOUNDRY = {
    "h100_80gb": {
        "table": "H100 80GB BF16",
        "peak": 989.5e12,
        "fit": [
            ("1b", 2048, 64, 20, False, 40.85, 1315950592),
            ("3b", 4096, 8, 5, False, 42.31, 2657080320),
            ("7b", 2048, 8, 6, False, 46.44, 6658859008),
            ("7b", 4096, 8, 16, True, 40.42, 6667247616),
            ("7b", 32768, 8, 2, True, 30.94, 6784688128),
            ("13b", 2048, 64, 2, False, 39.86, 12853954560),
            ("13b", 4096, 8, 10, True, 41.6, 12864440320),
            ("30b", 2048, 32, 14, True, 43.92, 29975214080),
            ("70b", 2048, 64, 8, True, 42.57, 64862437376),
        ],
        "held_out": [
            ("1b", 4096, 8, 7, False, 40.26, 1320144896),
            ("3b", 8192, 8, 3, False, 40.31, 2667566080),
            ("7b", 8192, 8, 8, True, 37.14, 6684024832),
            ("13b", 16384, 8, 3, True, 35.55, 12927354880),
            ("30b", 4096, 8, 1, True, 35.86, 29989894144),
            ("70b", 2048, 32, 2, True, 36.15, 64862437376),
        ],
        # MPT-30B at 8192 tokens, one sequence a micro-batch: estimated 1.28x; on A100 too (1.33x)
        "missed": [("30b", 8192, 8, 1, True, 29.92, 30019254272)],
    },
    # "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"; the 70B rows (pure bf16, not amp)
    # are left out, and the sizes below 1B (no MPT dimensions in published_mfu.MPT)
    "a100_80gb": {
        "table": "A100 80GB with 1600 Gbps node-node interconnect (RoCE)",
        "peak": 312e12,
        "fit": [
            ("1b", 2048, 8, 14, False, 59.86, 1315950592),
            ("1b", 32768, 8, 1, False, 55.52, 1378865152),
            ("3b", 4096, 8, 5, False, 60.53, 2657080320),
            ("3b", 32768, 8, 3, True, 47.18, 2730480640),
            ("7b", 2048, 8, 6, False, 64.23, 6658859008),
            ("7b", 8192, 8, 8, True, 54.47, 6684024832),
            ("13b", 2048, 8, 2, False, 59.57, 12853954560),
            ("13b", 16384, 8, 3, True, 54.07, 12927354880),
            ("30b", 2048, 8, 3, True, 55.3, 29975214080),
        ],
        "held_out": [
            ("1b", 8192, 8, 3, False, 56.69, 1328533504),
            ("1b", 65536, 8, 1, True, 46.18, 1445974016),
            ("3b", 2048, 8, 10, False, 62.11, 2651837440),
            ("3b", 16384, 8, 1, False, 57.13, 2688537600),
            ("7b", 4096, 8, 16, True, 54.84, 6667247616),
            ("7b", 32768, 8, 2, True, 49.46, 6784688128),
            ("13b", 4096, 8, 10, True, 57.62, 12864440320),
            ("13b", 32768, 8, 1, True, 51.69, 13011240960),
            ("30b", 4096, 8, 1, True, 51.37, 29989894144),
        ],
        # the same run as h100_80gb's miss: estimated 1.33x (fitted, it came out at 1.17x, and
        # pulled the other nine rows to 0.83-0.99)
        "missed": [("30b", 8192, 8, 1, True, 39.38, 30019254272)],
    },
}

# each H100 row's global batch in sequences, as published (MicroBatchSize x GradAccum x GPUs):
# benchmarks/plan_published.py plans the run at it
GLOBAL_BATCH = {
    ("1b", 2048, 64): 1280, ("3b", 4096, 8): 240, ("7b", 2048, 8): 48, ("7b", 4096, 8): 256, ("7b", 32768, 8): 32,
    ("13b", 2048, 64): 128, ("13b", 4096, 8): 240, ("30b", 2048, 32): 1344, ("70b", 2048, 64): 2048,
    ("1b", 4096, 8): 224, ("3b", 8192, 8): 144, ("7b", 8192, 8): 128, ("13b", 16384, 8): 72, ("30b", 4096, 8): 168,
    ("70b", 2048, 32): 1024, ("30b", 8192, 8): 168,
}

# Llama shapes (Hugging Face LlamaConfig fields) of the torchtitan runs below
LLAMA = {
    "Llama 3 8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "Llama 3 70B": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "Llama 2 13B": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40),
    "Llama 2 70B": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
}

# torchtitan's runs: (model, sequence, GPUs, local batch, checkpointing: None, "selective" (per op:
# matmul outputs kept, atorch's selective) or "full", published tokens/s a GPU). Local batch and
# global batch as published; FSDP2 alone, bf16 mixed precision, no torch.compile, no Float8.
TORCHTITAN = {
    # pytorch/torchtitan docs/performance.md at 0413364 (Llama 3 and Llama 2 tables), 64 A100 80GB;
    # the interconnect is not published: the profile's (llm-foundry's RoCE cluster) is assumed.
    # Rows with per-layer selective checkpointing (every other block) are left out.
    "a100_80gb": {
        "source": "pytorch/torchtitan docs/performance.md (commit 0413364), 64 A100 80GB",
        "runs": [
            ("Llama 3 8B", 8192, 64, 1, "selective", 2973),
            ("Llama 3 70B", 8192, 64, 1, "full", 331),
            ("Llama 2 13B", 4096, 64, 2, None, 2162),
            ("Llama 2 13B", 4096, 64, 2, "selective", 1904),
            ("Llama 2 70B", 4096, 64, 1, "selective", 355),
            ("Llama 2 70B", 4096, 64, 2, "full", 353),
        ],
    },
    # benchmarks/llama3_h100_202412_torchtitan.md (tables 1 and 3), H100 96 GB HBM2e at 500 W: not
    # the profile's 700 W SXM (its clock is lower, by how much is not published): set beside only
    "h100_80gb": {
        "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, H100 96 GB HBM2e at 500 W",
        "runs": [
            ("Llama 3 8B", 8192, 8, 2, "selective", 5762),
            ("Llama 3 8B", 8192, 128, 2, "selective", 5605),
        ],
    },
}

# Megatron-LM's weak-scaling table on H100s: GPT models of 1.7B-462B parameters, vocabulary
# 131,072, sequence 4096, each on its own tensor x pipeline x data layout, with Megatron's
# DP, TP and PP communication overlapped; end-to-end throughput. NVIDIA/Megatron-LM README.md
# and images/model_table.png (added in commit f2e5db4, 2024-07-15; read at d98e8a6). The precision
# is not stated: teraFLOP/s / MFU gives H100 SXM's dense bf16 peak (989 TFLOP/s), not fp8's.
# Rows: (name, heads, hidden, layers, tensor, pipeline, data, GPUs, global batch in sequences,
# published teraFLOP/s a GPU). The microbatch size is not published.
MEGATRON_H100 = {
    "source": "NVIDIA/Megatron-LM README.md, images/model_table.png (commit f2e5db4)",
    "vocab": 131072,
    "seq": 4096,
    "runs": [
        ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
    ],
}
