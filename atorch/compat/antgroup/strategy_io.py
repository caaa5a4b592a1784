"""ATorch strategies: (name, config, tunable) items, ``get_strategy`` / ``save_strategy``, and
ATorch's pickled strategy files read without running code.

An ATorch strategy file is a pickled ``atorch.auto.strategy.Strategy``. It is read by a restricted
unpickler that builds plain data only: lists, tuples, dicts, sets, str, numbers, None, torch
dtypes, and ATorch's Strategy record (its ``opt_list`` only). A class that a config names (a
block class to wrap) becomes its dotted name without being imported. Any call, any other object
and persistent ids are refused with :class:`StrategyFileError`; no code in the file runs.
"""

import functools
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from atorch.auto.strategy import FORMAT_NAME, Strategy, method_entries, parse_strategy
from atorch.compat.antgroup.distributed import atorch_dims
from atorch.compat.antgroup.strategy import Strategy as ATorchStrategy
from atorch.errors import AtorchConfigError, NotSupportedError, StrategyFileError
from atorch.utils.log import logger

_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".bin")


# torch's dtypes by name, read once: a pickle naming torch.<anything else> is never looked up on
# torch (its lazy attributes import submodules: torch._inductor took 17 s)
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

class ClassName(str):
    """A class reference read from a pickle, kept as its dotted name (never imported)."""


class _ATorchStrategy:
    """ATorch's Strategy object as the pickle holds it: only its state (``opt_list``) is kept."""


def _reconstructor(cls, base, state):
    # protocol 0/1 pickles build objects through copyreg._reconstructor: only ATorch's Strategy
    if cls is not _ATorchStrategy or base not in ("builtins.object", "__builtin__.object") or state is not None:
        raise pickle.UnpicklingError(f"refused to build {cls!r}")
    return _ATorchStrategy()


# Callables a plain-data pickle uses to build containers (protocols 0-3 write sets this way).
_CONTAINERS = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("__builtin__", "set"): set,
               ("__builtin__", "frozenset"): frozenset, ("collections", "OrderedDict"): dict}
_CALLABLE = {set, frozenset, dict, _reconstructor}


class _PlainData(pickle._Unpickler):  # the Python implementation: its opcodes can be checked one by one
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if (module, name) in (("atorch.auto.strategy", "Strategy"), ("atorch.compat.antgroup.strategy", "Strategy")):
            return _ATorchStrategy  # ATorch's pickled record, or this front's (the same state: opt_list)
        if (module, name) in (("copyreg", "_reconstructor"), ("copy_reg", "_reconstructor")):
            return _reconstructor
        if (module, name) in _CONTAINERS:
            return _CONTAINERS[(module, name)]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]  # a constant, looked up: getattr(torch, name) imports lazy submodules
        return ClassName(f"{module}.{name}")  # a name, never imported

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id")

    def _reduce(self):
        func = self.stack[-2]
        if not any(func is allowed for allowed in _CALLABLE):
            raise pickle.UnpicklingError(f"refused a call to {func!s}")
        pickle._Unpickler.load_reduce(self)

    def _newobj(self):
        if self.stack[-2] is not _ATorchStrategy:
            raise pickle.UnpicklingError(f"refused to create a {self.stack[-2]!s}")
        pickle._Unpickler.load_newobj(self)

    def _build(self):
        state, target = self.stack[-1], self.stack[-2]
        if type(target) is not _ATorchStrategy or not isinstance(state, dict):
            raise pickle.UnpicklingError(f"refused to set the state of {target!s}")
        self.stack.pop()
        target.__dict__.update(state)

    def _refuse(self):
        raise pickle.UnpicklingError("refused an opcode that plain data does not use")

    dispatch[pickle.REDUCE[0]] = _reduce
    dispatch[pickle.NEWOBJ[0]] = _newobj
    dispatch[pickle.BUILD[0]] = _build
    for _op in (pickle.NEWOBJ_EX, pickle.INST, pickle.OBJ, pickle.PERSID, pickle.BINPERSID, pickle.EXT1, pickle.EXT2,
                pickle.EXT4):
        dispatch[_op[0]] = _refuse
    del _op


def _is_pickle(data: bytes) -> bool:
    # protocol 2+ opens with PROTO; older protocols with a list/dict mark (what atorch.auto.strategy checks)
    # (protocol 0 may also open with a GLOBAL: "c<module>\n<name>\n")
    return (data[:1] == b"\x80" or data[:2] in (b"(l", b"(d", b"]q", b"}q")
            or re.match(rb"c[\w.]+\n\w+\n", data[:200]) is not None)


