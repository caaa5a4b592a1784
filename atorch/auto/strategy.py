"""Strategy: an ordered list of methods with validated configs that people can read and share.

Strategies are stored as JSON (YAML is accepted on load). Pickle is refused and never unpickled:
strategy files travel between people, and unpickling a shared file runs whatever code it holds.
A pickled Strategy (``pickle.dumps(strategy)``, as ATorch code does) holds the plain data that
``save`` writes; ``atorch.compat.antgroup.get_strategy`` reads it with a restricted unpickler.
"""

import json
import os
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from atorch.auto.config_types import MethodConfig
from atorch.auto.registry import get_method
from atorch.errors import MethodConfigError, StrategyFileError
from atorch.utils.files import write_text_atomic
from atorch.utils.log import logger

FORMAT_NAME = "atorch-strategy"
FORMAT_VERSION = 1
_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".bin")


def _config_error(name: str, error: ValidationError) -> MethodConfigError:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "config"
        if item["type"] == "extra_forbidden":
            fields = ", ".join(get_method(name).config_cls.model_fields) or "none"
            problems.append(f"unknown field {where!r} (fields of {name}: {fields})")
        else:
            problems.append(f"{where}: {item['msg']}")
    return MethodConfigError(f"invalid config for method {name!r}: " + "; ".join(problems))


def make_config(name: str, raw: Any = None) -> MethodConfig:
    """Validate ``raw`` (None, a dict, a config object or an ATorch-style shorthand) for ``name``."""
    config_cls = get_method(name).config_cls
    if isinstance(raw, config_cls):
        return raw.model_copy(deep=True)
    if isinstance(raw, MethodConfig):
        raise MethodConfigError(f"method {name!r} got a config of {type(raw).__name__}; pass a {config_cls.__name__}")
    try:
        return config_cls.model_validate({} if raw is None else raw)
    except ValidationError as error:
        raise _config_error(name, error) from None


def _split_item(item: Any) -> tuple[str, Any]:
    if isinstance(item, str):
        return item, None
    if isinstance(item, dict) and "name" in item:
        extra = set(item) - {"name", "config"}
        if extra:
            raise StrategyFileError(f"method entry {item!r} has unknown keys {sorted(extra)}; use 'name' and 'config'")
        return item["name"], item.get("config")
    if isinstance(item, (tuple, list)) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[2], bool):
        # ATorch's (name, config, tunable): atorch fills what a config leaves unset for the model
        # at hand and does not dry-run alternative configs of one method, so tunable is not kept.
        item = item[:2]
    if isinstance(item, (tuple, list)) and len(item) in (1, 2) and isinstance(item[0], str):
        return item[0], item[1] if len(item) == 2 else None
    raise StrategyFileError(
        f"cannot read strategy entry {item!r}; write a method name, a (name, config) pair, "
        "(name, config, tunable) with tunable True or False, or {'name': ..., 'config': ...}"
    )


class MethodNames(list):
    """A strategy's method names: a list, and also callable, since ATorch code calls
    ``strategy.opt_names()`` (a method in ATorch) where atorch reads ``strategy.opt_names``.

    Example::

        names = Strategy(["parallel_mode", "amp_native"]).opt_names
        names == names() == ["parallel_mode", "amp_native"]   # True
    """

    def __call__(self) -> list[str]:
        return list(self)


