"""Search results remembered per (model, data, optimizer, world, device, budget, options).

Stored as JSON under ``atorch.utils.cache_dir.cache_root()/search`` (``~/.cache/atorch/search``), or the
``search_cache_dir`` given to auto_accelerate. Rank 0 reads and writes; the others receive the
result through a broadcast.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

import atorch
from atorch.auto.registry import method_names
from atorch.auto.search.agree import from_rank0
from atorch.auto.search.report import SearchReport
from atorch.auto.strategy import Strategy
from atorch.distributed import env
from atorch.utils.cache_dir import cache_root
from atorch.utils.log import logger


def default_dir() -> Path:
    return cache_root() / "search"


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def cache_key(model: torch.nn.Module, ctx: Any, device_ctx: Any, budget: int, extra: dict) -> str:
    """A digest of everything that changes the answer (and nothing that does not, like weights)."""
    description = {
        "atorch": atorch.__version__,
        "torch": torch.__version__,
        "methods": method_names(),
        "model": repr(model),
        "params": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        "optim": [_name(ctx.optim_func), repr(sorted(ctx.optim_args.items()))],
        "loss": _name(getattr(ctx.loss_func, "loss_func", ctx.loss_func)),  # the user's, inside CountedLoss
        "data": [_name(ctx.dataset), len(ctx.dataset) if hasattr(ctx.dataset, "__len__") else None,
                 repr(sorted(ctx.dataloader_args.items())), _sample_shapes(ctx.dataset)],
        "input_format": getattr(ctx, "model_input_format", None),
        "world": [device_ctx.world_size, device_ctx.device.type, device_ctx.capability],
        "budget": budget,
        **extra,
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _sample_shapes(dataset: Any) -> Any:
    """The first sample's structure, shapes and dtypes (a job with longer sequences is another
    job, whatever its dataset's class and length); None where it cannot be read cheaply."""
    from atorch.auto.context import map_tensors

    if not hasattr(dataset, "__getitem__") or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - a dataset without index 0 is keyed without it
        return None
    described = map_tensors(sample, lambda t: f"tensor{tuple(t.shape)}:{t.dtype}")
    return json.loads(json.dumps(described, default=lambda value: type(value).__name__))


def _read(path: Path) -> dict | None:
    """The entry at ``path`` when it is a complete, valid one (rank 0); None, with a warning that
    names the file, for anything else: the search then runs again and overwrites it."""
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict) or not {"strategy", "report"} <= set(payload):
            raise ValueError("it is not a {'strategy', 'report'} object")
        _parse(payload, path)  # as strictly as a strategy file: the same validation
    except Exception as error:  # noqa: BLE001 - a damaged or hostile file raises anything (RecursionError, ...)
        first = str(error).splitlines()[0] if str(error) else ""
        logger.warning("search cache: skipping %s, which is not a valid entry (%s: %s); searching again",
                       path, type(error).__name__, first[:300])
        return None
    return payload


def _parse(payload: dict, path: Path) -> tuple[Strategy, SearchReport]:
    if not isinstance(payload["report"], dict):
        raise ValueError(f"its report is a {type(payload['report']).__name__}")
    report = SearchReport.from_dict(payload["report"])
    if report.note is not None and not isinstance(report.note, str):  # load() appends to it
        raise ValueError(f"its report's note is a {type(report.note).__name__}, not text")
    return Strategy.from_data(payload["strategy"], f"search cache entry {str(path)!r}"), report


def load(directory: Path, key: str) -> tuple[Strategy, SearchReport] | None:
    """The cached winner and report on every rank, or None on every rank (rank 0 reads and checks
    the file; a bad one is skipped on every rank, never raised on rank 0 alone)."""
    path = directory / f"{key}.json"
    payload = _read(path) if env.rank() == 0 else None
    payload = from_rank0(payload)
    if payload is None:
        return None
    strategy, report = _parse(payload, path)
    report.note = ((report.note or "") + " (from the search cache; pass use_search_cache=False to search again)").strip()
    return strategy, report


def store(directory: Path, key: str, strategy: Strategy, report: SearchReport) -> None:
    if env.rank() != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{key}.json.tmp"
    tmp.write_text(json.dumps({"strategy": strategy.to_dict(), "report": report.to_dict()}))
    os.replace(tmp, directory / f"{key}.json")
