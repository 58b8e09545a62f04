"""Every adapter survives the same faults: each scenario is written once and run against the Lightning
callback, the plain loop's DrafterEvaluator and the transformers Trainer's callback (tests/support/
adapters.py): a scorer failing mid-run, NaN weights at one step, a results file unwritable for a while, a
scoring worker killed while it scores, a training process SIGKILLed and resumed from its checkpoint. Each
time training goes on, the failure is an error line for its step and counted, none of its numbers is
logged, and no finished evaluation is lost: every run folder goes through the audit (runs.py). The two
kills are slow (a worker process, a training script). The engine's own faults run through one adapter
(`ENGINE_FAULTS_THROUGH`); the resume, which each adapter does its own way, through all three."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.engine.run_folder import RunFolder

from adapters import ADAPTERS
from loops import SCORING
from runs import (OnFirstReport, assert_clean, kill_after_reports, reads_update_atime, records, tear_as_a_kill_would,
                  unwritable_results_for_a_while, wait_until, zero_task_files)
from train_run import shared_world, write_cache


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


@pytest.fixture(params=list(ADAPTERS))
def adapter(request, world):
    return ADAPTERS[request.param](world)


ENGINE_FAULTS_THROUGH = ["loop"]
"""A fault the engine handles (a scorer that fails, NaN weights, an unwritable results file, a killed
worker) takes the same path under every adapter: it runs once, through the plain loop, the thinnest
adapter. What differs per adapter (its checkpoint, its resume, its loggers) runs under every one."""


@pytest.mark.parametrize("adapter", ENGINE_FAULTS_THROUGH, indirect=True)
def test_a_scorer_failing_mid_run_is_an_error_line_per_snapshot_and_training_finishes(adapter, tmp_path):
    """The evaluation cache is zeroed once the first report is in: every later snapshot is an error line.
    Training waits at step 2 until its snapshot is scored, so that the report is published while training
    goes on (at step 3), whatever the machine's load."""
    cache = shutil.copytree(adapter.paths.cache, tmp_path / "eval-cache")  # training reads the world's copy
    ev = adapter.evaluation(tmp_path, cache=cache)  # busy="skip": the next snapshot once this report is in
    corrupt = OnFirstReport(ev, lambda: zero_task_files(cache))

    def scored(model, step):
        if step == 2:
            wait_until(lambda: not ev.engine.runner._outbox.empty(), what="the report of step 2")

    with pytest.warns(UserWarning, match=r"dflash: step \d+ failed: CacheError: .*not a readable safetensors file"):
        steps, _ = adapter.train(ev, tmp_path, 10, after_step=scored)
    assert steps == 10
    lines = records(tmp_path / "d")
    good, bad = [r for r in lines if "tasks" in r], [r for r in lines if "error" in r]
    assert [r["step"] for r in good] == [corrupt.at] == [r.step for r in ev.reports]
    assert bad and all(r["step"] > corrupt.at and "CacheError" in r["error"] for r in bad)
    assert ev.errors == len(bad) and len({r["step"] for r in lines}) == len(lines)
    assert [h["step"] for h in ev.history] == [corrupt.at]
    assert_clean(tmp_path / "d", ev.reports)


@pytest.mark.parametrize("adapter", ENGINE_FAULTS_THROUGH, indirect=True)
def test_nan_weights_at_one_step_are_an_error_line_and_never_a_logged_number(adapter, tmp_path):
    """At step 4, after its optimizer step, one weight is NaN while the snapshot is taken, and restored
    right after: steps 2 and 6 are scored and logged, step 4 is an error line and only the error count."""
    ev = adapter.evaluation(tmp_path, busy="queue", max_pending=8)
    saved = {}

    def set_nan(model, step):
        if step == 4:
            with torch.no_grad():
                saved["weight"] = model.drafter.fc.weight[0, 0].item()
                model.drafter.fc.weight[0, 0] = float("nan")

    def restore(model, step):
        if step == 4:
            with torch.no_grad():
                model.drafter.fc.weight[0, 0] = saved["weight"]

    with pytest.warns(UserWarning, match=r"step 4 failed: NonFiniteError: step 4 holds NaN or Inf weights in fc\.weight"):
        steps, model = adapter.train(ev, tmp_path, 6, before_snapshot=set_nan, after_step=restore)
    assert steps == 6 and torch.isfinite(model.drafter.fc.weight).all()
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [2, 4, 6]
    assert "NaN or Inf" in lines[1]["error"] and "tasks" not in lines[1]
    assert ev.errors == 1 and [h["step"] for h in ev.history] == [2, 6]
    logged = adapter.logged
    assert [step for step, metrics in logged if "dflash/vanilla/live/mean" in metrics] == [2, 6]
    assert all(math.isfinite(v) for _, metrics in logged for v in metrics.values())
    assert any(metrics == {"dflash/errors": 1.0} for _, metrics in logged)
    rows = adapter.rows()  # Lightning: what its CSV logger wrote to metrics.csv
    assert sorted(step for step, row in rows if "dflash/vanilla/live/mean" in row) == [2, 6]
    assert any(row.get("dflash/errors") == 1.0 for _, row in rows)
    assert_clean(tmp_path / "d", ev.reports)


@pytest.mark.parametrize("adapter", ENGINE_FAULTS_THROUGH, indirect=True)
def test_a_results_file_unwritable_for_a_while_costs_no_report(adapter, tmp_path):
    """After the first report a folder takes the place of results.jsonl (every append fails); after the
    third it is put back: training goes on, each failure is counted, the reports are still logged, and the
    lines held in memory land in the file once each, in order."""
    ev = adapter.evaluation(tmp_path, busy="queue", max_pending=8)
    seen = unwritable_results_for_a_while(ev)
    with pytest.warns(UserWarning, match=r"appending to .*results.jsonl failed|can not open .*results.jsonl"):
        steps, _ = adapter.train(ev, tmp_path, 10)
    assert steps == 10 and seen == [2, 4, 6, 8, 10]
    assert ev.errors == 2  # the appends of steps 4 and 6
    assert [step for step, metrics in adapter.logged if "dflash/vanilla/live/mean" in metrics] == [2, 4, 6, 8, 10]
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6, 8, 10]
    assert_clean(tmp_path / "d", ev.reports)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ENGINE_FAULTS_THROUGH, indirect=True)
