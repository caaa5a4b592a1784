"""The calibration file: where ``atorch calibrate`` keeps this machine's rates, and reading them
back for the search (nominal rates, and why, where there is none that applies). Reading only:
measuring is calibrate.py's."""

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from atorch.auto.search.agree import from_rank0
from atorch.auto.search.profiles import HardwareProfile, profile_from_data
from atorch.utils.cache_dir import cache_root
from atorch.utils.log import logger


def default_dir() -> Path:
    """``cache_root()/calibration`` (``~/.cache/atorch/calibration``), beside the search cache."""
    return cache_root() / "calibration"


def device_name(device: torch.device) -> str:
    """The device type a calibration is kept for: ``cpu``, or ``cuda-`` and the GPU's model."""
    if device.type != "cuda":
        return device.type
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def cache_path(device: torch.device, world_size: int, directory: str | os.PathLike | None = None) -> Path:
    """The calibration file of ``world_size`` ranks on ``device``'s type."""
    return Path(directory or default_dir()) / f"{device_name(device)}-world{world_size}.json"


def read_cached(path: Path, device: torch.device) -> tuple[dict | None, str]:
    """The calibration at ``path`` on rank 0 (None elsewhere), or None and why it does not apply:
    there is none, it does not read, or it was taken with another number of ranks per node (or,
    on the CPU, of threads per rank)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return None, ""
    if not path.is_file():
        return None, f"no calibration at {path}"
    try:
        return _check_cached(path, device)
    except Exception as error:  # noqa: BLE001 - a damaged file raises anything (RecursionError, ...); rank 0
        # must not raise alone before the broadcast that the other ranks wait in
        first = str(error).splitlines()[0] if str(error) else ""
        why = f"{path} does not read as a calibration ({type(error).__name__}: {first[:300]})"
        logger.warning("calibration: %s; using nominal rates (atorch calibrate --refresh measures again)", why)
        return None, why


def _check_cached(path: Path, device: torch.device) -> tuple[dict | None, str]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("calibration"), dict):
        raise ValueError("it is not a calibration object")
    profile_from_data(data, path)
    if "op_seconds" not in data:
        return None, f"{path} was measured before the overhead per operator was (run atorch calibrate --refresh)"
    if "checkpoint_save_seconds" not in data or "wrapped_call_seconds" not in data:
        return None, (f"{path} was measured before the overheads of checkpointing and FSDP2's hooks were (run "
                      "atorch calibrate --refresh)")
    if device.type == "cpu" and ("autocast_step_speedup" not in data.get("calibration", {})
                                 or "attention_flops" not in data):
        return None, (f"{path} was measured before a CPU's bf16 rate was taken from a model's step under autocast "
                      "and its attention rates were measured (run atorch calibrate --refresh)")
    if device.type == "cpu" and "ranks_per_core" not in data:
        return None, (f"{path} was measured before the ranks sharing a core were counted and gradient accumulation's "
                      "and pipeline=4's overheads measured (run atorch calibrate --refresh)")
    if "method_seconds" not in data:
        return None, (f"{path} was measured before the methods' host overheads were (run atorch calibrate "
                      "--refresh)")
    taken, now = data.get("calibration", {}), _setting(device)
    changed = [f"{key} {taken.get(key)} there, {value} here" for key, value in now.items() if taken.get(key) != value]
    if changed:
        return None, f"{path} was measured with another setting ({'; '.join(changed)})"
    return data, ""


def cached_rates(device: torch.device, world_size: int,
                 directory: str | os.PathLike | None = None) -> tuple[HardwareProfile | None, str]:
    """The cached calibration for this job, the same on every rank, and a line that says which
    rates the cost model will use (calibrated, from where; or nominal, and why). A collective
    call when a process group is initialised."""
    path = cache_path(device, world_size, directory)
    data, why = from_rank0(read_cached(path, device))
    if data is None:
        return None, f"nominal rates ({why}; `atorch calibrate --nproc {world_size}` measures this machine's)"
    when = data["calibration"].get("when", "")
    return profile_from_data(data, path), f"calibrated rates ({path}{', ' + when if when else ''})"


def _setting(device: torch.device) -> dict:
    """What a calibration depends on besides the device type and world size."""
    setting = {"local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    if device.type == "cpu":
        setting["threads"] = torch.get_num_threads()
    return setting
