"""The composition matrix: every pair of methods, planned in both list orders, and each pair the
planner accepts trained on gloo ranks against a serial reference written in plain PyTorch.

A *variant* is one method with one config (zero2 on each backend is three variants). A case is a
list of variants; ``plan_case`` says whether the planner refuses it, accepts it, or needs a larger
world (a method dropped for want of data-parallel ranks); ``run_cases`` trains the accepted ones
inside one spawn (spawning costs more than what runs) and records losses and compute dtypes.

The batches are padded (labels -100 on 2 to 15 of 16 positions): a case matches serial only when
every split weighs its parts by the label tokens they count (issue 51); the losses compared are
``result.last_step.loss``, the global batch's token mean that atorch reports.
"""

import importlib.util
import itertools
import math

import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import plan_strategy
from atorch.auto.strategy import parse_strategy
from atorch.errors import AtorchConfigError
from tests.helpers.models import serial_steps

HAS = {name: importlib.util.find_spec(name) is not None for name in ("deepspeed", "fairscale", "transformers")}

VARIANTS = {
    "amp_native": ("amp_native", {"dtype": "bf16"}),
    "half": ("half", {"dtype": "bf16"}),
    "checkpoint": ("checkpoint", {}),
    "checkpoint_selective": ("checkpoint", {"selective": True}),
    # torchtitan's per-op policy: every second matmul of a block recomputed too
    "checkpoint_every_other": ("checkpoint", {"selective": True, "keep_matmuls": "every_other"}),
    "gradient_accumulation": ("gradient_accumulation", {"steps": 2}),
    # aot_eager: dynamo's capture and AOT autograd, without inductor's minutes of C++ compiling.
    "native_dynamo": ("native_dynamo", {"backend": "aot_eager"}),
    # the optimizer's fused step: the same update in other kernels, against the unfused serial AdamW
    "fused_optimizer": ("fused_optimizer", {}),
    "zero1": ("zero1", {}),
    "zero1_ds": ("zero1", {"use_ds_zero": True}),
    "zero2": ("zero2", {}),
    "zero2_fairscale": ("zero2", {"not_use_fsdp": True}),
    "zero2_ds": ("zero2", {"use_ds_zero": True}),
    "fsdp": ("fsdp", {}),
    # Named pairs apply on any device (the default ones only where they help): fused RMSNorm here.
    "module_replace": ("module_replace", {"pairs": ["hf_rmsnorm"]}),
    "tensor_parallel": ("tensor_parallel", {}),
    # sequence_parallel requires tensor_parallel: its variant is the two together.
    "sequence_parallel": [("tensor_parallel", {}), ("sequence_parallel", {})],
    "pipeline_parallel": ("pipeline_parallel", {"num_microbatches": 2}),
    "mixed_parallel": ("mixed_parallel", {"num_microbatches": 2}),
    # Megatron's sequence parallelism inside the stages (tensor 2; pipeline 2 from 4 ranks on)
    "mixed_parallel_sp": ("mixed_parallel", {"num_microbatches": 2, "tensor_size": 2, "sequence_parallel": True}),
    "ds_3d_parallel": ("ds_3d_parallel", {"num_microbatches": 2}),
    "genomic_bottleneck": ("genomic_bottleneck", {"min_numel": 1024, "tile_size": 16, "lr": 1e-2}),
    # its cases train the tiny Mixtral (4 experts, top-2) instead of the Llama: see tiny_model
    "expert_parallel": ("expert_parallel", {}),
}
# Backends this machine may lack: their variants are planned but not run without them.
NEEDS = {"zero1_ds": "deepspeed", "zero2_ds": "deepspeed", "ds_3d_parallel": "deepspeed", "zero2_fairscale": "fairscale"}
# Variants whose method puts a dim to work: the case's parallel_mode gets that dim (size 2).
DIMS = {"tensor_parallel": "tensor", "sequence_parallel": "tensor", "pipeline_parallel": "pipeline",
        "ds_3d_parallel": "pipeline"}

STEPS, BATCH, LR = 4, 8, 1e-2
# AdamW (the matrix's) hardly sees a gradient off by a constant factor (its step divides by the
# gradient's own scale); SGD does: doubled gradients move the tiny Llama's fourth loss 1.5% at
# this rate, where the distributed runs match serial to 1e-7 (tests/auto/test_gradient_scale.py).
SGD_LR = 0.5