class Strategy:
    """An ordered list of ``(method name, config)``.

    Example::

        s = Strategy(["parallel_mode", ("amp_native", {"dtype": "bf16"})])
        s.opt_names            # ['parallel_mode', 'amp_native'] (ATorch's s.opt_names() works too)
        s.get("amp_native")    # AmpNativeConfig(dtype=torch.bfloat16, ...)
        Strategy.from_json(s.to_json()) == s   # True
    """

    def __init__(self, methods: Iterable[Any] = (), description: str | None = None):
        self._methods: list[tuple[str, MethodConfig]] = []
        self.description = description  # what the strategy is for (ready files: which models); not compared
        for item in methods:
            name, raw = _split_item(item)
            if name in self.opt_names:
                raise MethodConfigError(f"method {name!r} appears twice in the strategy; keep one entry")
            self._methods.append((name, make_config(name, raw)))

    # ----- reading
    @property
    def opt_names(self) -> MethodNames:
        return MethodNames(name for name, _ in self._methods)

    def get_parallel_mode(self) -> tuple[bool, tuple | None]:
        """ATorch's ``get_parallel_mode()``: ``(True, (dims, rank_order))`` with parallel_mode's
        ``[(name, size), ...]`` in ATorch's dim names ("tensor" is ATorch's "model", "pipeline" its
        "pipe": ATorch code that looks for "model" must find it), ``(True, None)`` for a
        parallel_mode with no config, ``(False, None)`` without one.

        Example::

            Strategy([("parallel_mode", ([("tensor", 2), ("data", 2)], None))]).get_parallel_mode()
            # (True, ([('model', 2), ('data', 2)], None))
        """
        config = self.get("parallel_mode")
        if config is None:
            return False, None
        if config.dims is None and config.rank_order is None:
            return True, None
        upstream_names = {"tensor": "model", "pipeline": "pipe"}  # ATorch, upstream
        dims = None if config.dims is None else [(upstream_names.get(name, name), size) for name, size in config.dims]
        return True, (dims, None if config.rank_order is None else list(config.rank_order))

    def get(self, name: str) -> MethodConfig | None:
        """The config of ``name``, or ``None`` when the strategy does not contain it."""
        for method, config in self._methods:
            if method == name:
                return config
        return None

    def items(self) -> list[tuple[str, MethodConfig]]:
        return list(self._methods)

    def __iter__(self) -> Iterator[tuple[str, MethodConfig]]:
        return iter(self.items())

    def __len__(self) -> int:
        return len(self._methods)

    def __contains__(self, name: object) -> bool:
        return name in self.opt_names

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._methods == other._methods

    def __repr__(self) -> str:
        return f"Strategy({[(name, config.model_dump(mode='json')) for name, config in self._methods]})"

    # ----- pickling: a pickle holds what save() writes (plain data, read by the restricted
    # unpickler of atorch.compat.antgroup.get_strategy); copies keep the configs as they are.
    def __getstate__(self) -> dict:
        dropped = [f"{name}.{field}" for name, config in self._methods
                   for field, info in type(config).model_fields.items()
                   if info.exclude and getattr(config, field) is not None]
        if dropped:
            logger.warning("a pickled Strategy holds what save() writes, without %s (code-only settings): "
                           "set them in the code that unpickles it", ", ".join(dropped))
        return self.to_dict()

    def __setstate__(self, state: dict) -> None:
        if "opt_list" in state:
            raise StrategyFileError("this pickle is an ATorch strategy; read it with "
                                    "atorch.compat.antgroup.get_strategy (plain data only, no code runs)")
        data, description = method_entries(state, "pickled strategy")
        self.__init__(data, description)

    def __copy__(self) -> "Strategy":
        return Strategy(self._methods, self.description)

    def __deepcopy__(self, memo) -> "Strategy":
        return Strategy(self._methods, self.description)

    def convert_strategy_to_easydl_format(self) -> list:
        """ATorch's EasyDL form: ``[(name, pickled config, tunable)]``, each config pickled as the
        plain data (dicts, lists, str, numbers) that ``save()`` writes."""
        return [(name, pickle.dumps(config.model_dump(mode="json")), False) for name, config in self._methods]

    def __str__(self) -> str:
        if not self._methods:
            return "Strategy: no methods (plain training)"
        width = max(len(name) for name in self.opt_names)
        lines = [f"Strategy ({len(self)} method{'s' if len(self) > 1 else ''}):"]
        if self.description:
            lines.append(f"  {self.description}")
        for index, (name, config) in enumerate(self._methods, 1):
            lines.append(f"  {index}. {name.ljust(width)}  {config.summary()}")
        return "\n".join(lines)

    # ----- changing (each returns a new Strategy)
    def replace(self, name: str, config: Any) -> "Strategy":
        return Strategy([(n, make_config(n, config) if n == name else c) for n, c in self._methods], self.description)

    def without(self, name: str) -> "Strategy":
        return Strategy([(n, c) for n, c in self._methods if n != name], self.description)

    def with_method(self, name: str, config: Any = None, first: bool = False) -> "Strategy":
        entry = [(name, config)]
        return Strategy(entry + self.items() if first else self.items() + entry, self.description)

    # ----- JSON
    def to_dict(self) -> dict:
        data = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
        if self.description:
            data["description"] = self.description
        data["methods"] = [{"name": n, "config": c.model_dump(mode="json")} for n, c in self._methods]
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_data(cls, data: Any, source: str = "strategy") -> "Strategy":
        """From parsed JSON/YAML: the ``to_dict`` form, or a bare list of methods."""
        data, description = method_entries(data, source)
        return cls(data, description)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "strategy text") -> "Strategy":
        text = _decode(text, source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise StrategyFileError(f"{source} is not valid JSON: {error}") from None
        except RecursionError:
            raise StrategyFileError(f"{source} nests its JSON too deep for a strategy; a strategy is a list of "
                                    "methods, each with a flat config") from None
        return cls.from_data(data, source)

    # ----- files
    def save(self, path: str | os.PathLike) -> None:
        """Write the strategy as JSON, atomically: a crash never leaves half a file, and every rank
        of a job may save to the same path at once (each writes its own temporary file)."""
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Strategy":
        """Read a JSON or YAML strategy file; pickled files are refused."""
        return cls.from_data(read_strategy_file(path), f"strategy file {str(path)!r}")


def read_strategy_file(path: str | os.PathLike) -> Any:
    """The parsed JSON or YAML of a strategy file, not yet validated; pickles are refused."""
    path = Path(path)
    if not path.is_file():
        raise StrategyFileError(f"strategy file {str(path)!r} does not exist (or is not a file)")
    source = f"strategy file {str(path)!r}"
    raw = path.read_bytes()
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        _refuse_pickle(source)
    text = _decode(raw, source)
    if path.suffix.lower() in (".yaml", ".yml"):
        return _load_yaml(text, source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise StrategyFileError(f"{source} is not valid JSON: {error}") from None
    except RecursionError:
        raise StrategyFileError(f"{source} nests its JSON too deep for a strategy; a strategy is a list of "
                                "methods, each with a flat config") from None


def _decode(raw: str | bytes, source: str) -> str:
    if isinstance(raw, str):
        return raw
    if raw[:1] == b"\x80" or raw[:2] in (b"(l", b"(d", b"]q", b"}q"):
        _refuse_pickle(source)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        _refuse_pickle(source)


def _refuse_pickle(source: str) -> None:
    raise StrategyFileError(
        f"{source} looks like a pickle. atorch never unpickles strategies: loading a pickle runs any "
        "code inside it. Save strategies with Strategy.save() (JSON) and load that file instead."
    )


def _load_yaml(text: str, source: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise StrategyFileError(f"{source} is YAML but PyYAML is not installed; pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise StrategyFileError(f"{source} is not valid YAML: {error}") from None


def method_entries(data: Any, source: str = "strategy") -> tuple[list, str | None]:
    """The method entries and the description of parsed strategy JSON/YAML, not yet validated
    (``atorch validate`` checks each entry on its own, to report every problem at once)."""
    description = None
    if isinstance(data, dict):
        unknown = set(data) - {"format", "version", "description", "methods"}
        if unknown:
            raise StrategyFileError(
                f"{source}: unknown top-level keys {sorted(unknown)}; expected 'methods' (and 'description')")
        description = data.get("description")
        if description is not None and not isinstance(description, str):
            raise StrategyFileError(f"{source}: 'description' must be text")
        if data.get("format", FORMAT_NAME) != FORMAT_NAME:
            raise StrategyFileError(f"{source}: format is {data['format']!r}, expected {FORMAT_NAME!r}")
        version = data.get("version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise StrategyFileError(f"{source}: 'version' must be a positive whole number (this atorch writes "
                                    f"{FORMAT_VERSION}), got {version!r}")
        if version > FORMAT_VERSION:
            raise StrategyFileError(
                f"{source}: written by a newer atorch (format version {data['version']}); upgrade atorch"
            )
        data = data.get("methods", [])
    if not isinstance(data, list):
        raise StrategyFileError(f"{source}: expected a list of methods or {{'methods': [...]}}, got {type(data).__name__}")
    return data, description


def parse_strategy(value: Any) -> Strategy:
    """Read any ``load_strategy`` form: Strategy, list, JSON text (str/bytes) or a file path."""
    if isinstance(value, Strategy):
        return Strategy(value.items(), value.description)
    if isinstance(value, (list, tuple)):
        return Strategy(value)
    if isinstance(value, bytes):
        return Strategy.from_json(value, "strategy bytes")
    if isinstance(value, os.PathLike):
        return Strategy.load(value)
    if isinstance(value, str):
        if value.lstrip().startswith(("{", "[")):
            return Strategy.from_json(value)
        return Strategy.load(value)
    raise StrategyFileError(
        f"load_strategy of type {type(value).__name__} is not understood; pass a Strategy, a list of "
        "methods, JSON text, or the path of a strategy file"
    )
