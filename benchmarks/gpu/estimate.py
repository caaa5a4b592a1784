"""The cost model's estimate of the benchmarked job: step time and peak memory of each atorch
strategy on one device, at a profile's rates (the calibration ``atorch calibrate`` took on this
device, or a datasheet profile), costed the way ``atorch plan --search`` costs a candidate: the
model on the meta device, its activations and FLOPs probed on one sequence and scaled to the batch.
"""

from contextlib import nullcontext

import torch

from benchmarks.gpu import llama

# AdamW keeps two fp32 moments a parameter
ADAMW_STATE_FACTOR = 2.0
# NVIDIA H200 datasheet: GPU memory bandwidth 4.8 TB/s (https://www.nvidia.com/en-us/data-center/h200/)
H200_BANDWIDTH = 4.8e12
# What the cost model has no term for: the estimate would be the bf16 one under another name.
NOT_MODELLED = {"compile": "the cost model has no term for torch.compile's fusions (it would read as bf16's)",
                "compile_fused": "the cost model has no term for torch.compile's fusions",
                "fused_kernels": "the cost model has no term for liger-kernel's fusions (it would read as bf16's)",
                "search": "the search's pick is estimated in its own report",
                "fp8": "the cost model has no fp8 term (atorch plan leaves fp8 out too)"}


def estimate(size: llama.LlamaSize, feature: str, profile, device_type: str,
             optim_seconds_per_byte: float = 0.0) -> dict:
    """``{"step_s", "peak_bytes", "memory"}`` of ``feature``'s strategy for ``size``, or
    ``{"skipped": why}``."""
    if feature in NOT_MODELLED:
        return {"skipped": NOT_MODELLED[feature]}
    step = costed(size, feature, profile, device_type, optim_seconds_per_byte)
    step.profile = profile
    memory = step.memory()
    return {"step_s": step.seconds(), "peak_bytes": memory.total, "memory": memory.as_dict(),
            "strategy": list(step.methods)}


def costed(size: llama.LlamaSize, feature: str, profile, device_type: str, optim_seconds_per_byte: float = 0.0,
           strategy: list | None = None):
    """The StepCost of ``feature``'s strategy (or of ``strategy``) for ``size`` (its ``profile``
    still to set)."""
    from transformers import LlamaForCausalLM

    from atorch.auto.environment import DeviceContext
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search import cost
    from atorch.auto.search.attention import FlashAttentionProbe
    from atorch.auto.strategy import Strategy
    from atorch.utils.log import quiet

    with torch.device("meta"):
        model = LlamaForCausalLM(llama.config(size))
    # the probe runs the module rewrites as on a CPU, its tensors on meta (as atorch plan does)
    probe_ctx = DeviceContext(1, 1, torch.device("cpu"), None, profile.memory)
    ids = torch.zeros(1, size.seq, dtype=torch.long, device="meta")
    attention = FlashAttentionProbe if profile.attention == "flash" else nullcontext
    with quiet():
        strategy = resolve_strategy(model, Strategy(strategy or llama.STRATEGIES[feature]))
        counts: list = []
        with attention():
            saved = cost.activation_bytes(model, strategy, {"input_ids": ids, "labels": ids}, "unpack_dict", None,
                                          probe_ctx, counts)
        b = size.batch
        flops, ops, _, hooked, _, attention_flops, traffic, whole, recomputed, again = cost.scaled_counts(counts, b)
        step = cost.build_cost(model, strategy, {"data": 1}, ADAMW_STATE_FACTOR, saved * b, flops, b * size.seq,
                               device_type, ops, optim_seconds_per_byte, (), hooked, (), attention_flops,
                               forward_traffic=traffic, whole_traffic=whole, recomputed_flops=recomputed,
                               recomputed_attention=again)
    return step


def datasheet_profile(device_name: str):
    """The repository's profile for this GPU and where its peak comes from, or (None, why).

    H100 SXM: atorch/auto/search/profiles/h100_80gb.json. H200 has the H100 SXM's compute (NVIDIA's
    H200 datasheet lists the same tensor-core FLOPS) with more, faster memory: that profile with
    the H200's memory bandwidth (H200_BANDWIDTH); its memory's size is not what is compared."""
    import dataclasses

    from atorch.auto.search.profiles import load_profile

    name = device_name.lower()
    if ("h100" in name and "pcie" not in name) or "h200" in name:
        profile = load_profile("h100_80gb")
        source = profile.sources["matmul_flops.bf16"]
        if "h200" in name:
            profile = dataclasses.replace(profile, memory_bandwidth=H200_BANDWIDTH)
            source = ("NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): the H100 SXM's "
                      "tensor-core FLOPS, 4.8 TB/s of memory bandwidth; taken from the h100_80gb profile: " + source)
        return profile, source
    return None, f"no hardware profile in atorch/auto/search/profiles for {device_name!r}"
