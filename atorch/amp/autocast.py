"""Run a module's forward under ``torch.autocast`` without changing the module's type or keys."""

import torch


class AutocastForward:
    """Replaces ``module.forward`` on the instance: state_dict keys and the class stay the same,
    and a later ``module.compile()`` traces the autocast region with the rest of the forward."""

    def __init__(self, forward, device_type: str, dtype: torch.dtype):
        self.forward, self.device_type, self.dtype = forward, device_type, dtype

    def __call__(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.forward(*args, **kwargs)


def autocast_module(module: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    module.forward = AutocastForward(module.forward, device_type, dtype)
