"""The stop's setup warning (the cache is too small to resolve min_ratio) never blocks training: the
number of tasks it names is found in O(log tasks) steps, the same number the count one task at a
time finds, and it is worked out on the runner's thread, not the training thread, whatever the
threshold (a threshold near 1 asked for millions of tasks, counted one at a time for 20 s)."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.engine import reports
from dflash_callbacks.scoring.intervals import CONFIDENCE, t_quantile, tasks_to_resolve
from dflash_callbacks.scoring.report import EvalReport

from loops import SCORING, DrafterModel
from runs import DEADLINE

from train_run import shared_world, world_paths


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


def test_the_setup_warning_is_made_on_the_runners_thread(tmp_path_factory, tmp_path, monkeypatch):
    world = SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))
    made_on, original = [], reports.resolution_warning

    def slow_warning(baseline: EvalReport, monitor: str, min_ratio: float) -> str | None:
        made_on.append(threading.current_thread().name)
        time.sleep(1.0)  # as long as counting tasks one at a time took
        return original(baseline, monitor, min_ratio)

    monkeypatch.setattr(reports, "resolution_warning", slow_warning)
    stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=1 - 1e-9, action="warn", verbose=False)
    evaluator = DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=100,
                                 scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc",
                                 verbose=False, stop=stop)
    model = DrafterModel(world.config, world.target)
    optimizer = torch.optim.AdamW(model.drafter.parameters())
    evaluator.attach(model.drafter, optimizer)
    longest, step = 0.0, 0
    with pytest.warns(UserWarning, match=r"TrailingBaselineStop: the cache's 3 tasks can not resolve min_ratio=1 on "
                                         r"ddtree@4/live: .* about \d+ tasks would resolve it"):
        deadline = time.monotonic() + DEADLINE
        while evaluator.baseline_report is None and time.monotonic() < deadline:
            step += 1
            optimizer.step()
            started = time.perf_counter()
            evaluator.step(step)
            longest = max(longest, time.perf_counter() - started)
        evaluator.close()
    assert made_on == ["dflash-eval"] and longest < 0.5
