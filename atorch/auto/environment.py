"""DeviceContext: what this job runs on, read once and passed to every decision."""

import os
from dataclasses import dataclass

import torch

from atorch.distributed import env


@dataclass(frozen=True)
class DeviceContext:
    world_size: int
    local_world_size: int
    device: torch.device
    # CUDA compute capability as (major, minor); None off CUDA.
    capability: tuple[int, int] | None
    # Bytes one rank may use: the GPU's memory, or this node's RAM shared by its local ranks.
    memory_per_device: int

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def detect(cls) -> "DeviceContext":
        device = env.device()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            memory = torch.cuda.get_device_properties(device).total_memory
        else:
            capability = None
            memory = _host_memory() // max(local_world, 1)
        return cls(env.world_size(), local_world, device, capability, memory)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_host_memory() -> int:
    """Bytes of host memory available now (Linux's MemAvailable: free pages and the page cache
    that can be given back), or the free pages where that is not known; 0 when neither is."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
