"""Compute rates measured on this device: a square matmul's FLOP/s per dtype, and how much faster
a model's step runs under bf16 autocast than in fp32 (what amp gains, casts included). The
calibration (calibrate.py) takes them with the rest; a search without one measures the ratio its
amp decisions hinge on (speedup.py)."""

import statistics
import time

import torch

from atorch.auto.search.agree import max_each
from atorch.auto.search.timing import _sync, median_seconds

# The matmul's side per device type, halved while one matmul takes over MATMUL_SECONDS.
MATMUL_SIDE = {"cpu": 512, "cuda": 8192}
MATMUL_SECONDS = 0.05
# Tokens x hidden of the two MLP blocks whose step, in fp32 and under bf16 autocast, sets a CPU's
# bf16 rate: the fp32 matmul rate x how much faster that step runs under autocast.
AMP_BLOCK = (256, 256)
# Rounds of a paired ratio (paired_ratio): each times both sides once.
PAIRS = 9


def _matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in ``dtype``, all ranks computing at once (as they train). The
    side is halved (down to 128) while one matmul takes over MATMUL_SECONDS (bf16 on a CPU
    without bf16 instructions runs ~10x slower than fp32), so calibration stays short."""
    side = MATMUL_SIDE.get(device.type, 512)
    while True:
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        _sync(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        slow = max_each(time.perf_counter() - start)[0] > MATMUL_SECONDS
        if not slow or side <= 128:
            break
        side //= 2
    return 2 * side**3 / median_seconds(device, lambda: torch.matmul(a, b))


def _autocast_speedup(device: torch.device) -> float:
    """fp32 step time / bf16-autocast step time of forward + backward through 2 MLP blocks
    (Linear to 4x, GELU, Linear back, LayerNorm) on ``AMP_BLOCK`` tokens x hidden: what amp gains
    on a model, casts and elementwise operators included, which square matmuls do not show."""
    tokens, hidden = AMP_BLOCK
    generator = torch.Generator().manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(2):
        layers += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden),
                   torch.nn.LayerNorm(hidden)]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(tokens, hidden, generator=generator).to(device)

    def step(amp: bool) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    step(False), step(True)  # warm-up: autocast's cast cache, the allocator
    return paired_ratio(device, lambda: step(False), lambda: step(True))


def paired_ratio(device: torch.device, slow, fast, pairs: int = PAIRS) -> float:
    """Median over ``pairs`` rounds of ``slow``'s time over ``fast``'s, each round timing both back
    to back (the slowest rank's clock), in alternating order: a change of the machine's load weighs
    on both sides of each round's ratio, where two blocks of repetitions timed one after the other
    took it on one side only (a reading of 0.17 under a parallel test run, 1.1-1.4 alone)."""
    ratios = []
    for index in range(pairs):
        first, second = (slow, fast) if index % 2 == 0 else (fast, slow)
        seconds = {}
        for run in (first, second):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            seconds[run] = time.perf_counter() - start
        took_slow, took_fast = max_each(seconds[slow], seconds[fast])
        ratios.append(took_slow / took_fast)
    return statistics.median(ratios)
