"""Which DeepSpeed settings a strategy may carry: those that change training, never files or services.

A strategy file is something people share, and the search cache is read back like one; the
``ds_config`` of ``zero1``/``zero2``/``ds_3d_parallel`` goes to ``deepspeed.initialize`` as it is.
DeepSpeed's config also opens files and services: ``tensorboard.output_path``,
``csv_monitor.output_path``, ``flops_profiler.output_file``, ``wandb`` (an upload), ``comet``,
``comms_logger``, ``autotuning`` (result and experiment folders), ``nebula`` (checkpoint paths),
``checkpoint``, ``data_efficiency`` (index files), ``zero_optimization.offload_*.nvme_path``
(swap files). So a strategy's ``ds_config`` is checked against :data:`ALLOWED_KEYS`, and inside
those sections no key may name a path or a file (:data:`PATH_WORDS`).

A job that wants DeepSpeed to write (a TensorBoard log, a profile) says so in its own code, where
the path is the job's choice and never comes from a file::

    from atorch.sharding.deepspeed_config import TrustedDsConfig

    outputs = TrustedDsConfig({"tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "bert"}})
    atorch.auto_accelerate(model, ..., load_strategy=[
        "parallel_mode", ("zero2", {"use_ds_zero": True, "trusted_ds_config": outputs})])

``trusted_ds_config`` takes only a :class:`TrustedDsConfig` object, which JSON cannot make; it is
merged last and is never written into a saved strategy (``Strategy.save``, the search cache).
"""

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainValidator

# Top-level keys of a strategy's ds_config: precision, batch, clipping, ZeRO, activation
# checkpointing, the pipeline engine's options and console printing. Each changes how DeepSpeed
# trains (or prints to the console); none opens a file, a socket or a subprocess (DeepSpeed 0.19).
ALLOWED_KEYS = (
    "activation_checkpointing", "amp", "bf16", "communication_data_type", "data_types", "disable_allgather",
    "fp16", "gradient_accumulation_steps", "gradient_clipping", "gradient_predivide_factor", "memory_breakdown",
    "pipeline", "prescale_gradients", "seq_parallel_communication_data_type", "sparse_gradients", "steps_per_print",
    "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu", "wall_clock_breakdown",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
)
# Words (between underscores) that mark a nested key as a place on disk
# (zero_optimization.offload_param.nvme_path, ...); "profile" is not one.
PATH_WORDS = ("path", "file", "dir", "folder", "output")


class TrustedDsConfig(dict):
    """DeepSpeed settings the job's own code passes (any key, output paths included).

    Only code can make one: a strategy file, JSON text or the search cache cannot, so a shared
    file never decides where DeepSpeed writes. Pass it as ``trusted_ds_config`` of ``zero1``,
    ``zero2`` or ``ds_3d_parallel``; it is not saved with the strategy.
    """

    def __repr__(self) -> str:
        return f"TrustedDsConfig({dict.__repr__(self)})"


def refused_keys(config: dict, prefix: str = "") -> list[str]:
    """The dotted keys of ``config`` a strategy may not carry (empty when it is fine)."""
    refused = []
    for key, value in config.items():
        where = f"{prefix}{key}"
        if not isinstance(key, str):
            refused.append(repr(key))
        elif not prefix and key not in ALLOWED_KEYS:
            refused.append(where)
        elif prefix and any(word in PATH_WORDS for word in key.lower().split("_")):
            refused.append(where)
        elif isinstance(value, dict):
            refused += refused_keys(value, where + ".")
    return refused


# DeepSpeed's own settings nest 3 levels at most (zero_optimization.offload_param.device); a
# strategy file nesting thousands (fuzzed) ran out of recursion while it was read or saved.
MAX_DEPTH = 16


def nesting_depth(value: Any, limit: int = MAX_DEPTH + 1) -> int:
    """How deep dicts and lists nest in ``value`` (a plain value is 0), counted without recursion
    and only up to ``limit``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)) and depth < limit:
            deepest = max(deepest, depth + 1)
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def check_ds_config(config: Any) -> Any:
    """``config`` when a strategy may carry it; ValueError naming the refused keys otherwise
    (a pydantic validator: the method's config error names the method and the field)."""
    if config is None or isinstance(config, TrustedDsConfig) or not isinstance(config, dict):
        if isinstance(config, TrustedDsConfig):
            raise ValueError("a TrustedDsConfig goes in trusted_ds_config, not ds_config")
        return config  # pydantic's type check says what is wrong with a non-dict
    depth = nesting_depth(config)
    if depth > MAX_DEPTH:
        raise ValueError(f"ds_config nests more than {MAX_DEPTH} levels deep; DeepSpeed's own settings nest 3 at "
                         "most (zero_optimization.offload_param.device)")
    refused = refused_keys(config)
    if refused:
        raise ValueError(
            f"ds_config keys {refused} are refused in a strategy: they make DeepSpeed write files or start services, "
            f"and strategy files are shared. A strategy's ds_config may hold {list(ALLOWED_KEYS)} (no path or file "
            "names inside them); pass output settings from your code as trusted_ds_config=TrustedDsConfig({...}) "
            "(atorch.sharding.deepspeed_config)")
    return config


def check_trusted(value: Any) -> Any:
    """``trusted_ds_config`` takes a :class:`TrustedDsConfig` made in code, never plain data."""
    if value is None or isinstance(value, TrustedDsConfig):
        return value
    raise ValueError(
        f"trusted_ds_config takes a TrustedDsConfig made in your code (got a {type(value).__name__}): DeepSpeed's "
        "output settings never come from a strategy file; write trusted_ds_config=TrustedDsConfig({...}) "
        "(from atorch.sharding.deepspeed_config import TrustedDsConfig)")


def merged(config) -> dict | None:
    """The ds_config DeepSpeed gets from a method config: ``ds_config``, then ``trusted_ds_config`` over it."""
    from atorch.sharding.deepspeed import _merge

    if config.trusted_ds_config is None:
        return config.ds_config
    return _merge(config.ds_config or {}, dict(config.trusted_ds_config))


# The two fields of zero1, zero2 and ds_3d_parallel.
StrategyDsConfig = Annotated[dict[str, Any] | None, BeforeValidator(check_ds_config)]
TrustedField = Annotated[TrustedDsConfig | None, PlainValidator(check_trusted)]
TRUSTED_DESCRIPTION = ("DeepSpeed settings from your code, any key (output paths included): a "
                       "TrustedDsConfig object, merged last, never saved with the strategy")
