"""The speed-up keys' bookkeeping against the plain reference of what a report logs: the run-level means a
resume restores (`restored_means`, from what the history and results.jsonl keep) are the ones published, the
placeholders before a report (`mean_keys`) are exactly the keys the host then holds, the baseline's speed-ups
are not ours (`is_mean_key`), and the monitor's two forms."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dflash_callbacks.engine.host import Host
from dflash_callbacks.engine.metric_keys import held_means, is_mean_key, mean_keys, report_metrics, restored_means
from dflash_callbacks.engine.publisher import Publisher
from dflash_callbacks.engine.results_line import prepare, speedup_of, versus_record
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.engine.run_state import RunState, history_entry
from dflash_callbacks.engine.stop import validate_monitor
from dflash_callbacks.scoring.intervals import paired_comparison
from dflash_callbacks.scoring import speed
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.settings import EvalSettings

from speed_costs import write_costs
from train_run import shared_world, world_paths


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    world = world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world"))
    costs = write_costs(tmp_path_factory.mktemp("keys-costs") / "costs.json", baseline_draft={6: 0.009})
    spec = ServiceSpec(str(world["cache"]), str(world["target"]), str(world["baseline"]),
                       {"ddtree_budgets": [4], "device": "cpu", "costs": str(costs)},
                       str(tmp_path_factory.mktemp("keys-bc")))
    service = ScoringService(spec)
    return service.score_folder(world["baseline"]), service.baseline()


def test_a_resume_restores_the_speedup_means_that_were_published(scored):
    report, baseline = scored
    versus = paired_comparison(report, baseline)
    held = held_means(report_metrics("dflash", report, baseline, versus))
    assert any(k.startswith("dflash/speedup/ratio/") for k in held)
    # the baseline's round is dearer (baseline_draft): ours is faster by the cost factors' ratio, the same tau
    ratio = held["dflash/speedup/ratio/ddtree@4/live/mean"] / held["dflash/ratio/ddtree@4/live/mean"]
    assert ratio > 1.1
    entry = history_entry(report, versus_record(versus, digits=None), speedup_of(report, baseline, versus, None))
    restored = restored_means("dflash", entry, baseline)
    assert set(restored) == set(held)
    assert all(restored[k] == pytest.approx(held[k], rel=1e-9) for k in held)
    assert set(held) == set(mean_keys("dflash", report.methods, True, speedup=True))
    assert set(held_means(report_metrics("dflash", report, None, None))) == set(
        mean_keys("dflash", report.methods, False, speedup=True))


def test_the_publisher_makes_a_reports_speedups_once(scored, tmp_path, monkeypatch):
    """On the training thread a report's predicted speed-ups are made once, for its keys, its history entry
    and (a line made there: the runner made none) its results.jsonl line, which hold what each makes on its
    own (`report_metrics`, `speedup_of`: the plain reference)."""
    report, baseline = dataclasses.replace(scored[0], step=100), scored[1]
    versus, record = prepare(report, 1.0, baseline)  # the runner's, off the training thread
    logged = {}
    host = Host()
    host.loggers = lambda: [("keys", lambda metrics, step: logged.update(metrics))]
    made = []
    real = speed.report_speedups
    monkeypatch.setattr(speed, "report_speedups", lambda *given: made.append(given) or real(*given))
    for recovered in (False, True):
        made.clear()
        settings = EvalSettings(tmp_path / "cache", tmp_path / "target", verbose=False)
        state = RunState("dflash", report.methods, True, speedup=True)
        publisher = Publisher(settings, host, state, [], [], lambda: None)
        publisher.start(RunFolder.create(tmp_path / f"runs-{recovered}", "r"), [])
        publisher.baseline, publisher.baseline_settled = baseline, True
        if recovered:  # a report the runner made nothing for: the comparison and the line are made here
            publisher.publish(report, 1.0)
        else:
            publisher.publish(report, 1.0, versus, record)
        assert len(made) == 1, recovered
        expected = report_metrics("dflash", report, baseline, versus)
        assert {k: v for k, v in logged.items() if "/speedup/" in k} == {
            k: v for k, v in expected.items() if "/speedup/" in k} != {}
        assert state.history[-1]["speedup"] == speedup_of(report, baseline, versus, None)
        (line,) = (tmp_path / f"runs-{recovered}" / "r" / "results.jsonl").read_text().splitlines()
        assert json.loads(line)["speedup"] == speedup_of(report, baseline, versus)


def test_the_baselines_speedups_are_not_ours():
    assert is_mean_key("dflash", "dflash/speedup/ddtree@4/live/mean")
    assert is_mean_key("dflash", "dflash/speedup/ratio/ddtree@4/live/mean_lo")
    assert not is_mean_key("dflash", "dflash/speedup/baseline/ddtree@4/live/mean")


def test_the_monitor_reads_tau_or_the_speedup():
    assert validate_monitor("ddtree@8/live") == "ddtree@8/live"
    assert validate_monitor("speedup/ddtree@8:b8/dense") == "speedup/ddtree@8:b8/dense"
    with pytest.raises(ValueError, match=r"a monitor is METHOD/AGGREGATE.*or speedup/METHOD/AGGREGATE"):
        validate_monitor("speedup/ddtree@8")


def test_a_relative_costs_path_is_made_absolute_where_the_run_was_started(tmp_path, monkeypatch):
    """run.json records the scoring a `watch --dir` started in another folder scores with: its costs path must
    still name the file."""
    import os

    from dflash_callbacks.settings import EvalSettings

    monkeypatch.chdir(tmp_path)
    settings = EvalSettings("cache", "target", scoring={"costs": "profiles/h200.json"})
    assert settings.scoring.costs == os.path.join(str(tmp_path), "profiles", "h200.json")
