"""The benchmarked job: a Llama built from a transformers config (random weights), synthetic
tokens, AdamW; trained by an atorch strategy or by the same loop written by hand.

Each variant pairs a feature with who applies it: ``atorch`` (``auto_accelerate`` with a strategy)
or ``plain`` (what a user writes without atorch: ``torch.autocast``, transformers'
``gradient_checkpointing_enable``, ``Module.compile``, AdamW's ``fused=True``, liger-kernel's
``apply_liger_kernel_to_llama``, transformer-engine's ``te.Linear`` under ``te.fp8_autocast``).
Both start from the same weights and batches and step the same optimizer. The ``search`` variant
is atorch's own pick on the device (a search of at most SEARCH_SECONDS), its twin plain bf16.
"""

import importlib.util
import statistics
import time
from dataclasses import asdict, dataclass

import torch

LR = 1e-4


@dataclass(frozen=True)
class LlamaSize:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int  # sequences per step

    def as_dict(self) -> dict:
        return asdict(self)


# TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads over 4 KV heads, vocab 32000): 1.10B
# parameters; 4 sequences of 2048 tokens a step keep bf16 without checkpointing well inside 80 GB.
LLAMA_1B = LlamaSize(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, seq=2048, batch=4)
# The CPU dry path's: the same code on a model of 0.1M parameters.
DRY = LlamaSize(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=128, seq=32, batch=2)

# feature -> the atorch strategy (None: the search's own pick, found on this device); the plain
# twin does the same by hand (see plain_step; the search's twin is plain bf16)
STRATEGIES = {
    "bf16": [("amp_native", "bf16")],
    "checkpoint": [("amp_native", "bf16"), "checkpoint"],
    "compile": [("amp_native", "bf16"), "native_dynamo"],
    "fp8": [("amp_native", "bf16"), "fp8"],
    "fused_optimizer": [("amp_native", "bf16"), "fused_optimizer"],
    "compile_fused": [("amp_native", "bf16"), "native_dynamo", "fused_optimizer"],
    "fused_kernels": [("amp_native", "bf16"), ("module_replace", {"kernels": "liger"})],
    "search": None,
}
# The search's limits in the "search" unit: its time, and the job it charges a compile over.
SEARCH_SECONDS, PLANNED_STEPS = 240, 10_000
COMPILED = ("compile", "compile_fused")
FUSED_OPTIMIZER = ("fused_optimizer", "compile_fused")
FEATURES = tuple(STRATEGIES)
FP8_ALIGNMENT = 16  # an fp8 GEMM's dims are multiples of 16


def config(size: LlamaSize):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                       num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=size.kv_heads, max_position_embeddings=size.seq,
                       attn_implementation="sdpa")


def build(size: LlamaSize, device: torch.device, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config(size))
    return model.train()


def flops_per_token(size: LlamaSize, params: int) -> float:
    """Model FLOPs a trained token costs (forward + backward, no recomputation): 6 per weight of
    every matmul (the parameters less the input embedding, a lookup) and 12 x layers x hidden x
    sequence for attention's scores and values, causal masking not discounted: the convention of
    PaLM's MFU (Chowdhery et al. 2022, appendix B) and llm-foundry's, as benchmarks/published_mfu.py."""
    embedding = size.vocab * size.hidden
    return 6.0 * (params - embedding) + 12.0 * size.layers * size.hidden * size.seq


