"""Small models and data built from code (nothing is downloaded)."""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import atorch
from atorch.auto import auto_accelerate

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def lm_loss(batch, logits):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["labels"].reshape(-1))


def global_mean(value: torch.Tensor) -> float:
    import torch.distributed as dist

    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def local_numel(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)


def optimizer_state_numel(optim) -> int:
    """Elements of optimizer state this rank holds (inside AmpOptimizer / ZeroRedundancyOptimizer)."""
    inner = getattr(optim, "optimizer", optim)
    inner = getattr(inner, "optim", inner)
    return local_numel(v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.ndim > 0)


def serial_steps(model, optim, batches, autocast_dtype: torch.dtype | None = None) -> list[float]:
    """The reference every distributed run is held to: plain PyTorch, one optimizer step per
    batch (``model(**batch).loss``, backward, step, zero_grad), under CPU autocast when
    ``autocast_dtype`` is given; each step's loss."""
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def global_step_losses(result, steps: int) -> list[float]:
    """The documented loop over an auto_accelerate result for ``steps`` optimizer steps (each every
    micro-batch of one global batch): the global batch's token-mean loss of each
    (``result.last_step.loss``, the same on every rank)."""
    losses, batches = [], iter(result.dataloader)
    for _ in range(steps):
        for _ in range(result.args.get("gradient_accumulation_steps", 1)):
            batch = result.prepare_input(next(batches), torch.device("cpu"))
            result.backward(result.loss_func(batch, result.model(**batch)))
            result.step()
        losses.append(result.last_step.loss)
    return losses


def result_steps(result, steps: int) -> list[float]:
    """The loop through ``result.backward`` and ``result.step`` (a pipeline's model runs its
    schedule in the forward and needs them): this rank's loss of each step."""
    losses, batches = [], iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(batches), torch.device("cpu"))
        loss = result.loss_func(batch, result.model(**batch))
        result.backward(loss)
        result.step()
        losses.append(loss.item())
    return losses


def run_steps(result, steps: int, clip: float | None = None) -> tuple[list[float], list[float]]:
    """The user's training loop over an auto_accelerate result: global losses (and norms when clipping)."""
    out = train_steps(result, steps, clip)
    return out["losses"], out["norms"]


def train_steps(result, steps: int, clip: float | None = None, micro_batches: int = 1,
                param_dtype: torch.dtype | None = None, loss_scale: float = 1.0) -> dict:
    """The user's training loop over an auto_accelerate result, with what each rank saw.

    Returns ``losses`` (the mean over ranks, what a user logs), ``local_losses`` (this rank's own
    loss before any reduction), ``micro_losses`` (per step, the loss of each micro-batch),
    ``norms`` (when clipping) and ``data_rank`` (the share of each global batch it trained on).

    A serial reference of an n-rank data-parallel run passes ``micro_batches=n``: each global
    batch is cut the way DistributedSampler deals it (sample i to rank i % n) and the gradients
    are accumulated, so every forward and backward runs on the same shapes as on the ranks and
    only the order of the fp32 gradient sum differs. ``param_dtype`` computes forward and backward
    with the parameters cast to that dtype and sums the micro-batch gradients in fp32 onto the fp32
    parameters: what FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` does;
    with fp16, ``loss_scale`` scales the loss before backward and the fp32 grads back after, as
    amp_native's GradScaler does around FSDP2 (no step is skipped here). The loop runs on one thread, like every rank of tests/helpers/dist.run_distributed: CPU
    kernels split some reductions (LayerNorm's weight grads) over threads, and in bf16 that order
    shows in the losses.
    """
    if micro_batches > 1 and result.args["use_optim_backward"]:
        raise ValueError("micro_batches needs the plain loop (loss.backward()), not DeepSpeed's engine")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_steps(result, steps, clip, micro_batches, param_dtype, loss_scale)
    finally:
        torch.set_num_threads(threads)