def read_pickled_strategy(data: bytes, source: str = "strategy bytes") -> list:
    """The ``opt_list`` of an ATorch pickled Strategy (or a pickled list of items), as plain data;
    of a pickled atorch Strategy, its method entries (``{"name": ..., "config": ...}``)."""
    obj = _plain_data(data, source)
    if _is_atorch_state(obj):
        return method_entries(vars(obj), source)[0]
    return _opt_list(obj, source)


def _is_atorch_state(obj) -> bool:
    # atorch's own Strategy pickles the dict that Strategy.save() writes (Strategy.__getstate__);
    # ATorch's, under the same class path, holds opt_list
    return isinstance(obj, _ATorchStrategy) and vars(obj).get("format") == FORMAT_NAME


def _plain_data(data: bytes, source: str):
    try:
        obj = _PlainData(io.BytesIO(data)).load()
    except Exception as error:  # noqa: BLE001 - a hostile or corrupt file can raise anything
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise StrategyFileError(
            f"{source} looks like a pickle that holds more than a plain ATorch strategy ({first}). atorch never "
            "runs code from a strategy file: save strategies with Strategy.save() (JSON) and load that file "
            "instead.") from None
    return obj


def _opt_list(obj, source: str) -> list:
    if isinstance(obj, _ATorchStrategy):
        obj = getattr(obj, "opt_list", None)
    if not isinstance(obj, list):
        raise StrategyFileError(f"{source} holds a {type(obj).__name__}, not an ATorch strategy (a list of "
                                "(name, config, tunable) items)")
    return obj


# ----- items -> atorch's (name, config)

def _wrap_policy(policy) -> dict:
    """FSDP1's auto_wrap_policy forms as FSDP2 unit choices (atorch_wrap_cls / size)."""
    if isinstance(policy, (set, frozenset, list, tuple)):
        return {"atorch_wrap_cls": list(policy)}
    if isinstance(policy, functools.partial):
        name = getattr(policy.func, "__name__", "")
        if name == "transformer_auto_wrap_policy" and "transformer_layer_cls" in policy.keywords:
            return {"atorch_wrap_cls": list(policy.keywords["transformer_layer_cls"])}
        if name == "size_based_auto_wrap_policy":
            return {"atorch_size_based_min_num_params": int(policy.keywords.get("min_num_params", int(1e8)))}
    classes = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
    if classes is not None:
        return {"atorch_wrap_cls": list(classes)}
    raise NotSupportedError(
        f"fsdp auto_wrap_policy={policy!r}: only transformer_auto_wrap_policy, size_based_auto_wrap_policy (as "
        "functools.partial), ModuleWrapPolicy or a set of classes map to FSDP2 units; name the classes with "
        "atorch_wrap_cls (or atorch_size_based_min_num_params) instead")


def fsdp_config(config: Any) -> Any:
    """ATorch's documented FSDP1 keys mapped to FSDP2, or refused with the reason."""
    if not isinstance(config, dict):
        return config
    config = dict(config)
    if config.pop("limit_all_gathers", True) is False:
        raise NotSupportedError(
            "fsdp limit_all_gathers=False: FSDP2 has no unlimited mode (it always waits for a unit's gathered "
            "parameters to be freed before gathering more); remove the key")
    if config.pop("use_orig_params", True) is False:
        raise NotSupportedError(
            "fsdp use_orig_params=False: FSDP2 has no flat parameters (it keeps each original parameter, "
            "sharded as a DTensor); remove the key")
    strategy = config.pop("sharding_strategy", None)
    if strategy is not None:
        name = str(getattr(strategy, "name", strategy)).rsplit(".", 1)[-1].upper()
        if name == "SHARD_GRAD_OP":
            config.setdefault("reshard_after_forward", False)  # ZeRO-2: keep parameters gathered for backward
        elif name != "FULL_SHARD":
            raise NotSupportedError(
                f"fsdp sharding_strategy={name}: FSDP2 here shards over the data ranks as FULL_SHARD or "
                "SHARD_GRAD_OP; for NO_SHARD use parallel_mode (DDP), for hybrid sharding a ('data', 'zero') "
                "parallel_mode with fsdp")
    if "auto_wrap_policy" in config:
        config.update(_wrap_policy(config.pop("auto_wrap_policy")))
    return config


def _parallel_mode_config(config: Any) -> Any:
    if isinstance(config, (list, tuple)) and len(config) == 3:
        if config[2]:
            raise NotSupportedError("parallel_mode with support_multi_parallel_instance=True: several parallel "
                                    "instances in one job are not ported; make the sizes multiply to the world size")
        config = config[:2]
    if isinstance(config, (list, tuple)) and len(config) == 2 and isinstance(config[0], (list, tuple)):
        return (atorch_dims(config[0]), config[1])
    return config


