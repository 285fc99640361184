"""The one percentile every benchmark reports (nearest rank), checked against its definition."""

from __future__ import annotations

import math
import random

from benchmarks.stats import percentile


def test_nearest_rank_by_definition():
    """The smallest value v with at least q% of the values <= v, for every q and many sizes."""
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 99, 100, 101, 1000):
        values = [rng.random() for _ in range(n)]
        for q in (1, 25, 50, 90, 99, 99.9, 100):
            want = min(v for v in values if sum(x <= v for x in values) >= q / 100 * n - 1e-9)
            assert percentile(values, q) == want, (n, q)


def test_small_samples():
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 11)), 99) == 10  # p99 of 10 values is the largest
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0, 7.0], 50) == 5.0  # a value of the sample, never the mean of two
    assert not math.isnan(percentile([1.0], 0))
