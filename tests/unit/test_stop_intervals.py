"""The stop and the intervals: a cache of fewer than MIN_TASKS tasks has no run-level interval,
so no report of it trails; patience below 2 is warned of."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from dflash_callbacks.engine.results_line import versus_record
from dflash_callbacks.engine.stop import Moment, StopPolicy
from dflash_callbacks.scoring.intervals import paired_comparison
from made_reports import judged_by
from simulated_caches import Model, report_of


def test_patience_below_two_warns_saying_why():
    with pytest.warns(UserWarning, match=r"StopPolicy\(patience=1\): one report below the threshold stops training"):
        StopPolicy(patience=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StopPolicy(patience=2), StopPolicy()


def runs(tasks: int):
    """A clearly worse drafter (about 0.6x) against the baseline on `tasks` tasks: two reports of
    it, the baseline's, and the paired comparison on vanilla/dense."""
    streaks = Model(rho=0.7, offsets=(0.3, -0.8)).streaks(np.random.default_rng(13), 1, tasks)[:, 0]
    ours, base = (report_of(streaks[d], 8, name=n) for d, n in ((0, "ours"), (1, "base")))
    return ours, base, paired_comparison(ours, base)


@pytest.mark.parametrize("tasks", [1, 2, 3])
def test_a_report_over_too_few_tasks_never_trails(tasks):
    """One or two tasks: the ratio's interval is the within-task one, which says nothing of
    other prompts; the stop (confidence on) never counts the report as trailing, and says why,
    where it stopped. Three tasks stop as before; so does confidence=None, which judges the
    point values alone by choice. A resume reads the verdict back from results.jsonl."""
    ours, base, versus = runs(tasks)
    mean = versus["vanilla/dense"]["mean"]
    assert mean.ratio.hi < 0.9 and ours.value("vanilla/dense") < 0.9 * base.value("vanilla/dense")
    said = []
    policy = StopPolicy(monitor="vanilla/dense", min_ratio=0.9, patience=2, verbose=False)
    judge = judged_by(policy)
    reasons = [judge(ours, base, Moment(step), said.append, said.append, versus=mean) for step in (1, 2)]
    if tasks == 3:
        assert reasons[0] is None and reasons[1] is not None and "for 2 reports in a row" in reasons[1]
        return
    assert reasons == [None, None] and policy.wait_count == 0, reasons
    assert policy.last_decision.reason.endswith(
        "but the cache has fewer than 3 tasks, too few for a run-level interval: not judged"), policy.last_decision
    assert not policy.trails(ours.value("vanilla/dense"), math.inf, base.value("vanilla/dense"))

    resumed = StopPolicy(monitor="vanilla/dense", min_ratio=0.9, patience=2, verbose=False)
    points, bounds = resumed.series([{"step": s, "mean": ours.mean, "versus": versus_record(versus)} for s in (1, 2)])
    assert not resumed.decide(points, base.value("vanilla/dense"), None, bounds).stop

    points = StopPolicy(monitor="vanilla/dense", min_ratio=0.9, patience=2, verbose=False, confidence=None)
    judge = judged_by(points)
    assert [judge(ours, base, Moment(s), said.append, said.append, versus=mean) for s in (1, 2)][1]
