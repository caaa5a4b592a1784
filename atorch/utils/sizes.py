"""Sizes as text: read (``70GiB``, ``512MB``, ``1e9``) and written (``12.1MiB``)."""

from typing import Any


def parse_bytes(value: Any) -> int | None:
    """``70GiB``, ``512MB``, ``1e9`` or an int, as bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    lower = text.lower()
    for suffix, factor in units.items():
        if lower.endswith(suffix):
            try:
                return int(float(lower[: -len(suffix)]) * factor)
            except ValueError:
                break
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"memory_budget {value!r} is not a size; write bytes or e.g. '70GiB', '512MB'") from None


def size_text(value: int | None) -> str:
    """Bytes as ``12.1MiB``; None as ``-``."""
    if value is None:
        return "-"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= factor:
            return f"{value / factor:.1f}{unit}"
    return f"{value}B"
