"""The pooled aggregate (vLLM's mean acceptance length) against a plain loop, and every interval a function of
one method's numbers (a paired one of the pair's) whatever else a report scores."""

from __future__ import annotations

import dataclasses

import copy
import json
import random

import numpy as np
import pytest

from dflash_callbacks.scoring.aggregates import AGGREGATES, Streaks, pooled_numbers, schedule
from dflash_callbacks.scoring.intervals import paired_comparison, report_intervals
from dflash_callbacks.scoring.report import EvalReport
from simulated_caches import report_of


def plain_engine_count(answers: list[list[int]]) -> float:
    """What vLLM's spec-decode metrics print, from each answer's streaks: walk every answer to its end, one
    verification step per round; 1 + accepted / drafts over all of them."""
    accepted = drafts = 0
    for streaks in answers:
        anchor = 0
        while anchor < len(streaks):
            accepted, drafts = accepted + streaks[anchor], drafts + 1
            anchor += streaks[anchor] + 1
    return 1 + accepted / drafts


def test_pooled_is_the_engines_count_over_every_round_of_every_answer():
    rng = random.Random(0)
    for _ in range(200):
        answers = [[rng.choice([0, 0, 1, 2, 5, 7]) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(1, 6))]
        report = report_of(answers, 8, max_rounds=rng.choice([None, 1, 3]))
        assert report.mean["vanilla"]["pooled"] == pytest.approx(plain_engine_count(answers), rel=1e-12)
        for task, streaks in zip(report.tasks.values(), answers):
            value, rounds = pooled_numbers(Streaks.of(np.array(streaks)))
            assert task["vanilla"]["pooled"] == value and task["vanilla"]["rounds"] == rounds
            visits, taus = schedule(Streaks.of(np.array(streaks)))
            assert int(visits.sum()) == rounds and ((visits * taus).sum() / rounds) == value
    # it weighs tasks by their rounds, where live weighs each the same: a short answer of long streaks
    report = report_of([[7] * 8, [0] * 40], 8)
    assert report.mean["vanilla"]["live"] == pytest.approx((8 + 1) / 2)
    assert report.mean["vanilla"]["pooled"] == pytest.approx((8 + 40) / (1 + 40))
    # max_rounds cuts live, never pooled
    cut = report_of([[1] * 30], 8, max_rounds=2)
    assert cut.tasks["t0"]["vanilla"]["live_rounds"] == [2, 2] and cut.tasks["t0"]["vanilla"]["rounds"] == 15


def test_the_pooled_interval_holds_the_number_and_a_report_reads_back_strictly():
    rng = np.random.default_rng(1)
    report = report_of([rng.choice([0, 1, 2, 3, 7], size=rng.integers(30, 90)) for _ in range(8)], 8)
    report.intervals = report_intervals(report)
    lo, hi = report.interval("vanilla/pooled")
    assert lo < report.value("vanilla/pooled") < hi
    raw = json.loads(report.to_json())
    assert EvalReport.from_dict(raw).mean == report.mean
    raw["tasks"]["t0"]["vanilla"]["rounds"] += 1
    with pytest.raises(ValueError, match="'rounds' is .*; the whole live schedule over the streaks has"):
        EvalReport.from_dict(raw)


def test_a_report_of_before_gets_pooled_from_its_streaks_and_keeps_its_other_intervals():
    rng = np.random.default_rng(2)
    report = report_of([rng.choice([0, 1, 2, 6], size=50) for _ in range(5)], 8)
    report.intervals = report_intervals(report)
    old = json.loads(report.to_json())
    for per in old["tasks"].values():
        for numbers in per.values():
            del numbers["pooled"], numbers["rounds"]
    for where in [old["intervals"]["mean"], *old["intervals"]["tasks"].values()]:
        del where["vanilla"]["pooled"]
    old["intervals"]["mean"]["vanilla"]["dense"] = [1.0, 7.5]  # an older interval is kept as it was written
    read = EvalReport.from_dict(copy.deepcopy(old))
    assert read.mean["vanilla"]["pooled"] == report.mean["vanilla"]["pooled"]
    assert read.interval("vanilla/pooled") == report.interval("vanilla/pooled")
    assert read.interval("vanilla/dense") == (1.0, 7.5)