class Tokens(torch.utils.data.Dataset):
    """Random token ids from a seed (labels are the ids: the model shifts them)."""

    def __init__(self, size: LlamaSize, n: int = 64, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, size.vocab, (n, size.seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def forever(loader):
    while True:
        yield from loader


def unsupported(feature: str, device: torch.device) -> str | None:
    """Why ``feature`` cannot be benchmarked on ``device`` (None: it can)."""
    if feature == "fp8":
        if device.type != "cuda":
            return "fp8 needs a CUDA GPU of compute capability 8.9+"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return f"fp8 needs compute capability 8.9+, this GPU has {capability[0]}.{capability[1]}"
        if importlib.util.find_spec("transformer_engine") is None:
            return "transformer-engine is not installed (pip install 'transformer-engine[pytorch]')"
    if feature == "fused_kernels":
        if device.type != "cuda":
            return "liger-kernel's kernels are Triton kernels for CUDA GPUs"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install 'atorch[liger]')"
    return None


def atorch_step(model, size: LlamaSize, feature: str, device: torch.device):
    import atorch

    search = {} if STRATEGIES[feature] is not None else {
        "time_limit": SEARCH_SECONDS, "planned_steps": PLANNED_STEPS, "use_search_cache": False}
    status, result, strategy = atorch.auto_accelerate(
        model, torch.optim.AdamW, Tokens(size), lambda batch, out: out.loss, optim_args={"lr": LR},
        dataloader_args={"batch_size": size.batch, "shuffle": False}, model_input_format="unpack_dict",
        load_strategy=STRATEGIES[feature], **search)
    if not status:
        raise RuntimeError(f"auto_accelerate could not apply {STRATEGIES[feature] or 'a searched strategy'}")
    batches = forever(result.dataloader)

    def step():
        batch = result.prepare_input(next(batches), device)
        loss = result.loss_func(batch, result.model(**batch))
        result.backward(loss)
        result.step()
        return loss.detach()

    return step, {"strategy": strategy.opt_names, "notes": list(getattr(result, "notes", ()))}


def plain_step(model, size: LlamaSize, feature: str, device: torch.device):
    fp8 = None
    if feature == "fp8":
        fp8 = _hand_fp8(model)
    if feature == "checkpoint":
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x; the older name warns there
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if feature == "fused_kernels":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
    if feature in COMPILED:
        model.compile()
    optim = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if feature in FUSED_OPTIMIZER else {}))
    batches = forever(torch.utils.data.DataLoader(Tokens(size), batch_size=size.batch, shuffle=False))

    def step():
        batch = {key: value.to(device, non_blocking=True) for key, value in next(batches).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if fp8 is None:
                loss = model(**batch).loss
            else:
                with fp8():
                    loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    return step, {"strategy": ["by hand"], "notes": []}


def _hand_fp8(model):
    """Every nn.Linear whose dims allow it on te.Linear (weights copied); returns the forward's
    context: fp8 autocast with transformer-engine's delayed scaling (E4M3 forward, E5M2 backward)."""
    import functools

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear and not (module.in_features % FP8_ALIGNMENT
                                                    or module.out_features % FP8_ALIGNMENT):
            linear = te.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               params_dtype=module.weight.dtype, device=module.weight.device)
            with torch.no_grad():
                linear.weight.copy_(module.weight)
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            model.set_submodule(name, linear)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
    return functools.partial(te.fp8_autocast, enabled=True, fp8_recipe=recipe)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size: LlamaSize, who: str, feature: str, device: torch.device, warmup: int, steps: int) -> dict:
    """Train ``warmup`` steps (compilation happens there), then time ``steps`` steps one by one.
    Peak memory (CUDA) counts everything this process allocated: weights, optimizer, activations."""
    why = unsupported(feature, device)
    if why:
        return {"skipped": why}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    model = build(size, device)
    params = sum(p.numel() for p in model.parameters())
    step, info = (atorch_step if who == "atorch" else plain_step)(model, size, feature, device)
    losses = []
    for _ in range(warmup):
        losses.append(float(step()))
    _sync(device)
    ready = time.perf_counter()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        _sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    median = statistics.median(seconds)
    tokens = size.batch * size.seq
    row = {"who": who, "feature": feature, **info, "params": params, "tokens_per_step": tokens,
           "flops_per_token": flops_per_token(size, params), "step_s": median, "step_s_min": min(seconds),
           "step_s_max": max(seconds), "tokens_per_s": tokens / median, "losses": losses,
           "setup_and_warmup_s": ready - began, "warmup": warmup, "steps": steps}
    if device.type == "cuda":
        row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        row["peak_reserved"] = torch.cuda.max_memory_reserved(device)
    return row