def items_of(variant: str) -> list[tuple[str, dict]]:
    value = VARIANTS[variant]
    return value if isinstance(value, list) else [value]


def methods_of(variant: str) -> set[str]:
    return {name for name, _ in items_of(variant)}


def pairs() -> list[tuple[str, str]]:
    """Every unordered pair of variants that share no method."""
    return [(a, b) for a, b in itertools.combinations(VARIANTS, 2) if not methods_of(a) & methods_of(b)]


def strategy_list(case: tuple[str, ...], world: int) -> list:
    if world == 1:
        return [item for v in case for item in items_of(v)]
    dims = sorted({DIMS[v] for v in case if v in DIMS})
    layout = [(name, 2) for name in dims]
    data = world // math.prod(size for _, size in layout) if layout else world
    parallel_mode = ("parallel_mode", {"dims": [*layout, ("data", max(data, 1))]})
    return [parallel_mode, *(item for v in case for item in items_of(v))]


def device_ctx(world: int) -> DeviceContext:
    return DeviceContext(world, world, torch.device("cpu"), None, 2**40)


def plan_case(case: tuple[str, ...], world: int) -> dict:
    """``{"outcome": "refused", "error": ...}``, ``{"outcome": "dropped", "notes": ...}`` (the
    case needs a larger world) or ``{"outcome": "accepted", "order": [...]}``."""
    try:
        planned, notes = plan_strategy(parse_strategy(strategy_list(case, world)), device_ctx(world))
    except AtorchConfigError as error:
        return {"outcome": "refused", "error": f"{type(error).__name__}: {error}"}
    wanted = set().union(*(methods_of(v) for v in case))
    dropped = [note for note in notes if "dropped" in note and note.split(":")[0] in wanted]
    if dropped:
        return {"outcome": "dropped", "notes": dropped}
    return {"outcome": "accepted", "order": planned.opt_names, "strategy": planned.to_json()}


def precision(case: tuple[str, ...]) -> str:
    """The compute dtype a case must show, and the precision of its serial reference."""
    if "half" in case:
        return "half"
    return "bf16" if "amp_native" in case else "fp32"


def reference_key(case: tuple[str, ...]) -> tuple[str, bool, bool]:
    """(precision, genomic, moe): the serial run a case is compared with."""
    return precision(case), "genomic_bottleneck" in case, "expert_parallel" in case


# --------------------------------------------------------------------------- serial references


def tiny_model(seed: int = 0, moe: bool = False):
    """The tiny Llama, or with ``moe`` the tiny Mixtral (the same vocabulary; seeded inside)."""
    from tests.helpers.hf import tiny_llama
    from tests.methods.test_tensor_parallel_moe import tiny_moe

    return tiny_moe("mixtral") if moe else tiny_llama(seed)


def dataset():
    from tests.helpers.hf import UnmaskedPadding

    # No attention mask: ds_3d_parallel's stages pass one tensor; right padding under causal
    # attention gives the same loss with or without it (tests/loss runs the mask through pipelines).
    return UnmaskedPadding()


def batches():
    data = dataset()
    return [{k: torch.stack([data[i][k] for i in range(s * BATCH, (s + 1) * BATCH)]) for k in ("input_ids", "labels")}
            for s in range(STEPS)]


def _optimizer(name: str) -> tuple:
    return (torch.optim.SGD, SGD_LR) if name == "sgd" else (torch.optim.AdamW, LR)


def serial_losses(kind: str, genomic: bool = False, moe: bool = False, lr: float | None = None,
                  optimizer: str = "adamw") -> list[float]:
    """Plain PyTorch: AdamW (or ``optimizer`` "sgd") on the whole global batch, fp32, bf16 autocast, or a bf16 model.

    With ``genomic`` the model is the g-net-generated one, so the reference is atorch's own
    genomic_bottleneck in one process (its serial correctness is tests/compression's business).
    """
    if genomic:
        case = ("genomic_bottleneck", "amp_native") if kind == "bf16" else ("genomic_bottleneck",)
        return train_case(case, 1)["losses"]
    model = tiny_model(moe=moe)
    if kind == "half":
        model = model.to(torch.bfloat16)
    optim_class, default_lr = _optimizer(optimizer)
    optim = optim_class(model.parameters(), lr=default_lr if lr is None else lr)
    return serial_steps(model, optim, batches(), torch.bfloat16 if kind == "bf16" else None)


