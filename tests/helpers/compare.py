"""Loss comparisons between a distributed run and its single-process reference."""

import math

FP32_RTOL = 1e-5
BF16_RTOL = 5e-3


def assert_losses_close(actual, expected, rtol):
    assert len(actual) == len(expected) and len(expected) >= 5
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert math.isfinite(a), f"step {step}: loss {a}"
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs reference {e} (rtol {rtol})\n{actual}\n{expected}"


def assert_ranks_agree(results):
    first = results[0]["losses"]
    for result in results[1:]:
        assert result["losses"] == first