def _sequence_parallel_config(config: Any) -> Any:
    if isinstance(config, dict) and "sp_size" in config:
        raise NotSupportedError(
            f"sequence_parallel with sp_size={config['sp_size']}: ATorch's is Ulysses-style (all-to-all over the "
            "sequence around attention) and is not a strategy method here; wrap your attention in "
            "atorch.compat.antgroup.sequence.UlyssesAttention (after create_sequence_parallel_group(sp_size)), or "
            "use atorch's Megatron-style sequence_parallel method (the sequence split between tensor-parallel "
            "blocks): ('parallel_mode', ([('tensor', N), ...], None)), 'tensor_parallel', 'sequence_parallel'")
    return config


_CONVERT = {"parallel_mode": _parallel_mode_config, "fsdp": fsdp_config, "sequence_parallel": _sequence_parallel_config}


def atorch_items(items) -> list[tuple[str, Any]]:
    """ATorch's strategy items (names, ``(name, config)``, ``(name, config, tunable)``) as atorch's.

    ``tunable``: atorch fills what a config leaves unset for the model at hand (block classes,
    dims to the world size); it does not dry-run alternative configs of one method (that is
    ``finetune_strategy=True``), so a tunable item is applied with its config resolved.
    """
    out = []
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 3 and isinstance(item[0], str):
            item = item[:2]  # tunable: see above
        if isinstance(item, str):
            name, config = item, None
        elif isinstance(item, (tuple, list)) and len(item) in (1, 2) and isinstance(item[0], str):
            name, config = item[0], item[1] if len(item) == 2 else None
        else:
            raise StrategyFileError(f"cannot read strategy item {item!r}; write a name, (name, config) or "
                                    "(name, config, tunable)")
        out.append((name, _CONVERT.get(name, lambda c: c)(config)))
    return out


def to_strategy(load_strategy: Any) -> Strategy:
    """Any ATorch ``load_strategy`` form as atorch's Strategy (raises on a bad one)."""
    if isinstance(load_strategy, Strategy):
        return Strategy(load_strategy.items(), load_strategy.description)
    if isinstance(load_strategy, ATorchStrategy):
        return load_strategy.to_atorch()
    if isinstance(load_strategy, (list, tuple)):
        return Strategy(atorch_items(load_strategy))
    if isinstance(load_strategy, bytes):
        if _is_pickle(load_strategy):
            return _pickled(load_strategy, "strategy bytes")
        return parse_strategy(load_strategy)
    if isinstance(load_strategy, (str, os.PathLike)):
        path = Path(load_strategy)
        if isinstance(load_strategy, str) and load_strategy.lstrip().startswith(("{", "[")):
            return parse_strategy(load_strategy)
        if path.is_file():
            data = path.read_bytes()
            if path.suffix.lower() in _PICKLE_SUFFIXES or _is_pickle(data):
                return _pickled(data, f"strategy file {str(path)!r}")
        return parse_strategy(path)
    if getattr(load_strategy, "opt_list", None) is not None:  # an ATorch Strategy object in memory
        return Strategy(atorch_items(load_strategy.opt_list))
    return parse_strategy(load_strategy)


def _pickled(data: bytes, source: str) -> Strategy:
    """A pickled strategy read as plain data: atorch's own Strategy as it was saved, ATorch's
    (name, config, tunable) items through :func:`atorch_items`."""
    obj = _plain_data(data, source)
    if _is_atorch_state(obj):
        return Strategy.from_data(vars(obj), source)
    return Strategy(atorch_items(_opt_list(obj, source)))


def get_strategy(load_strategy: Any) -> tuple[bool, Strategy | None]:
    """ATorch's ``get_strategy``: ``(True, strategy)``, or ``(False, None)`` with the reason logged.

    Takes a file path (JSON, YAML, or an ATorch pickle read as plain data), bytes, a Strategy, or
    a list of names, ``(name, config)`` and ``(name, config, tunable)`` items.
    """
    try:
        return True, to_strategy(load_strategy)
    except (AtorchConfigError, OSError) as error:
        logger.error("get_strategy: %s", error)
        return False, None


def save_strategy(strategy: Any, filename: str | os.PathLike) -> None:
    """ATorch's ``save_strategy``, written as JSON (ATorch pickled it; atorch never writes pickles,
    so the file is safe to share and :func:`get_strategy` reads it back)."""
    to_strategy(strategy).save(filename)
