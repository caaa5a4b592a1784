"""The load imbalance of routed experts: how much more than the mean the busiest rank of an
expert group computes (expert_parallel's cost term, ``StepCost.imbalance_flops``)."""

import math
from statistics import NormalDist


def busiest_excess(pairs: float, size: int) -> float:
    """How much more than the mean the busiest rank of an expert group computes, as a share of
    the mean, when each of ``pairs`` (token, choice) pairs a rank sends picks its expert at random
    (uniform routing): a rank receives ``pairs`` on average with a variance of ``pairs x (1 -
    1/size)``, and the largest of ``size`` such loads lies Blom's ``inv_cdf((size - 0.375) /
    (size + 0.25))`` standard deviations above the mean (the expected largest of ``size`` normal
    draws: 1.05 for 4, 1.43 for 8, 2.42 for 64). Each layer waits for that rank (the all-to-all
    back). A trained router's skew beyond chance is not modelled (its auxiliary loss keeps it
    small)."""
    if size < 2 or pairs <= 0:
        return 0.0
    deviations = NormalDist().inv_cdf((size - 0.375) / (size + 0.25))
    return deviations * math.sqrt((1 - 1 / size) / pairs)
