"""How much faster this machine computes a step in bf16 than in fp32, measured where no calibration
applies: the ratio the search's amp decisions hinge on.

Without a calibration the cost model's rates are nominal, and a nominal CPU rate says bf16 runs
at half fp32's speed; on a CPU with bf16 instructions (avx512_bf16, AMX) amp_native ran 1.22-1.38x
faster than fp32 on a small GPT-2, and the search pruned it as slower unmeasured. So when no
calibration applies, the search measures this one ratio first (every rank at once, as they
train): on a CPU a small model's step under bf16 autocast against fp32, on a GPU a square matmul
in each dtype. It is cached per device type and world size beside the calibration
(``~/.cache/atorch/calibration``), so a machine pays it once; the other rates stay nominal, and
the report's ``rates`` line says which were measured.
"""

import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from atorch.auto.search.agree import from_rank0
from atorch.auto.search.calibration_file import _setting, default_dir, device_name
from atorch.auto.search.compute_rates import _autocast_speedup, _matmul_rate
from atorch.utils.files import write_text_atomic
from atorch.utils.log import logger


def speedup_path(device: torch.device, world_size: int, directory=None) -> Path:
    return Path(directory or default_dir()) / f"{device_name(device)}-world{world_size}-bf16-speedup.json"


def half_speedup(device: torch.device, world_size: int, directory=None) -> tuple[float, str]:
    """bf16 step rate / fp32 step rate on this machine, the same on every rank, and a line that
    says where it came from. A collective call: every rank calls it, in step."""
    path = speedup_path(device, world_size, directory)
    cached = from_rank0(_read(path, device))
    if cached is not None:
        return cached["half_speedup"], f"measured {cached['when']}, {path}"
    began = time.perf_counter()
    value = from_rank0(measure_speedup(device))
    seconds = time.perf_counter() - began
    if not dist.is_initialized() or dist.get_rank() == 0:
        data = {"half_speedup": value, "setting": _setting(device), "torch": torch.__version__,
                "when": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "seconds": seconds}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(data, indent=2) + "\n")
        except OSError as error:  # a read-only cache: measured again next time, nothing lost
            logger.warning("could not cache the measured bf16 speedup at %s: %s", path, error)
    return value, f"measured now in {seconds:.1f}s, cached at {path}"


def measure_speedup(device: torch.device) -> float:
    """bf16 / fp32 rate. On a CPU, how much faster a small model's step runs under bf16 autocast
    than in fp32 (casts and element-wise operators can eat what faster matmuls save: square
    bf16 matmuls ran 2.7-7x fp32's here, the step 1.1-1.4x); on a GPU, square matmuls'."""
    if device.type == "cpu":
        return _autocast_speedup(device)
    return _matmul_rate(device, torch.bfloat16) / _matmul_rate(device, torch.float32)


def _read(path: Path, device: torch.device) -> dict | None:
    """The cached ratio on rank 0 (None elsewhere), if it was measured in this setting with this torch."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    try:
        data = json.loads(path.read_text())
        value = float(data["half_speedup"])
    except (OSError, ValueError, TypeError, KeyError):
        return None  # none yet, or damaged: measured again
    if not (math.isfinite(value) and value > 0) or data.get("setting") != _setting(device) or data.get("torch") != torch.__version__:
        return None
    return {"half_speedup": value, "when": str(data.get("when", ""))}
