"""Statistics shared by the benchmarks, so every results table means the same thing by p50 / p99."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``: the smallest value with at least q% of the
    values at or below it (rank ceil(q/100 · n)); None when empty. p99 of 10 values is the largest."""
    if not values:
        return None
    ordered = sorted(values)
    # q · n before / 100: q / 100 · n rounds 99.9 % of 1000 up to 999.0000000000001, one rank too high
    return ordered[max(0, math.ceil(q * len(ordered) / 100) - 1)]
