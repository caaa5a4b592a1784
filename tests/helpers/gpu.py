"""The one gate for GPU-only tests: they run where a suitable GPU exists and skip elsewhere."""

import importlib.util

import pytest
import torch


def requires_gpu(min_capability: tuple[int, int] | None = None, packages: tuple[str, ...] = ()):
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("a CUDA GPU")
    elif min_capability and torch.cuda.get_device_capability() < min_capability:
        reasons.append(f"compute capability {min_capability[0]}.{min_capability[1]}+")
    reasons += [name for name in packages if importlib.util.find_spec(name) is None]

    def decorate(fn):
        fn = pytest.mark.gpu(fn)
        return pytest.mark.skipif(bool(reasons), reason="needs " + ", ".join(reasons))(fn) if reasons else fn

    return decorate