def _train_steps(result, steps, clip, micro_batches, param_dtype, loss_scale) -> dict:
    from atorch.auto import clip_grad_norm

    params = list(result.model.parameters())
    losses, local_losses, micro_losses, norms = [], [], [], []
    batches = iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(batches), atorch.device())
        if result.args["use_optim_backward"]:  # DeepSpeed: the engine runs backward and zeroes grads
            loss = result.loss_func(batch, result.model(**batch))
            result.optim.backward(loss)
            result.optim.step()
            parts = [loss.detach().float()]
        else:
            masters = _cast_params(params, param_dtype)
            summed, parts = {}, []
            for i in range(micro_batches):
                piece = {k: v[i::micro_batches] if torch.is_tensor(v) else v for k, v in batch.items()}
                loss = result.loss_func(piece, result.model(**piece))
                parts.append(loss.detach().float())
                if not masters:  # fp32 parameters: autograd accumulates, as DDP's average would
                    (loss / micro_batches if micro_batches > 1 else loss).backward()
                    continue
                # Like each FSDP2 rank: its own low-precision grads, cast to fp32, then averaged.
                (loss * loss_scale if loss_scale != 1.0 else loss).backward()
                for p in params:
                    if p.grad is not None:
                        grad = p.grad.float()
                        summed[p] = summed[p] + grad if p in summed else grad
                        p.grad = None
            for p, master in masters.items():
                p.data = master
                p.grad = summed[p] / (micro_batches * loss_scale) if p in summed else None
            if clip is not None:
                norms.append(clip_grad_norm(result.model, clip).item())
            result.optim.step()
            result.optim.zero_grad()
        local = torch.stack(parts).mean()
        local_losses.append(local.item())
        micro_losses.append([part.item() for part in parts])
        losses.append(global_mean(local))
    # Which share of each global batch this rank trained on (DistributedSampler's rank).
    data_rank = getattr(getattr(result.dataloader, "sampler", None), "rank", 0)
    return {"losses": losses, "local_losses": local_losses, "micro_losses": micro_losses, "norms": norms,
            "data_rank": data_rank}


def _cast_params(params, dtype):
    """Point every parameter at a ``dtype`` copy of itself; return the fp32 originals to restore."""
    if dtype is None:
        return {}
    masters = {p: p.data for p in params}
    for p in params:
        p.data = p.data.to(dtype)
    return masters


@contextlib.contextmanager
def linear_dtypes(model: torch.nn.Module):
    """Collects the dtypes the model's ``nn.Linear`` layers compute in (their outputs') meanwhile."""
    seen: set[torch.dtype] = set()
    handles = [m.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
               for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def replicated_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters this rank holds whole and that every rank must hold bit for bit.

    Left out: FSDP/DTensor shards and tensor-parallel splits (they differ per rank by design).
    Whatever keeps replicas in step (DDP's all-reduce, ZeRO-1's broadcast, the tensor group's
    sequence-parallel grad all-reduce) shows here: a rank that missed it ends on other weights.
    """
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            if not all(isinstance(placement, Replicate) for placement in p.placements):
                continue
            p = p.to_local()
        # Tensor-parallel pieces (Megatron-style, 3D) and per-stage pipeline weights: per rank.
        if any(getattr(p, flag, None) for flag in ("tensor_model_parallel", "intra_layer_sharded", "shard_group")):
            continue
        out[name] = p.detach().cpu().clone()
    return out


def train_losses(load_strategy, steps: int = 5, batch_size: int = 8, lr: float = 0.05, shuffle: bool = False,
                 optim=torch.optim.SGD, seed: int = 0, clip: float | None = None, freeze_embed: bool = False,
                 micro_batches: int = 1, param_dtype: torch.dtype | None = None, loss_scale: float = 1.0,
                 **kwargs) -> dict:
    """Train the tiny transformer through auto_accelerate; return global losses and the strategy.

    ``micro_batches``, ``param_dtype`` and ``loss_scale`` make a serial run the reference of a data-parallel one
    (see :func:`train_steps`).
    """
    torch.manual_seed(seed)
    model = TinyTransformer()
    if freeze_embed:
        model.embed.weight.requires_grad_(False)
    status, result, strategy = auto_accelerate(
        model,
        optim,
        TokenDataset(),
        lm_loss,
        optim_args={"lr": lr},
        dataloader_args={"batch_size": batch_size, "shuffle": shuffle},
        model_input_format="unpack_dict",
        load_strategy=load_strategy,
        **kwargs,
    )
    after_forward = []  # parameter elements this rank holds between forward and backward
    hook = result.model.register_forward_hook(lambda *_: after_forward.append(local_numel(result.model.parameters())))
    with linear_dtypes(result.model) as dtypes:
        steps_out = train_steps(result, steps, clip, micro_batches, param_dtype, loss_scale)
    hook.remove()
    return {
        "status": status,
        **steps_out,
        "replicated": replicated_params(result.model),
        "linear_dtypes": sorted(str(d) for d in dtypes),
        "strategy": strategy.to_json(),
        "notes": list(result.notes),
        "model_type": type(result.model).__name__,
        "optim_type": type(result.optim).__name__,
        "state_numel": None if result.args["use_optim_backward"] else optimizer_state_numel(result.optim),
        "args": dict(result.args),
        "param_numel": local_numel(result.model.parameters()),
        "param_numel_after_forward": after_forward[0],
    }
