"""EvalReport.from_dict, the strict reader: every number a report holds is checked against
its definition (DESIGN.md, "Terms and exact metrics"), so a report a watcher, a worker or
a file hands over is either right or refused naming the field, never logged half-wrong."""

import copy
import json
import math

import pytest
import torch

from dflash_callbacks.cache.format import HiddenStateCache
from dflash_callbacks.model.target_head import TargetHead, head_fingerprint
from dflash_callbacks.scoring.aggregates import decode_streaks, encode_streaks
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.report import INT_MAX, EvalReport
from dflash_callbacks.scoring.scorer import score_drafter

from synthetic import build_world

B = 6  # the synthetic world's block size


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict:
    """A real report's JSON object, as a watcher writes it."""
    world = build_world(tmp_path_factory.mktemp("world"))
    report = score_drafter(world.drafter, HiddenStateCache(world.cache), TargetHead.from_pretrained(world.target),
                           ScoringConfig(ddtree_budgets=[4], device="cpu"), step=4, snapshot_id="abc")
    assert report.block_size == B and report.cache["target"] == head_fingerprint(world.target)
    return json.loads(report.to_json())


def changed(raw: dict, path: str, value) -> dict:
    """A deep copy of `raw` with the field at a dotted path ("tasks.long.vanilla.live") set."""
    out = copy.deepcopy(raw)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return out


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("path, value, message", [
    # fields the reader used to let through: each one crashed results.jsonl or was logged
    ("seconds", NAN, "seconds is nan, not a finite number"),
    ("seconds", -1.0, r"'seconds' is -1.0, not a finite number from 0"),
    ("seconds", "3", r"'seconds' is '3', not a finite number"),
    ("created", INF, "created is inf, not a finite number"),
    ("peak_memory", 1.5, r"'peak_memory' is 1.5, not an integer from 0"),
    ("peak_memory", True, r"'peak_memory' is True, not an integer"),
    ("step", 2**63, r"'step' is 9223372036854775808, not an integer from 0 to 2\*\*63 - 1"),
    ("drafter_block_size", 1, r"'drafter_block_size' is 1, not an integer from 2"),
    ("snapshot_id", 7, r"'snapshot_id' is 7, not a string or null"),
    ("extra", {"score_seconds": NAN}, r"extra.score_seconds is nan, not a finite number"),
    ("score_seconds", INF, r"score_seconds is inf, not a finite number"),  # a results.jsonl line's own field
    ("scoring", [1], r"'scoring' is not an object"),
    ("extra", 5, r"'extra' is not an object"),
    ("cache.target", 5, r"'cache' holds a 'path' or 'target' that is not a string"),
    ("tasks.long.vanilla.live_rounds", [2, NAN], r"tasks.long.vanilla.live_rounds\[1\] is nan"),
    ("tasks.long.vanilla.live_rounds", [0], r"task 'long', vanilla: 'live_rounds'\[0\] is 0, not an integer from 1 to 6"),
    ("tasks.long.vanilla.live_rounds", [B + 1], r"'live_rounds'\[0\] is 7, not an integer from 1 to 6"),
    ("tasks.long.vanilla.live_rounds", [2.5], r"'live_rounds'\[0\] is 2.5, not an integer"),
    ("tasks.long.vanilla.live_rounds", [], r"task 'long', vanilla: 'live_rounds' must be a non-empty list"),
    ("tasks.long.vanilla.anchors", 0, r"task 'long', vanilla: 'anchors' is 0, not an integer from 1"),
    ("tasks.long.vanilla.anchors", NAN, r"tasks.long.vanilla.anchors is nan"),
    # tau = streak + 1 is 1 to block size; the curve holds shares
    ("tasks.short.ddtree@4.dense", 0.99, r"task 'short', ddtree@4: 'dense' is 0.99, not a finite number from 1 to 6"),
    ("tasks.short.ddtree@4.live", B + 1e-9, r"task 'short', ddtree@4: 'live' is 6.000000001"),
    ("tasks.short.ddtree@4.live", 1e308, r"'live' is 1e\+308, not a finite number from 1 to 6"),  # would overflow the mean
    ("tasks.short.vanilla.curve.2", 1.5, r"task 'short', vanilla: 'curve' at depth 3 is 1.5, not a finite number from 0 to 1"),
    ("tasks.short.vanilla.curve.0", -0.1, r"'curve' at depth 1 is -0.1"),
    ("tasks.short.vanilla.curve", [0.5] * B, r"'curve' must be a list of at most 5 shares"),
    ("block_size", 2**64, r"'block_size' is 18446744073709551616, not an integer from 2 to 2\*\*63 - 1"),
])
def test_every_number_is_refused_outside_its_definition_naming_the_field(raw, path, value, message):
    with pytest.raises(ValueError, match=message) as error:
        EvalReport.from_dict(changed(raw, path, value))
    assert str(error.value).startswith("not a report: ")


