"""Model states per rank (weights, gradients, optimizer state) under stated assumptions.

Two accountings, because the same model reads differently in each and a user comparing figures
must know which one they hold:

- ``atorch``: what atorch's methods hold for a model kept in ``dtype`` (the cost model of
  atorch/auto/search/cost.py): weights and gradients in ``dtype``, the optimizer's state in the
  parameters' dtype (AdamW: 2 states), autocast's 16-bit copies under ``amp_native``, FSDP's root unit and
  two other units gathered at a time, DDP's gradient buckets.
- ``deepspeed``: DeepSpeed's mixed-precision accounting (``estimate_zero2_model_states_mem_needs``,
  ``estimate_zero3_model_states_mem_needs``): 16-bit weights (2 B) and gradients (2 B), fp32
  master weights (4 B), fp32 gradients (4 B) and fp32 optimizer state (AdamW: 8 B); under ZeRO-3
  the 16-bit gradients are freed after the reduce-scatter, and the largest module's 16-bit
  weights and gradients are gathered (4 B per parameter of it).

Example::

    assumptions = Assumptions.make("deepspeed", "bf16", "adamw")
    model_states(model, "zero2", 8, assumptions)   # {'params': ..., 'grads': ..., ...}
"""

from dataclasses import dataclass

import torch

from atorch.auto.config_types import dtype_name, to_dtype

ACCOUNTINGS = ("atorch", "deepspeed")
SHARDINGS = (None, "zero1", "zero2", "fsdp")


def optimizer_class(name: str) -> type:
    """``adamw`` -> ``torch.optim.AdamW`` (any torch.optim class, by name, any case)."""
    classes = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
               if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
               and n != "Optimizer"}
    try:
        return classes[name.lower()]
    except KeyError:
        raise ValueError(f"--optimizer {name!r} is not a torch.optim optimizer; one of {sorted(classes)}") from None


@dataclass(frozen=True)
class Assumptions:
    accounting: str
    dtype: torch.dtype  # atorch: the model's dtype; deepspeed: the 16-bit compute dtype
    optimizer: str
    state_factor: float  # optimizer state per parameter, in parameters (AdamW: 2)

    @classmethod
    def make(cls, accounting: str = "atorch", dtype=None, optimizer: str = "AdamW") -> "Assumptions":
        from atorch.auto.search.cost import optimizer_state_factor

        if accounting not in ACCOUNTINGS:
            raise ValueError(f"accounting {accounting!r} is not one of {ACCOUNTINGS}")
        dtype = to_dtype(dtype if dtype is not None else ("float32" if accounting == "atorch" else "bfloat16"))
        if accounting == "deepspeed" and dtype.itemsize != 2:
            raise ValueError("DeepSpeed's accounting is for mixed precision: pass --dtype bf16 or fp16")
        optim_cls = optimizer_class(optimizer)
        return cls(accounting, dtype, optim_cls.__name__, optimizer_state_factor(optim_cls, {}))

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes per parameter of each model state before sharding."""
        low = self.dtype.itemsize
        if self.accounting == "atorch":
            return {"weights": low, "gradients": low, "optimizer state": self.state_factor * low}
        return {"weights": low, "gradients": low + 4, "optimizer state": 4 + self.state_factor * 4}

    def describe(self) -> list[str]:
        """The assumptions as lines a person can check."""
        per = self.bytes_per_param()
        name = dtype_name(self.dtype)
        if self.accounting == "atorch":
            return [
                "accounting: atorch (what atorch's methods hold for a model kept in this dtype)",
                f"  weights          {per['weights']:g} B/param ({name})",
                f"  gradients        {per['gradients']:g} B/param ({name})",
                f"  optimizer state  {per['optimizer state']:g} B/param ({self.optimizer}: {self.state_factor:g} "
                f"states x {self.dtype.itemsize} B)",
                "  amp_native adds a 2 B/param 16-bit copy of the weights (not under zero2/fsdp, which cast "
                "the gathered units); fsdp keeps its root unit (embedding, norm, head) and its 2 largest units "
                "gathered, and in backward holds their gradients whole",
            ]
        return [
            "accounting: deepspeed (mixed precision, as DeepSpeed's estimate_zero2/zero3_model_states_mem_needs)",
            f"  weights          {per['weights']:g} B/param ({name})",
            f"  gradients        {per['gradients']:g} B/param ({name} 2 + fp32 4; fsdp keeps only the fp32 4)",
            f"  optimizer state  {per['optimizer state']:g} B/param (fp32 master 4 + {self.optimizer} "
            f"{self.state_factor:g} x fp32 4)",
            "  fsdp gathers the largest module's 16-bit weights and gradients (4 B/param of it)",
        ]


def model_states(model: torch.nn.Module, sharding: str | None, world_size: int, assumptions: Assumptions) -> dict:
    """Bytes per rank of ``params``, ``grads``, ``optim_state``, ``gathered`` and (atorch's
    accounting: DDP's gradient buckets) ``buckets`` for ``model`` data parallel over
    ``world_size`` ranks with ``sharding`` (None, zero1, zero2 or fsdp): the terms the
    ``--batch-size`` table adds activations to."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r} is not one of {SHARDINGS}")
    if assumptions.accounting == "atorch":
        return _atorch_states(model, sharding, world_size, assumptions)
    per = assumptions.bytes_per_param()
    total = sum(p.numel() for p in model.parameters())
    n = world_size
    weights = total * per["weights"] / (n if sharding == "fsdp" else 1)
    if sharding == "fsdp":
        grads = total * 4 / n
    elif sharding == "zero2":
        grads = total * per["gradients"] / n
    elif sharding == "zero1":
        grads = total * (per["gradients"] - 4) + total * 4 / n
    else:
        grads = total * per["gradients"]
    optim = total * per["optimizer state"] / (n if sharding else 1)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    gathered = 4 * largest if sharding == "fsdp" else 0
    return {"params": int(weights), "grads": int(grads), "optim_state": int(optim), "gathered": int(gathered)}


def _atorch_states(model, sharding, world_size, assumptions) -> dict:
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search.cost import estimate_memory
    from atorch.auto.strategy import Strategy

    if next(model.parameters()).dtype != assumptions.dtype:
        model = model.to(assumptions.dtype)
    strategy = resolve_strategy(model, Strategy(["parallel_mode", sharding] if sharding else ["parallel_mode"]))
    est = estimate_memory(model, strategy, world_size, assumptions.state_factor, 0)
    return {"params": est.params, "grads": est.grads, "optim_state": est.optim_state, "gathered": est.gathered,
            "buckets": est.buckets}
