"""The end of training waits for pending reports, within bounds: what is still pending when wait_timeout
runs out is an error line, counted and warned about, also a step whose scorer does not stop in time;
without a watcher, the external runner says so and the end of fit does not wait again for each snapshot."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from dflash_callbacks.engine.runners import background, external_scorer

from runs import assert_clean, records, wait_until
from train_run import SCORING, eval_cb, fit, shared_world, write_cache


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def test_reports_still_pending_when_wait_timeout_runs_out_are_recorded_not_dropped(world, tmp_path):
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 300, 4), ("slow2", 300, 4)])
    cb = eval_cb(world, tmp_path, cache=slow, busy="queue", max_pending=4, wait_timeout=0.5,
                 scoring={**SCORING, "anchors_per_forward": 1})
    started = time.time()
    with pytest.warns(UserWarning, match=r"not scored: wait_timeout=0.5 s ran out at the end of training"):
        fit(world, tmp_path, [cb], max_steps=4)
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [2, 4] and time.time() - started < 60
    errors = [r for r in lines if "error" in r]  # step 2 may have been scored in time on a fast machine
    assert errors[-1]["step"] == 4 and cb.errors == len(errors) == len(lines) - len(cb.reports)
    assert all("not scored: wait_timeout=0.5 s ran out" in r["error"] for r in errors)
    assert_clean(tmp_path / "d", cb.reports)


def test_a_report_the_scorer_can_not_stop_in_time_is_recorded_not_dropped(world, tmp_path, monkeypatch):
    """The thread scorer stops between tasks: inside one long task when wait_timeout runs out,
    it outlives the grace `close` gives it. Its step is still an error line, not nothing."""
    monkeypatch.setattr(background, "CANCEL_GRACE", 0.1)
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 3000, 4)])  # one task of seconds (1 s at 900 here, idle)
    cb = eval_cb(world, tmp_path, cache=slow, wait_timeout=1.0, scoring={**SCORING, "anchors_per_forward": 1})
    with pytest.warns(UserWarning, match=r"step 2 failed: not scored: wait_timeout=1 s ran out at the end of training"):
        fit(world, tmp_path, [cb], max_steps=2)
    (line,) = records(tmp_path / "d")
    assert line["step"] == 2 and line["error"].endswith("; the scorer did not stop within 0.1 s") and cb.errors == 1
    assert_clean(tmp_path / "d", cb.reports)
    for thread in threading.enumerate():  # it ends with its task, handing back nothing
        if thread.name == "dflash-eval":
            thread.join(120)
    assert records(tmp_path / "d") == [line]


def test_external_runner_without_a_watcher_says_so_and_does_not_wait_an_hour(world, tmp_path, monkeypatch):
    monkeypatch.setattr(external_scorer, "WATCHER_TIMEOUT", 1.5)
    cb = eval_cb(world, tmp_path, runner="external", keep_last=2)  # wait_timeout 300
    started = time.time()
    with pytest.warns(UserWarning, match=r"no `dflash-callbacks watch` has written to .* for 2 s; step 2 was not scored"):
        fit(world, tmp_path, [cb], max_steps=2)
    assert time.time() - started < 60
    (line,) = records(tmp_path / "d")
    assert line["step"] == 2 and "no `dflash-callbacks watch`" in line["error"]


def test_without_a_watcher_the_end_of_fit_does_not_wait_again_for_each_snapshot(world, tmp_path, monkeypatch):
    """Four snapshots pending at the end of a run no watcher ever served: `fit` ends at once, not
    after WATCHER_TIMEOUT per snapshot (each wait used to start its own clock)."""
    monkeypatch.setattr(external_scorer, "WATCHER_TIMEOUT", 3.0)
    cb = eval_cb(world, tmp_path, runner="external", keep_last=4, busy="queue", max_pending=4)

    class Timing(pl.Callback):  # the run outlives WATCHER_TIMEOUT; then the time fit spends at its end
        ended = caught = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:  # step 2's snapshot waits for a watcher: until the runner says it waited
                wait_until(lambda: any("waiting for a watcher to score" in str(w.message) for w in list(self.caught)),
                           what="the runner's warning that no watcher scored step 2 within WATCHER_TIMEOUT")

        def on_train_end(self, trainer, pl_module):
            self.ended = time.monotonic()

    timing = Timing()
    with pytest.warns(UserWarning, match=r"no `dflash-callbacks watch` has written to .* for 3 s") as timing.caught:
        fit(world, tmp_path, [timing, cb], max_steps=8)
    assert time.monotonic() - timing.ended < 3.0  # it took 9 s and more: 3 s for each snapshot after the first
    assert [(r["step"], "no `dflash-callbacks watch`" in r["error"]) for r in records(tmp_path / "d")] == \
        [(2, True), (4, True), (6, True), (8, True)]