def test_a_task_named_mean_is_refused(raw):
    """`mean` is the run-level mean over tasks in keys and tables; a task of that name would be hidden by it."""
    tasks = {("mean" if name == "long" else name): entry for name, entry in raw["tasks"].items()}
    with pytest.raises(ValueError, match="not a report: task name 'mean' is reserved for the mean over tasks"):
        EvalReport.from_dict({**raw, "tasks": tasks})


def before_streaks(raw: dict) -> dict:
    """`raw` as a report written before scorer version 4: no streaks, no intervals."""
    out = {**copy.deepcopy(raw), "scorer_version": 2, "intervals": None}
    for task in out["tasks"].values():
        for numbers in task.values():
            numbers.pop("streaks")
    return out


def test_exact_boundaries_stay_legal_and_the_largest_legal_numbers_keep_the_mean_finite(raw):
    edge = changed(before_streaks(raw), "seconds", 0)
    for name, task in edge["tasks"].items():
        for method, numbers in task.items():
            numbers.update(dense=1, live=float(B), curve=[1.0, 0.0, 1, 0, 0.5], live_rounds=[1, B, 3], anchors=1)
    report = EvalReport.from_dict(edge)
    assert report.value("vanilla/dense") == 1 and report.value("ddtree@4/live") == B and report.seconds == 0
    huge = changed(changed(raw, "block_size", INT_MAX), "family", None)  # the largest legal block size (DFlash's
    for task in huge["tasks"].values():
        for numbers in task.values():
            streaks = encode_streaks(torch.full((numbers["anchors"],), INT_MAX - 1), INT_MAX)  # 13 digits each
            numbers.update(dense=INT_MAX, live=INT_MAX, pooled=INT_MAX, live_rounds=[INT_MAX], rounds=1, streaks=streaks)
    means = EvalReport.from_dict(huge).mean
    assert all(math.isfinite(v) for per_method in means.values() for v in per_method.values())


def test_the_streaks_and_intervals_are_checked_against_the_numbers_made_from_them(raw):
    """A report keeps its per-anchor streaks for the intervals: the reader holds them to the
    numbers they make (count, range, dense mean, live schedule) and the intervals to the
    report's tasks, methods and tau range, naming the field."""
    entry = raw["tasks"]["long"]["vanilla"]
    streaks = decode_streaks(entry["streaks"], B)
    assert len(streaks) == entry["anchors"] and entry["dense"] == pytest.approx(streaks.mean() + 1)
    cases = [
        ("tasks.long.vanilla.streaks", entry["streaks"][:-1] + "!", r"'streaks' holds a character other than"),
        ("tasks.long.vanilla.streaks", entry["streaks"][:-1] + "6", r"'streaks' holds the streak 6, above max_tau - 1 = 5"),
        ("tasks.long.vanilla.streaks", entry["streaks"][:-1], rf"'streaks' holds {len(streaks) - 1} anchors; 'anchors' says {len(streaks)}"),
        ("tasks.long.vanilla.streaks", "", r"'streaks' is not a non-empty string of base-36 digits, 1 per anchor"),
        ("tasks.long.vanilla.dense", entry["dense"] + 1e-6, r"task 'long', vanilla: 'dense' is .*; the streaks' mean tau is"),
        ("tasks.long.vanilla.live_rounds", entry["live_rounds"][:-1] + [entry["live_rounds"][-1] % B + 1],
         rf"'live_rounds'\[{len(entry['live_rounds']) - 1}\] is .*; the live schedule over the streaks gives"),
        ("tasks.long.vanilla.live_rounds", entry["live_rounds"][:1], r"'live_rounds' holds 1 rounds; the live schedule"),
        ("intervals.mean.vanilla.live", [3.0, 2.0], r"'intervals.mean.vanilla.live' is \[3.0, 2.0\]: its low end is above"),
        ("intervals.tasks.short.ddtree@4.dense", [1.0, B + 0.5], r"'intervals.tasks.short.ddtree@4.dense' hi is 6.5"),
        ("intervals.mean", {"vanilla": raw["intervals"]["mean"]["vanilla"]}, r"'intervals.mean' does not hold the report's methods"),
        ("intervals.seed", -1, r"'intervals.seed' is -1"),
    ]
    for path, value, message in cases:
        with pytest.raises(ValueError, match=message):
            EvalReport.from_dict(changed(raw, path, value))
    assert EvalReport.from_dict(before_streaks(raw)).intervals is None  # a report from before still loads


def test_a_report_written_before_the_target_was_recorded_still_loads(raw):
    old = {**raw, "cache": {k: v for k, v in raw["cache"].items() if k != "target"}}
    report = EvalReport.from_dict(old)
    assert "target" not in report.cache and report.to_dict()["tasks"] == raw["tasks"]
