"""checkpoint: activation checkpointing of chosen module classes.

Config forms: ``"checkpoint"`` (the model's repeated blocks, found by structure),
``("checkpoint", (LlamaDecoderLayer,))``, ``("checkpoint", ["LlamaDecoderLayer"])``,
``{"wrap_class": [...], "no_reentrant": False}`` for the reentrant implementation,
``{"selective": True}`` to keep the outputs of matmuls and attention and recompute the rest, and
``{"selective": True, "keep_matmuls": "every_other"}`` to recompute every second matmul of each
block too (torchtitan's per-op selective checkpointing: less memory than keeping them all).

Each matching module's forward is replaced on the instance, so parameter names and
``state_dict`` keys do not change. The reentrant implementation only sees positional tensor
inputs; keyword arguments are passed through but receive no gradient.
"""

import contextlib
import functools
import inspect
import logging
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from pydantic import Field, model_validator
from torch.utils._pytree import tree_leaves

from atorch.auto.config_types import ClassRef, MethodConfig, as_list, class_name
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError
from atorch.utils.log import logger
from atorch.utils.memo import once
from atorch.utils.modules import class_names_in, find_block_classes, missing_class_error, modules_of_classes


class CheckpointConfig(MethodConfig):
    wrap_class: list[ClassRef] = Field(
        default_factory=list, description="classes (or class names) to checkpoint; empty: the repeated blocks"
    )
    no_reentrant: bool = Field(default=True, description="True: non-reentrant checkpoint (recommended)")
    selective: bool = Field(
        default=False, description="save the outputs of matmuls and attention, recompute the cheap element-wise "
        "ops in backward (needs no_reentrant); False: recompute the whole block")
    keep_matmuls: Literal["all", "every_other"] = Field(
        default="all", description="with selective: the matmul (Linear) outputs kept: 'all', or 'every_other' "
        "(the 2nd, 4th... of each block recomputed in backward, as torchtitan's per-op policy: less memory, "
        "more recompute)", json_schema_extra={"omitted_at_default": True})

    @model_validator(mode="after")
    def _selective_needs_non_reentrant(self):
        if self.selective and not self.no_reentrant:
            raise ValueError("selective=True needs no_reentrant=True (torch's selective checkpointing is "
                             "non-reentrant only)")
        if self.keep_matmuls != "all" and not self.selective:
            raise ValueError(f"keep_matmuls={self.keep_matmuls!r} needs selective=True (full checkpointing keeps "
                             "no matmul output)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _from_atorch_form(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            if "wrap_class" in raw:
                return {**raw, "wrap_class": [class_name(c) for c in as_list(raw["wrap_class"])]}
            return raw
        return {"wrap_class": [class_name(c) for c in as_list(raw)]}


# What selective checkpointing keeps: the outputs of the ops whose recompute costs the most
# (matrix products and attention); normalizations, activations, adds and casts are recomputed in
# backward. (Megatron's selective recompute keeps the Linears' outputs and recomputes attention's
# core; torchtitan's per-op policy recomputes every other matmul too: keep_matmuls="every_other".)
SAVED_OPS = tuple(
    op for op in (getattr(torch.ops.aten, name, None) for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"))
    if op is not None
)


def _saves(op) -> bool:
    return getattr(op, "overloadpacket", op) in SAVED_OPS


# The matmuls keep_matmuls="every_other" counts: a Linear's (mm, or addmm with a bias)
MATMULS = tuple(op for op in (getattr(torch.ops.aten, name, None) for name in ("mm", "addmm")) if op is not None)


def selective_policy(ctx, op, *args, **kwargs):
    """torch.utils.checkpoint's policy: keep the outputs of :data:`SAVED_OPS`, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if _saves(op):
        _report_kept(ctx, op, args, kwargs)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def every_other_matmul_policy():
    """A policy for one checkpointed call: as :func:`selective_policy`, but of the block's
    matmuls (:data:`MATMULS`, in the order they run) the 2nd, 4th... are recomputed. The forward
    and the recompute count apart, so both pick the same ones."""
    from torch.utils.checkpoint import CheckpointPolicy

    seen = {False: 0, True: 0}  # matmuls so far, in the forward and in the recompute

    def policy(ctx, op, *args, **kwargs):
        if not _saves(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if getattr(op, "overloadpacket", op) in MATMULS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                recomputed = _SelectiveCount.recomputed
                if recomputed is not None and not ctx.is_recompute:
                    recomputed(matmul_flops(op, args), 0)
                return CheckpointPolicy.PREFER_RECOMPUTE
        _report_kept(ctx, op, args, kwargs)
        return CheckpointPolicy.MUST_SAVE

    return policy


def _report_kept(ctx, op, args, kwargs) -> None:
    on_saved = _SelectiveCount.active
    if on_saved is not None and not ctx.is_recompute:
        on_saved(op(*args, **kwargs))  # on meta tensors (the planner's probe): shapes only


def matmul_flops(op, args) -> int:
    """FLOPs of a Linear's matmul (``mm`` or ``addmm``) by torch's formula, as the probe's
    OpCounter counts them (before it runs: the formula needs only the inputs' shapes)."""
    from torch.utils.flop_counter import flop_registry

    return flop_registry[getattr(op, "overloadpacket", op)](*args, out_val=None)


class _SelectiveCount:
    """Where the planner's probe is told about the outputs selective checkpointing keeps: torch
    keeps them in a cache of its own, out of sight of the saved-tensor hooks the probe counts with
    (``active``), and about the FLOPs a checkpoint's backward runs again (``recomputed(flops,
    attention_flops)``: the matmuls selective recomputes; what full checkpointing recomputes,
    :func:`full_recompute_flops`)."""

    active = None
    recomputed = None


def full_recompute_flops(forward, args: tuple, kwargs: dict, stops_early: bool) -> tuple[int, int]:
    """FLOPs, and of them attention's, that a full checkpoint's backward runs again for one call of
    ``forward``: with torch's non-reentrant checkpoint (``stops_early``), the forward's operators
    up to the last one that saves a tensor, where its recompute stops (a Llama block's last
    projection, whose output nothing saves, is not run again); with the reentrant one, all of
    them. Counted by running ``forward`` once more (on meta tensors as they are, the planner's
    probe; real ones as fake tensors, see :func:`_no_memory`), its saves marked and dropped, a
    cache in its arguments left out."""
    from atorch.auto.search.ops import OpCounter

    counter, at_last_save = OpCounter(count_traffic=False), [0, 0]

    def mark(_tensor):
        # autograd saves an operator's inputs before it runs: the FLOPs so far are those recomputed
        at_last_save[:] = counter.flops, counter.attention_flops

    kwargs = {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    with _no_memory((args, kwargs)), torch.autograd.graph.saved_tensors_hooks(mark, lambda _: None), counter:
        forward(*args, **kwargs)
    return tuple(at_last_save) if stops_early else (counter.flops, counter.attention_flops)


@contextlib.contextmanager
def _no_memory(inputs):
    """Where the block runs once more to be counted: as it is on meta tensors; on real ones (the
    search's probe on a CPU, whose memory timeline an extra forward would show) on fake tensors
    made from them, shapes without storage, out of sight of the probe's own dispatch modes (its
    weight-cast count) and with autocast's cache of casts off (it would keep a fake cast of a real
    weight for the real forward that follows)."""
    if _on_meta(inputs):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # logs an operator it cannot run, then raises
    with contextlib.ExitStack() as stack:
        stack.callback(fake_log.setLevel, fake_log.level)
        fake_log.setLevel(logging.CRITICAL)
        stack.enter_context(_disable_current_modes())
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield


def _selective_context():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(selective_policy)


def _every_other_context():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(every_other_matmul_policy())


class CheckpointedForward:
    def __init__(self, forward, use_reentrant: bool, selective: bool = False, keep_matmuls: str = "all"):
        self.forward, self.use_reentrant, self.selective = forward, use_reentrant, selective
        self.context = _every_other_context if keep_matmuls == "every_other" else _selective_context

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)  # nothing to save memory on in eval
        if not self.selective and _SelectiveCount.recomputed is not None:
            try:
                counted = full_recompute_flops(self.forward, args, kwargs, not self.use_reentrant)
            except Exception:  # noqa: BLE001 - a block fake tensors cannot run (Mixtral's grouped matmuls on a CPU)
                counted = (None, None)
            _SelectiveCount.recomputed(*counted)
        if self.use_reentrant:
            fn = functools.partial(self.forward, **kwargs) if kwargs else self.forward
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)
        if self.selective:
            return torch.utils.checkpoint.checkpoint(self.forward, *args, use_reentrant=False,
                                                     context_fn=self.context, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def resolve(model: torch.nn.Module, config: CheckpointConfig) -> CheckpointConfig:
    # once per plan (atorch plan --search resolves every candidate on the same pristine model:
    # 35% of a 70B plan on 512 ranks went to walking its modules here)
    targets = list(config.wrap_class) or list(once(("checkpoint targets", id(model)),
                                                   lambda: [class_name(c) for c in find_block_classes(model)]))
    if not targets:
        raise MethodConfigError(
            "checkpoint: the model has no repeated blocks (ModuleList of one class) to checkpoint; name the "
            f"classes with ('checkpoint', {{'wrap_class': [...]}}). Classes in the model: {class_names_in(model)}"
        )
    if not once(("checkpoint matches", id(model), tuple(targets)), lambda: bool(modules_of_classes(model, targets))):
        raise MethodConfigError(missing_class_error("checkpoint", "wrap_class", targets, model))
    return config.model_copy(update={"wrap_class": targets})


def apply_checkpoint(ctx: ModelContext, config: CheckpointConfig) -> None:
    targets = config.wrap_class  # filled by resolve()
    matched = modules_of_classes(ctx.model, targets)
    for _, module in matched:
        module.forward = CheckpointedForward(module.forward, use_reentrant=not config.no_reentrant,
                                             selective=config.selective, keep_matmuls=config.keep_matmuls)
    kept = "every other matmul's" if config.keep_matmuls == "every_other" else "matmul"
    logger.info("checkpoint: %d modules of %s checkpointed%s", len(matched), targets,
                f" (selective: {kept} and attention outputs kept)" if config.selective else "")
    # the class's forward: amp (and others) wrap the instance's in one taking **kwargs
    if "use_cache" in inspect.signature(type(ctx.model).forward).parameters:
        ctx.model.register_forward_pre_hook(_no_kv_cache_in_training, with_kwargs=True)


def _no_kv_cache_in_training(module, args, kwargs):
    """A Hugging Face model whose config says ``use_cache`` caches every layer's keys and values
    in training too, and a checkpointed layer's recompute appends them to the cache again: it grows
    by a layer's keys and values per block through backward (benchmarks/search_quality.py's
    deep-narrow Llama, 16 checkpointed blocks: a 2.4x higher activation peak). With gradients on,
    the forward runs with ``use_cache=False`` unless the caller passes it, as Hugging Face's own
    gradient checkpointing does. On meta tensors (``atorch plan``'s probe: no backward, so no
    recompute) the cache stays: without one, the model's mask code reads tensor values."""
    if torch.is_grad_enabled() and "use_cache" not in kwargs and not _on_meta((args, kwargs)):
        return args, {**kwargs, "use_cache": False}
    return None


def _on_meta(inputs) -> bool:
    return any(t.is_meta for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))


# Estimated / measured peak of checkpoint candidates, lowest seen, with a margin, where the probe
# only counts what forward saves (meta tensors: `atorch plan`): 0.69 on the Llama workloads of
# benchmarks/cost_model.py (docs/benchmarks.md). The search trusts such a candidate's estimate
# to fit only by this much; a probe on real tensors measures the backward (cost.candidate_ratio).
ESTIMATE_LOW = 0.65


# The share of a transformer's forward operators that selective checkpointing recomputes (all
# but the matmuls and attention): 299 of 332 on the 4-layer Llama of
# tests/auto/search/test_meta_activations.py; their FLOPs are negligible beside the matmuls'.
SELECTIVE_RECOMPUTED_OPS = 0.9


def cost_term(config: CheckpointConfig, cost) -> None:
    if config.selective:  # the element-wise operators run again, the matmuls do not
        cost.recomputed_op_share += SELECTIVE_RECOMPUTED_OPS
    elif cost.recomputed_flops:  # the probe counted what the recompute runs (full_recompute_flops)
        cost.recomputed_op_share += 1.0  # its operators' launches and bytes, all but a few at the end
    else:  # not counted (a cost built without the probe's counts): the blocks' whole forward again
        cost.passes += 1
    # (their saved tensors' trips through the checkpoint's hooks: StepCost.checkpointed_saves, probed)
    # Where the probe does not measure the backward (StepCost.activation_profile): the activation
    # peak is late in backward (a block recomputed while the later blocks' gradients exist), not
    # at the end of forward; measured on the Llama workloads, 87% of the gradients were alive at
    # it. Counted whole.
    cost.backward_grad_share = 1.0
    # the checkpoint's host overhead beyond the recompute, calibrated per tensor its hooks pack
    # (StepCost.checkpointed_saves, per forward: each micro-batch and pipeline stage's)
    if cost.checkpointed_saves:
        cost.charge("checkpoint", cost.checkpointed_saves * cost.op_share, per_micro_batch=True)
    cost.estimate_low = ESTIMATE_LOW if cost.estimate_low is None else min(cost.estimate_low, ESTIMATE_LOW)


register_method(
    MethodSpec(
        name="checkpoint",
        config_cls=CheckpointConfig,
        hooks={Stage.MEMORY: apply_checkpoint},
        description="activation checkpointing: recompute chosen blocks in backward to save memory",
        resolve=resolve,
        # full and selective: selective keeps more (matmul outputs) and recomputes less
        search_space=({}, {"selective": True}),
        saves_memory=True,
        memory_only=True,
        cost_term=cost_term,
    )
)
