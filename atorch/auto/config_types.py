"""Field types shared by method configs: dtypes and module classes that serialize to plain JSON.

A dtype is held as a ``torch.dtype`` and written as its name (``"bfloat16"``); the short forms
people type (``"bf16"``, ``"fp16"``, ``"torch.float16"``) are accepted. A module class is held as
its qualified name (``"transformers.models.llama.modeling_llama.LlamaDecoderLayer"``), so a
config built from a class and one read back from JSON compare equal; a bare class name
(``"LlamaDecoderLayer"``) also matches.
"""

from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, model_serializer

_DTYPE_ALIASES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def to_dtype(value: Any) -> torch.dtype:
    """Turn a ``torch.dtype`` or one of its names into a ``torch.dtype``."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    raise ValueError(f"{value!r} is not a dtype; use one of {sorted(_DTYPE_ALIASES)} or a torch.dtype")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def class_name(value: Any) -> str:
    """The qualified name of a class, or a given name unchanged."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{value!r} is neither a class nor a class name")


def class_matches(cls: type, name: str) -> bool:
    """True when ``cls`` is the class that ``name`` (qualified or bare) refers to."""
    return name in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__, cls.__name__)


def to_half_dtype(value: Any) -> torch.dtype:
    dtype = to_dtype(value)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"needs float16 or bfloat16, not {dtype_name(dtype)}")
    return dtype


def bf16_unsupported(device_ctx: Any, dtype: torch.dtype) -> str | None:
    """Why this device cannot compute in ``dtype``, or None (for a method's ``unsupported``)."""
    capability = getattr(device_ctx, "capability", None)
    if device_ctx.device_type == "cuda" and dtype == torch.bfloat16 and capability is not None and capability < (8, 0):
        return f"bfloat16 needs compute capability 8.0 or newer; this GPU has {capability[0]}.{capability[1]}"
    return None


DType = Annotated[torch.dtype, BeforeValidator(to_dtype), PlainSerializer(dtype_name, return_type=str)]
# float16 or bfloat16 only (mixed and half precision).
HalfDType = Annotated[torch.dtype, BeforeValidator(to_half_dtype), PlainSerializer(dtype_name, return_type=str)]
ClassRef = Annotated[str, BeforeValidator(class_name)]


def dtype_shorthand(raw: Any) -> Any:
    """ATorch's shorthand ``("half", "bf16")`` / ``("amp_native", torch.bfloat16)`` as a dict."""
    return {"dtype": raw} if isinstance(raw, (str, torch.dtype)) else raw


def as_list(value: Any) -> list:
    """A single item or any sequence, as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return [value]


class MethodConfig(BaseModel):
    """Base of every method's config: unknown fields are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True)

    @model_serializer(mode="wrap")
    def _omit_later_fields_at_default(self, handler):
        """A field added after strategies were written (``json_schema_extra={"omitted_at_default":
        True}``) is left out of the JSON while it holds its default: the strategies and search
        reports written before it read, and compare, the same."""
        data = handler(self)
        if isinstance(data, dict):
            for name, field in type(self).model_fields.items():
                extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
                if extra.get("omitted_at_default") and name in data and getattr(self, name) == field.default:
                    del data[name]
        return data

    def summary(self) -> str:
        """One line for people: the fields that differ from the defaults."""
        data = self.model_dump(mode="json", exclude_defaults=True)
        return ", ".join(f"{key}={value}" for key, value in data.items()) or "defaults"
