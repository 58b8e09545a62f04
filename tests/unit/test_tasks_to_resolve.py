"""tasks_to_resolve, the number of tasks the stop's setup warning names (the cache is too small to resolve
min_ratio): found in O(log tasks) steps, the same number the count one task at a time finds, and at once
for a threshold next to 1 (counted one at a time, 0.9995 took 20 s); t_quantile's cache is bounded."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_callbacks.scoring.intervals import CONFIDENCE, t_quantile, tasks_to_resolve


class Interval(SimpleNamespace):
    """What tasks_to_resolve reads of a baseline's report: its value and interval on a monitor, and its tasks."""

    def interval(self, monitor):
        return self.lo, self.hi

    def value(self, monitor):
        return self.mean


def counted_one_at_a_time(baseline, min_ratio: float) -> int | None:
    """The plain reference: the first task count whose interval half-width is within the margin."""
    count, margin = len(baseline.tasks), 1 - min_ratio
    half = (baseline.hi - baseline.lo) / 2 / baseline.mean
    if half <= margin or margin <= 0:
        return None
    p = 1 - (1 - CONFIDENCE) / 2
    tasks = count + 1
    while half * (t_quantile(p, tasks - 1) / t_quantile(p, count - 1) if count > 1 else 1.0) * math.sqrt(count / tasks) \
            > margin:
        tasks += 1
    return tasks


@pytest.mark.parametrize("count", [1, 2, 3, 10, 50])
def test_the_tasks_to_resolve_are_those_counted_one_at_a_time(count):
    rng = np.random.default_rng(count)
    for _ in range(12):
        mean = rng.uniform(1.2, 5.0)
        half = mean * rng.uniform(0.01, 0.3)
        baseline = Interval(tasks=[f"t{i}" for i in range(count)], mean=mean, lo=mean - half, hi=mean + half)
        for margin in (half / mean * 1.5, half / mean, half / mean / 1.7, half / mean / 8, 0.0, -0.1):
            min_ratio = 1 - margin
            assert tasks_to_resolve(baseline, "vanilla/live", min_ratio) == counted_one_at_a_time(baseline, min_ratio)


def test_a_threshold_next_to_1_is_answered_at_once():
    baseline = Interval(tasks=["a", "b", "c"], mean=2.36, lo=1.8, hi=2.9)
    for min_ratio in (0.9995, 1 - 1e-9, 1 - 1e-15):
        t_quantile.cache_clear()
        started = time.perf_counter()
        needed = tasks_to_resolve(baseline, "ddtree@8/live", min_ratio)
        assert time.perf_counter() - started < 0.5 and needed > 10**5  # one at a time: seconds at 0.9995, for ever above
    assert t_quantile.cache_info().maxsize is not None  # bounded