def test_a_killed_scoring_worker_fails_its_step_and_a_new_worker_scores_the_next(adapter, tmp_path):
    """runner="process": the worker is SIGKILLed while it scores step 2, as soon as it has loaded the
    snapshot's weights (the file's atime moves past its mtime), with a cache that takes it a second or more
    to score; training waits at step 2 until then. Step 2 is an error line, step 4 is scored by a new
    worker."""
    slow = write_cache(adapter.world, tmp_path / "slow-cache", [("slow", 300, 4)])  # ~300 forwards
    ev = adapter.evaluation(tmp_path, cache=slow, runner="process", busy="queue", max_pending=4, keep_last=2,
                            scoring={**SCORING, "anchors_per_forward": 1})
    precise = reads_update_atime(tmp_path)
    killed = {}

    def kill_once_loaded() -> bool:
        runner = ev.engine.runner
        proc, snaps = runner.scorer.process, runner.run.list_snapshots()
        if proc is None or proc.poll() is not None or not snaps:
            return False
        weights = os.stat(snaps[-1][1] / "model.safetensors")
        killed["loaded"] = weights.st_atime_ns > weights.st_mtime_ns
        if not (killed["loaded"] or not precise):
            return False
        os.kill(proc.pid, signal.SIGKILL)
        killed.update(step=snaps[-1][0], scorer=runner.scorer)
        return True

    def kill_while_it_scores(model, step):
        if step == 2:
            wait_until(kill_once_loaded, what="the scoring worker loading the snapshot of step 2")

    with pytest.warns(UserWarning, match=r"step 2 failed: RuntimeError: the scoring worker died \(exit code -9\)"):
        adapter.train(ev, tmp_path, 4, after_step=kill_while_it_scores)
    assert killed["step"] == 2 and (killed["loaded"] or not precise)
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [2, 4]
    assert "the scoring worker died (exit code -9)" in lines[0]["error"] and "tasks" in lines[1]
    assert ev.errors == 1 and [r.step for r in ev.reports] == [4]
    assert killed["scorer"].restarts == 1 and not killed["scorer"].process  # closed after the run
    assert_clean(tmp_path / "d", ev.reports)


@pytest.mark.slow
def test_a_sigkilled_training_run_resumes_from_its_checkpoint_and_loses_nothing(adapter, tmp_path):
    """The entry point's training script (a checkpoint every 3 steps) is SIGKILLed once results.jsonl has 3
    lines; a torn last line and a half-written snapshot folder are left behind, as a kill in the middle of
    an append or of a snapshot write would. Resuming from the newest checkpoint that loads (one older than
    the last report) reopens the same run folder: every line parses, nothing finished before the kill is
    lost or scored again, a snapshot the killed run wrote but never scored is scored, and the stop's
    history is rebuilt from results.jsonl."""
    root = tmp_path / "run"
    results_path = kill_after_reports(adapter.script(root), root / "dflash", tmp_path / "train.log")
    folder = results_path.parent
    left = {step: RunFolder.snapshot_id(snapshot) for step, snapshot in RunFolder(folder).list_snapshots()}
    before = results_path.read_text()
    lines = before[: before.rfind("\n") + 1].splitlines()
    steps_before = [json.loads(line)["step"] for line in lines]
    stale = tear_as_a_kill_would(results_path)
    resumed_from, ckpt = next((step, path) for step, path in adapter.checkpoints(root) if step < max(steps_before))
    max_steps = max(steps_before + [resumed_from]) + 4

    stop = TrailingBaselineStop(monitor="ddtree@4/live", verbose=False)
    ev = adapter.evaluation(tmp_path, dirpath=root / "dflash", stop=stop)
    at_start = []
    with pytest.warns(UserWarning, match="ended in a torn line"):
        steps, _ = adapter.train(ev, root, max_steps, resume=ckpt,
                                 at_start=lambda: at_start.extend(step for step, _ in stop.history))
    assert steps == max_steps and ev.run.path == folder
    # the stop's history was rebuilt from results.jsonl: it has the reports appended between the
    # checkpoint and the kill, not only those in the checkpoint
    assert at_start == sorted(steps_before) and any(step > resumed_from for step in at_start)

    text = results_path.read_text()
    assert text.startswith("".join(line + "\n" for line in lines)), "a line finished before the kill changed"
    parsed = [json.loads(line) for line in text.splitlines()]  # every line parses
    steps = [r["step"] for r in parsed]
    assert len(steps) == len(set(steps)) and 999998 not in steps and steps[-1] == max_steps
    new = [r.step for r in ev.reports]
    assert new and set(new).isdisjoint(steps_before) and new[-1] == max_steps
    # a report of a step before the checkpoint is the killed run's snapshot it left unscored, scored now
    assert all(r.step > resumed_from or (r.step % 2 == 0 and r.snapshot_id == left.get(r.step)) for r in ev.reports)
    assert sorted(steps) == sorted(steps_before + new) == sorted(h["step"] for h in ev.history)
    assert not stale.exists() and len(ev.run.list_snapshots()) <= 2
    assert sorted(p.name for p in ev.run.snapshots_dir.iterdir() if p.name.startswith(".")) == []
    assert_clean(root / "dflash", ev.reports)
