"""The external runner against watchers that misbehave: a report file that is JSON but not a report, one
with a NaN or out-of-range number, one of another snapshot of the step, are errors for their snapshot (or
passed over), never a crash or a logged number; a watcher slower than the snapshots, with one kept on
disk, never has an unscored snapshot pruned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest

from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec

from runs import assert_clean, reads_update_atime, records, run_dir, wait_until
from train_run import SCORING, eval_cb, fit, shared_world, world_paths, write_cache
from watchers import HostileWatcher


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def test_malformed_watcher_reports_are_errors_not_crashes(world, tmp_path):
    """External runner: a report file that is JSON but not a report (a list, tasks as a list,
    no step) is an error for that snapshot; the next snapshot is taken and scored."""
    service = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), None, SCORING))

    def good(step, snapshot_id):
        return service.score_folder(RunFolder(run_dir(tmp_path / "d")).snapshot_path(step)).to_dict()

    def no_step(step, snapshot_id):
        payload = good(step, snapshot_id)
        del payload["step"]
        return payload

    def tasks_as_list(step, snapshot_id):
        return {**good(step, snapshot_id), "tasks": [1, 2]}

    watcher = HostileWatcher(tmp_path / "d", [lambda s, i: [1, 2, 3], tasks_as_list, no_step, good])
    cb = eval_cb(world, tmp_path, runner="external", keep_last=4, wait_timeout=60, busy="queue", max_pending=8)
    with watcher:
        with pytest.warns(UserWarning, match=r"step 2 failed: .*not a report"):
            trainer = fit(world, tmp_path, [cb], max_steps=8)
    lines = records(tmp_path / "d")
    assert trainer.global_step == 8 and [r["step"] for r in lines] == [2, 4, 6, 8]
    assert "not a report: a JSON object was expected, found list" in lines[0]["error"]
    assert "not a report: 'tasks' is not a non-empty object" in lines[1]["error"]
    assert "the report names step None" in lines[2]["error"]
    assert "tasks" in lines[3] and [r.step for r in cb.reports] == [8] and cb.errors == 3
    assert_clean(tmp_path / "d", cb.reports)


def test_a_watcher_report_with_a_nan_or_out_of_range_number_is_an_error_not_a_crash(world, tmp_path):
    """External runner: a report whose number the reader once let through ('seconds': NaN
    raised out of the results.jsonl append, killing fit, and stayed queued to fail every
    later append; a tau above the block size was logged) is an error for its snapshot; the
    next snapshot is scored, recorded and logged."""
    service = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), None, SCORING))

    def good(step, snapshot_id):
        return service.score_folder(RunFolder(run_dir(tmp_path / "d")).snapshot_path(step)).to_dict()

    def nan_seconds(step, snapshot_id):
        return {**good(step, snapshot_id), "seconds": float("nan")}  # written as NaN, as json.dumps does

    def tau_above_block(step, snapshot_id):
        payload = good(step, snapshot_id)
        next(iter(payload["tasks"].values()))["vanilla"]["live"] = payload["block_size"] + 1.0
        return payload

    watcher = HostileWatcher(tmp_path / "d", [nan_seconds, tau_above_block, good])
    cb = eval_cb(world, tmp_path, runner="external", keep_last=4, wait_timeout=60, busy="queue", max_pending=8)
    with watcher:
        with pytest.warns(UserWarning, match=r"step 2 failed: .*not a report: seconds is nan"):
            trainer = fit(world, tmp_path, [cb], max_steps=6)
    lines = records(tmp_path / "d")
    assert trainer.global_step == 6 and [r["step"] for r in lines] == [2, 4, 6]
    assert "seconds is nan, not a finite number" in lines[0]["error"]
    assert "vanilla: 'live' is 7.0, not a finite number from 1 to 6" in lines[1]["error"]
    assert "tasks" in lines[2] and [r.step for r in cb.reports] == [6] and cb.errors == 2
    assert float(trainer.callback_metrics["dflash/vanilla/live/mean"]) == pytest.approx(cb.reports[0].value("vanilla/live"))
    assert_clean(tmp_path / "d", cb.reports)


def test_a_stale_report_of_another_snapshot_is_never_taken_for_this_one(world, tmp_path):
    """External runner: the watcher first writes a report of the same step but another
    snapshot (an old watcher finishing late), then the right one: only the right one counts."""
    service = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), None, SCORING))
    folder = {}

    def scored(step, snapshot_id, as_id):
        report = service.score_folder(RunFolder(run_dir(tmp_path / "d")).snapshot_path(step))
        report.snapshot_id = as_id
        folder[step] = snapshot_id
        return report.to_dict()

    watcher = HostileWatcher(tmp_path / "d", [lambda s, i: scored(s, i, "0" * 16)])
    cb = eval_cb(world, tmp_path, runner="external", keep_last=2, wait_timeout=60, every_n_train_steps=4)

    precise = reads_update_atime(tmp_path)

    def stale_one_read() -> bool:  # on disk, and read since it was written (where atime records reads)
        path = cb.run.report_path(4)
        if not path.is_file():
            return False
        written = path.stat()
        return written.st_atime_ns > written.st_mtime_ns or not precise

    class RightOneLater(pl.Callback):
        def on_train_end(self, trainer, pl_module):  # before cb waits: give the right report after the stale one
            run = cb.run
            wait_until(stale_one_read, what="the runner reading the stale report of step 4")
            service.score_folder(run.snapshot_path(4)).to_json(run.report_path(4))

    with watcher:
        fit(world, tmp_path, [RightOneLater(), cb], max_steps=4, enable_checkpointing=False)
    (line,) = records(tmp_path / "d")
    assert line["step"] == 4 and line["snapshot_id"] == folder[4] != "0" * 16
    assert cb.errors == 0
    assert_clean(tmp_path / "d", cb.reports)


def test_external_runner_with_one_kept_snapshot_and_a_queue_never_prunes_an_unscored_snapshot(world, tmp_path):
    """keep_last=1, busy="queue": snapshots come faster than a slow watcher scores them. Each
    is written only after the one before was scored, so none is deleted unscored."""
    paths = world_paths(world)
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 50, 4)])  # ~46 forwards a snapshot: slower than 2 steps
    dirpath = tmp_path / "d"
    dirpath.mkdir()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(dirpath), "--cache", str(slow),
         "--target", str(paths["target"]), "--budgets", "4", "--device", "cpu", "--poll-seconds", "0.1",
         "--anchors-per-forward", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    cb = eval_cb(world, tmp_path, cache=slow, runner="external", keep_last=1, busy="queue", max_pending=3)

    class AtMostOne(pl.Callback):
        most = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.most = max(self.most, len(cb.run.list_snapshots()))

    bound = AtMostOne()
    try:
        fit(world, tmp_path, [cb, bound], max_steps=8)
    finally:
        watcher.kill()
    lines = records(dirpath)
    assert lines and all("tasks" in r for r in lines) and cb.errors == 0 and bound.most <= 1
    assert [r["step"] for r in lines] == [r.step for r in cb.reports]
    assert_clean(dirpath, cb.reports)