# --------------------------------------------------------------------------- runs on the ranks


def _record_dtypes(model: torch.nn.Module) -> set:
    """Output dtypes of every leaf matmul layer that runs on this rank (Linear and its parallel kinds)."""
    seen: set = set()
    for module in model.modules():
        if type(module).__name__.endswith("Linear") and not any(True for _ in module.children()):
            module.register_forward_hook(lambda _m, _i, out: seen.add(str(out.dtype)) if torch.is_tensor(out) else None)
    return seen


def _accelerate(case: tuple[str, ...], world: int, normalization: str = "tokens", optimizer: str = "adamw"):
    from atorch.auto import auto_accelerate

    optim_class, lr = _optimizer(optimizer)
    return auto_accelerate(
        tiny_model(moe="expert_parallel" in case), optim_class, dataset(), lambda batch, out: out.loss, optim_args={"lr": lr},
        dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict",
        load_strategy=strategy_list(case, world), loss_normalization=normalization,
    )


def _next_loss(result, batch) -> float:
    """The loss of one more batch, without a step (a pipeline call runs backward too: harmless)."""
    from tests.helpers.models import global_mean

    return global_mean(result.loss_func(batch, result.model(**batch)))


def round_trip(case: tuple[str, ...], world: int, result, batch, directory: str) -> dict:
    """Save the trained job with atorch.checkpoint, load it into a fresh job of the same case:
    the next batch's loss must be the same. A backend checkpoint cannot hold is refused by name."""
    import atorch.checkpoint
    from atorch.errors import NotSupportedError

    try:
        atorch.checkpoint.save(directory, result.model, result.optim)
    except NotSupportedError as error:
        return {"refused": str(error)}
    # After the save: a DeepSpeed pipeline call also steps, from the saved state in both jobs.
    before = _next_loss(result, batch)
    _, fresh, _ = _accelerate(case, world)
    atorch.checkpoint.load(directory, fresh.model, fresh.optim)
    return {"before": before, "after": _next_loss(fresh, batch)}


def train_case(case: tuple[str, ...], world: int, checkpoint_dir: str | None = None,
               normalization: str = "tokens", optimizer: str = "adamw") -> dict:
    """Train one case through auto_accelerate with the README's loop; the global batch's losses
    (``result.last_step``) and dtypes, and with ``checkpoint_dir`` the losses around a save and load."""
    import torch.distributed as dist

    _, result, strategy = _accelerate(case, world, normalization, optimizer)
    dtypes = _record_dtypes(result.model)
    losses, it = [], iter(result.dataloader)
    for _ in range(STEPS):
        stepped = False  # a step: one batch, or gradient_accumulation's micro-batches
        while not stepped:
            batch = result.prepare_input(next(it), torch.device("cpu"))
            loss = result.loss_func(batch, result.model(**batch))
            result.backward(loss)  # the same two calls under every composition
            stepped = result.sync_gradients
            result.step()
        losses.append(result.last_step.loss)
    gathered = [sorted(dtypes)]
    if dist.is_initialized():  # pipeline stages each see their own layers
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(dtypes))
    out = {"losses": losses, "dtypes": sorted(set().union(*gathered)), "order": strategy.opt_names}
    if checkpoint_dir is not None:
        batch = result.prepare_input(next(it), torch.device("cpu"))
        out["checkpoint"] = round_trip(case, world, result, batch, f"{checkpoint_dir}/{'-'.join(case)}")
    return out


def run_cases(cases: list[tuple[str, ...]], world: int, checkpoint_dir: str | None = None,
              normalization: str = "tokens", optimizer: str = "adamw") -> dict:
    """Every case on these ranks, one after the other; a failure is recorded, not raised, so one
    broken composition does not hide the others (every rank fails the same case together)."""
    import traceback

    out = {}
    for case in cases:
        # Compiled graphs are cached per code object across cases: a case must compile its own
        # (with the dtype hooks it registers), as it would in a job of its own.
        torch._dynamo.reset()
        try:
            out[case] = train_case(case, world, checkpoint_dir, normalization, optimizer)
        except Exception:  # noqa: BLE001 - reported by the test with the case's name
            out[case] = {"error": traceback.format_exc(limit=6)}
    return out
