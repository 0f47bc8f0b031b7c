"""When requests (or sessions) arrive: Gamma renewal processes and an evening-peak ramp.

Gamma inter-arrival times with shape k and mean 1/rate: k = 1 is Poisson; k < 1 is burstier
(clumps and gaps), k > 1 steadier — vLLM's `--burstiness`. The ramp is a non-homogeneous Poisson
process whose rate climbs linearly from a quarter of the peak to the peak at mid-run and falls
back, drawn by inverting the cumulative rate, so it too is fixed by the seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

ARRIVALS = ("gamma", "ramp")


def arrival_times(
    n: int, rate: float, *, burstiness: float = 1.0, profile: str = "gamma", seed: int = 0
) -> list[float]:
    """`n` send times in seconds from the start; rate = inf sends everything at once."""
    if n < 0 or rate <= 0 or burstiness <= 0:
        raise ValueError("need n >= 0, rate > 0 and burstiness > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    if profile == "gamma":
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        return out
    if profile == "ramp":
        return _ramp(n, rate, rng)
    raise ValueError(f"unknown arrival profile {profile!r}; choose from {', '.join(ARRIVALS)}")


def _ramp(n: int, peak: float, rng: random.Random) -> list[float]:
    # Rate r(t) is a triangle from base = peak/4 up to peak at T/2 and back; its mean is 5/8 of
    # the peak, so T is chosen for n expected arrivals.
    base = peak / 4
    total = n / (0.625 * peak)
    half = total / 2

    def cumulative(t: float) -> float:
        if t <= half:
            return base * t + (peak - base) * t * t / (2 * half)
        if t <= total:
            u = t - half
            return cumulative(half) + peak * u - (peak - base) * u * u / (2 * half)
        return cumulative(total) + base * (t - total)  # stragglers after the peak: base rate

    out, unit = [], 0.0
    for _ in range(n):
        out.append(_invert(cumulative, unit, total))
        unit += rng.expovariate(1.0)
    return out


def _invert(f: Callable[[float], float], y: float, hi: float) -> float:
    """The t in [0, ∞) with f(t) = y for an increasing f, by bisection."""
    lo = 0.0
    while f(hi) < y:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < y:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