def test_an_interval_is_the_same_with_and_without_other_methods_scored_beside_it(toy_report_pair):
    """The toy baseline's report of vanilla, ddtree@4, ddtree@8 and top@4, and the same report with vanilla alone:
    every interval of vanilla, per task and run-level, and every paired one against a worse drafter, equal."""
    baseline, worse = toy_report_pair

    def vanilla_alone(report: EvalReport) -> EvalReport:
        raw = json.loads(report.to_json())
        raw["tasks"] = {t: {"vanilla": per["vanilla"]} for t, per in raw["tasks"].items()}
        return EvalReport.from_dict({**raw, "intervals": None})

    alone = vanilla_alone(baseline)
    assert baseline.methods == ["vanilla", "ddtree@4", "ddtree@8", "top@4"] and alone.methods == ["vanilla"]
    found, full = report_intervals(alone), baseline.intervals
    for name in AGGREGATES:
        assert found["mean"]["vanilla"][name] == full["mean"]["vanilla"][name]
        for task in baseline.tasks:
            assert found["tasks"][task]["vanilla"][name] == full["tasks"][task]["vanilla"][name]
    from dflash_callbacks.scoring.intervals import resolution_warning

    scored_alone = dataclasses.replace(alone, intervals=found)
    for name in AGGREGATES:  # the setup warning's count of tasks is the method's own too
        assert resolution_warning(scored_alone, f"vanilla/{name}", 0.95) == resolution_warning(
            baseline, f"vanilla/{name}", 0.95)
    paired_alone, paired_full = paired_comparison(alone, vanilla_alone(worse)), paired_comparison(baseline, worse)
    for name in AGGREGATES:
        assert paired_alone[f"vanilla/{name}"] == paired_full[f"vanilla/{name}"]


@pytest.fixture(scope="module")
def toy_report_pair(toy_cache, toy_target):
    import torch

    from dflash_callbacks.demos.toy.world import toy_baseline_path
    from dflash_callbacks.model import TargetHead, load_drafter
    from dflash_callbacks.scoring.config import ScoringConfig
    from dflash_callbacks.scoring.scorer import score_drafter

    head = TargetHead.from_pretrained(toy_target)
    config = ScoringConfig(device="cpu", ddtree_budgets=[4, 8], topk=[4], tasks=toy_cache.task_names[:5])
    baseline = score_drafter(load_drafter(toy_baseline_path()), toy_cache, head, config, name="baseline")
    worse = load_drafter(toy_baseline_path())
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in worse.parameters():
            if weight.dim() > 1:
                weight.add_(0.3 * weight.std() * torch.randn(weight.shape, generator=noise))
    return baseline, score_drafter(worse, toy_cache, head, config, name="worse")


def test_a_report_of_before_without_streaks_or_rounds_reads_back_without_pooled():
    """Neither streaks nor live rounds to make pooled from: a report of before reads back with dense and live
    alone; a report of this scorer must hold pooled."""
    from dflash_callbacks.scoring.report import SCORER_VERSION

    bare = {"drafter": "d", "cache": {"path": "x", "fingerprint": "f"}, "block_size": 8, "step": 10,
            "tasks": {"t": {m: {"dense": 1.5, "live": 1.25, "curve": []} for m in ("vanilla", "ddtree@8")}}}
    report = EvalReport.from_dict(bare)
    assert report.mean == {m: {"dense": 1.5, "live": 1.25} for m in ("vanilla", "ddtree@8")}
    with pytest.raises(ValueError, match="'pooled' is None"):
        EvalReport.from_dict({**bare, "scorer_version": SCORER_VERSION})
