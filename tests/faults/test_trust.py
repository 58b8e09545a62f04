"""Trust at the edges: evaluation never kills the run, never loses a report, never logs a
wrong number. Each test reproduces one way it used to go wrong, with real files, real
processes and real signals, and every run folder goes through the audit (runs.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file

from dflash_callbacks import TrailingBaselineStop, save_drafter
from dflash_callbacks.cache.extract import extract_cache
from dflash_callbacks.cache.format import write_task
from dflash_callbacks.cache.tasks import Task
from dflash_callbacks.engine import runners
from dflash_callbacks.callbacks.host import LightningHost
from dflash_callbacks.engine.evaluator import EvalEngine
from dflash_callbacks.settings import EvalSettings
from dflash_callbacks.engine.publish import Publisher
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.model.target_head import head_fingerprint
from dflash_callbacks.scoring.basis import Basis
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.scorer import NonFiniteError
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec

from fixtures_cache import save_random_target
from runs import assert_clean, records, run_dir
from watchers import HostileWatcher

from suite_paths import SCRIPTS  # noqa: E402
from train_run import SCORING, eval_cb, fit, shared_world, world_paths, write_cache  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


class CountBatches(pl.Callback):
    batches = 0

    def on_train_batch_start(self, *args):
        self.batches += 1


def refused_before_training(world, tmp_path, cb, message) -> None:
    counter = CountBatches()
    with pytest.raises(PreflightError, match=message):
        fit(world, tmp_path, [cb, counter], max_steps=4)
    assert counter.batches == 0 and not (tmp_path / "d").exists()


# ---------------------------------------------------------------- the run never dies


def test_a_failed_append_leaves_no_torn_line_and_is_written_once_the_disk_takes_it(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG), as a full disk does:
    the line is cut back whole, and appends go through again once there is room."""
    script = textwrap.dedent(f"""
        import json, resource, signal
        from dflash_callbacks.engine.run_folder import RunFolder, ResultsWriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        run = RunFolder.create({str(tmp_path)!r}, "r")
        run.append({{"step": 1, "error": "first"}})
        size = run.results_path.stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))
        try:
            run.append({{"step": 2, "error": "x" * 200}})
            print("appended")
        except ResultsWriteError as e:
            print("refused", run.results_path.stat().st_size == size, e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        run.append({{"step": 2, "error": "x" * 200}})
        print(json.dumps([json.loads(l)["step"] for l in run.results_path.read_text().splitlines()]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.strip().splitlines()
    assert first.startswith("refused True") and "File too large" in first
    assert json.loads(last) == [1, 2]


def test_a_subscriber_that_raises_is_counted_and_training_goes_on(world, tmp_path):
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8)
    calls = []
    cb.subscribe(lambda report, baseline: 1 / 0)
    cb.subscribe(lambda report, baseline: calls.append(report.step))  # the next subscriber still gets it
    with pytest.warns(UserWarning, match=r"subscriber .* raised on step 2: ZeroDivisionError"):
        trainer = fit(world, tmp_path, [cb], max_steps=6)
    assert trainer.global_step == 6 and calls == [2, 4, 6] and cb.errors == 3
    assert_clean(tmp_path / "d", cb.reports)


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


def test_a_report_or_line_that_is_not_strict_json_is_an_error_line_dropped_never_retried(world, tmp_path):
    """A report in memory the strict reader would refuse (here NaN seconds) is an error line
    in results.jsonl, counted, and none of its numbers is logged; a line that is not JSON at
    all is dropped and counted, not held to fail every later append; good reports go on."""
    service = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), None, SCORING))
    good = service.score_folder(world / "baseline")
    good.step, good.snapshot_id = 2, "a" * 16
    bad = EvalReport.from_dict({**good.to_dict(), "step": 4, "snapshot_id": "b" * 16})
    bad.seconds = float("nan")
    later = EvalReport.from_dict({**good.to_dict(), "step": 6, "snapshot_id": "c" * 16})
    run, failures, seen = RunFolder.create(tmp_path / "d", "r"), [], []
    trainer = pl.Trainer(logger=False, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    engine = EvalEngine(EvalSettings(world / "cache", world / "target", scoring=SCORING, verbose=False))
    engine.host = engine.reports.host = LightningHost(trainer)
    engine.reports.fail = failures.append
    engine.reports.publisher = Publisher("dflash", run, failures.append, engine.host.loggers, engine.host.wandb_runs)
    engine.subscribe(lambda report, baseline: seen.append(report.step))
    engine.reports.publish(bad, 1.0)
    assert not trainer.callback_metrics and seen == [] and failures == [
        "step 4: the report is refused, none of its numbers is logged: not a report: seconds is nan, not a finite number"]
    engine.reports.publisher.record({"step": 5, "snapshot_id": "d" * 16, "error": "x", "seconds": float("inf")})
    assert "line of step 5 is not strict JSON" in failures[1] and engine.reports.publisher.unsaved == []
    engine.reports.publish(later, 1.0)
    lines = [json.loads(line) for line in run.results_path.read_text().splitlines()]
    assert [(r["step"], "error" in r) for r in lines] == [(4, True), (6, False)] and seen == [6] and len(failures) == 2
    assert lines[0]["error"] == failures[0] and lines[0]["snapshot_id"] == "b" * 16
    assert float(trainer.callback_metrics["dflash/vanilla/live/mean"]) == pytest.approx(later.value("vanilla/live"))
    assert_clean(tmp_path / "d")


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

    class RightOneLater(pl.Callback):
        def on_train_end(self, trainer, pl_module):  # before cb waits: give the right report after the stale one
            run = cb.run
            time.sleep(0.5)
            service.score_folder(run.snapshot_path(4)).to_json(run.report_path(4))

    with watcher:
        fit(world, tmp_path, [RightOneLater(), cb], max_steps=4, enable_checkpointing=False)
    (line,) = records(tmp_path / "d")
    assert line["step"] == 4 and line["snapshot_id"] == folder[4] != "0" * 16
    assert cb.errors == 0
    assert_clean(tmp_path / "d", cb.reports)


def test_a_results_line_that_is_json_but_not_a_report_is_skipped_with_its_line_number(world, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = eval_cb(world, tmp_path)
    fit(world, tmp_path, [first, ckpt], max_steps=4, enable_checkpointing=True)
    with open(first.run.results_path, "a") as f:
        f.write("[1, 2]\n")
        f.write('{"step": "x", "tasks": {}}\n')
    second = eval_cb(world, tmp_path)
    with pytest.warns(UserWarning, match=r"results.jsonl line 3: not a report: a JSON object was expected"):
        trainer = fit(world, tmp_path, [second], max_steps=6, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt"))
    assert trainer.global_step == 6 and [h["step"] for h in second.history] == [2, 4, 6]


# ---------------------------------------------------------------- no report lost or mismatched


def worker_pids(parent: int) -> list[int]:
    """Live processes whose parent is `parent` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkilled_training_takes_its_scoring_worker_with_it(world, tmp_path):
    """runner="process": SIGKILL the training process while its worker scores; the worker
    does not outlive it (it would hold the memory and, on a GPU, a CUDA context)."""
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 300, 4)])
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "train_run.py"), "--world", str(world), "--root", str(tmp_path / "run"),
         "--max-steps", "100000", "--every", "2", "--runner", "process", "--no-baseline", "--eval-cache", str(slow),
         "--anchors-per-forward", "1", "--step-sleep", "0.02"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline, workers = time.time() + 120, []
        while time.time() < deadline and not workers:
            workers = [pid for pid in worker_pids(proc.pid) if b"worker_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            time.sleep(0.2)
        assert workers, "no scoring worker started"
        time.sleep(1.0)  # let it start scoring
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "the scoring worker outlived the SIGKILLed training process"


def test_the_process_workers_answers_survive_a_ctrl_c_a_sigterm_and_text_printed_as_it_starts(world, tmp_path, monkeypatch):
    """Ctrl-C in a terminal reaches the whole process group, a preemption's SIGTERM every
    process of the job: the worker leaves them to the training process (it died of them, and
    the fit that was stopping wrote 'the scoring worker died' for the step a resume was to
    score). Text printed to stdout as the worker starts (a sitecustomize, a library's banner)
    is never taken for an answer (it was, and every later answer came one job late)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('print("hello from sitecustomize")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]))
    paths = world_paths(world)
    spec = ServiceSpec(str(paths["cache"]), str(paths["target"]), str(paths["baseline"]), SCORING, str(tmp_path / "bc"))
    scorer = runners.ProcessScorer(spec, None, threading.Event(), threading.Event())

    def interrupt():  # as soon as the worker ignores them (before the fix: after 20 s, scoring)
        deadline = time.time() + 20
        while time.time() < deadline and not (scorer.process and ignores(scorer.process.pid, signal.SIGINT, signal.SIGTERM)):
            time.sleep(0.01)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(scorer.process.pid, sig)
            sent.append(sig)

    sent = []
    thread = threading.Thread(target=interrupt)  # the worker is the scoring thread's: it dies with that thread
    thread.start()
    try:
        baseline = scorer.baseline()
        thread.join()
        again = scorer.score(runners.Job(0, "x", folder=paths["baseline"]))
    finally:
        scorer.close()
    assert sent == [signal.SIGINT, signal.SIGTERM] and baseline.tasks == again.tasks and scorer.restarts == 0


def ignores(pid: int, *signals) -> bool:
    """Whether process `pid` ignores every one of `signals` (its SigIgn mask in /proc)."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return all(mask >> (s - 1) & 1 for s in signals)


def test_external_runner_killed_and_resumed_adopts_the_watchers_report_and_the_stop_sees_it(world, tmp_path):
    """train_run.py (external runner, no watcher yet, checkpoint every 2 steps) is SIGKILLed
    once it wrote the snapshot of step 2. A watcher then scores it: a report the killed run
    never read. The resumed run (from the checkpoint of step 2) records that report, once,
    with the snapshot's id, and TrailingBaselineStop's history (no baseline: it records,
    it does not decide) has it."""
    root = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "train_run.py"), "--world", str(world), "--root", str(root),
         "--max-steps", "100000", "--every", "2", "--runner", "external", "--ckpt-every", "2",
         "--step-sleep", "0.05", "--keep-last", "2", "--no-baseline"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            snaps = list(root.glob("dflash/*/snapshots/step-00000002/snapshot.json"))
            if snaps and (root / "ckpt" / "step=2.ckpt").is_file():
                break
            time.sleep(0.05)
        assert snaps, "no snapshot of step 2"
    finally:
        proc.kill()
        proc.wait()
    folder = snaps[0].parents[2]
    snapshot_id = json.loads(snaps[0].read_text())["snapshot_id"]
    paths = world_paths(world)
    assert cli_main(["watch", "--dir", str(root / "dflash"), "--cache", str(paths["cache"]), "--target",
                     str(paths["target"]), "--budgets", "4", "--device", "cpu", "--once"]) == 0
    assert RunFolder(folder).read_report(RunFolder(folder).report_path(2)).snapshot_id == snapshot_id

    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(root / "dflash"), "--cache",
         str(paths["cache"]), "--target", str(paths["target"]), "--budgets", "4", "--device", "cpu",
         "--poll-seconds", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    cb = eval_cb(world, tmp_path, runner="external", keep_last=2, dirpath=root / "dflash")
    stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=0.01, verbose=False)
    try:
        with pytest.warns(UserWarning, match="no baseline report"):
            fit(world, root, [cb, stop], max_steps=6, ckpt_path=str(root / "ckpt" / "step=2.ckpt"))
    finally:
        watcher.kill()
    assert cb.run.path == folder
    lines = records(root / "dflash")
    assert sorted(r["step"] for r in lines) == [2, 4, 6]
    assert next(r for r in lines if r["step"] == 2)["snapshot_id"] == snapshot_id
    assert [s for s, _ in stop.history] == [2, 4, 6]
    assert_clean(root / "dflash", cb.reports)


def test_external_runner_with_one_kept_snapshot_and_a_queue_never_prunes_an_unscored_snapshot(world, tmp_path):
    """keep_last=1, busy="queue": snapshots come faster than a slow watcher scores them. Each
    is written only after the one before was scored, so none is deleted unscored."""
    paths = world_paths(world)
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 100, 4)])
    dirpath = tmp_path / "d"
    dirpath.mkdir()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(dirpath), "--cache", str(slow),
         "--target", str(paths["target"]), "--budgets", "4", "--device", "cpu", "--poll-seconds", "0.1",
         "--anchors-per-forward", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    cb = eval_cb(world, tmp_path, cache=slow, runner="external", keep_last=1, busy="queue", max_pending=3,
                 wait_timeout=120)

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


def test_a_snapshot_write_failure_with_the_external_runner_does_not_stop_later_snapshots(world, tmp_path):
    """The defect: one failed write left `pending` at 1 forever, so busy="skip" skipped every later snapshot."""
    paths = world_paths(world)
    dirpath = tmp_path / "d"
    dirpath.mkdir()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(dirpath), "--cache", str(paths["cache"]),
         "--target", str(paths["target"]), "--budgets", "4", "--device", "cpu", "--poll-seconds", "0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    cb = eval_cb(world, tmp_path, runner="external", keep_last=2, wait_timeout=120)

    class BlockFirstWrite(pl.Callback):  # after cb: its run folder exists
        def on_train_start(self, trainer, pl_module):
            cb.run.snapshots_dir.write_text("a file where the folder goes")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cb.errors and cb.run.snapshots_dir.is_file():
                cb.run.snapshots_dir.unlink()

    try:
        with pytest.warns(UserWarning, match="writing the snapshot failed"):
            fit(world, tmp_path, [cb, BlockFirstWrite()], max_steps=10)
    finally:
        watcher.kill()
    lines = records(dirpath)
    assert "writing the snapshot failed" in lines[0]["error"]
    assert len(cb.reports) >= 2 and cb.reports[-1].step == 10
    assert_clean(dirpath, cb.reports)


# ---------------------------------------------------------------- waiting at the end


def test_wait_timeout_must_be_positive(world, tmp_path):
    for bad in (0, -1, "60"):
        with pytest.raises(ValueError, match=f"wait_timeout must be a finite number > 0; got {bad!r}"):
            eval_cb(world, tmp_path, wait_timeout=bad)


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
    monkeypatch.setattr(runners, "CANCEL_GRACE", 0.1)
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 900, 4)])  # one task of a few seconds
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


@pytest.mark.parametrize("tasks, grace", [([("slow", 300, 4), ("slow2", 300, 4)], runners.CANCEL_GRACE),
                                          ([("slow", 900, 4)], 0.1)], ids=["cancelled", "abandoned"])
def test_a_snapshot_cancelled_when_the_fit_fails_is_scored_by_the_resume(world, tmp_path, monkeypatch, tasks, grace):
    """A fit that fails (Ctrl-C, a preemption's SIGTERM, an OOM) while step 2's written snapshot
    is being scored leaves it on disk unscored, with no error line: the resume scores it, as
    it would after a SIGKILL. Cancelled between two tasks, or abandoned inside one task that
    outlives the grace (it was an error line, so the resume never scored it)."""
    monkeypatch.setattr(runners, "CANCEL_GRACE", grace)
    slow = write_cache(world, tmp_path / "slow-cache", tasks)

    class Preempted(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                deadline = time.time() + 60
                while not list(tmp_path.glob("d/*/snapshots/step-00000002")) and time.time() < deadline:
                    time.sleep(0.01)  # written, and now being scored
                raise KeyboardInterrupt

    def callback():
        return eval_cb(world, tmp_path, cache=slow, scoring={**SCORING, "anchors_per_forward": 1}, keep_last=2)

    first = callback()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, filename="{step}")
    with pytest.warns(UserWarning, match=r"the fit stopped on KeyboardInterrupt: the snapshots of steps \[2\] are in"):
        with pytest.raises(SystemExit):  # Lightning's answer to Ctrl-C
            fit(world, tmp_path, [first, Preempted(), ckpt], max_steps=6, enable_checkpointing=True)
    assert records(tmp_path / "d") == [] and first.errors == 0
    second = callback()
    fit(world, tmp_path, [second], max_steps=4, ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))
    lines = records(tmp_path / "d")
    assert [(r["step"], "tasks" in r) for r in lines] == [(2, True), (4, True)] and second.errors == 0
    assert_clean(tmp_path / "d", second.reports)


def test_external_runner_without_a_watcher_says_so_and_does_not_wait_an_hour(world, tmp_path, monkeypatch):
    monkeypatch.setattr(runners, "WATCHER_TIMEOUT", 1.5)
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
    monkeypatch.setattr(runners, "WATCHER_TIMEOUT", 3.0)
    cb = eval_cb(world, tmp_path, runner="external", keep_last=4, busy="queue", max_pending=4)

    class Timing(pl.Callback):  # the run outlives WATCHER_TIMEOUT; then the time fit spends at its end
        ended = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                time.sleep(3.5)

        def on_train_end(self, trainer, pl_module):
            self.ended = time.monotonic()

    timing = Timing()
    with pytest.warns(UserWarning, match=r"no `dflash-callbacks watch` has written to .* for 3 s"):
        fit(world, tmp_path, [timing, cb], max_steps=8)
    assert time.monotonic() - timing.ended < 3.0  # it took 9 s and more: 3 s for each snapshot after the first
    assert [(r["step"], "no `dflash-callbacks watch`" in r["error"]) for r in records(tmp_path / "d")] == \
        [(2, True), (4, True), (6, True), (8, True)]


# ---------------------------------------------------------------- a wrong number is never logged


def overflowing_drafter(world: Path, folder: Path) -> Path:
    """Finite weights that overflow float16 (final norm weights of 1e5 > 65504, its largest value)."""
    paths = world_paths(world)
    from safetensors.torch import load_file

    state = load_file(str(paths["baseline"] / "model.safetensors"))
    state["norm.weight"] = torch.full_like(state["norm.weight"], 1e5)
    return save_drafter(folder, paths["config"], state)


def test_float16_overflow_is_an_error_and_never_a_score(world, tmp_path):
    paths = world_paths(world)
    service = ScoringService(ServiceSpec(str(paths["cache"]), str(paths["target"]), None,
                                         {**SCORING, "dtype": "float16"}))
    with pytest.raises(NonFiniteError, match=r"task 'long': the drafter's logits are NaN or Inf at \d+ of"):
        service.score_folder(overflowing_drafter(world, tmp_path / "big"))
    same = ScoringService(ServiceSpec(str(paths["cache"]), str(paths["target"]), None, SCORING))
    assert same.score_folder(tmp_path / "big").mean  # float32 takes it: the error was the overflow


def test_the_score_cli_refuses_nan_weights_and_overflow(world, tmp_path, capsys):
    paths = world_paths(world)
    from safetensors.torch import load_file

    state = load_file(str(paths["baseline"] / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    nan = save_drafter(tmp_path / "nan", paths["config"], state)
    args = ["score", "--cache", str(paths["cache"]), "--target", str(paths["target"]), "--budgets", "4",
            "--device", "cpu"]
    assert cli_main([*args, "--drafter", str(nan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "NaN or Inf weights in fc.weight" in err and "Traceback" not in err
    assert cli_main([*args, "--drafter", str(overflowing_drafter(world, tmp_path / "big")), "--dtype", "float16"]) == 2
    assert "logits are NaN or Inf" in capsys.readouterr().err


def test_float16_overflow_in_the_callback_is_an_error_line_not_a_row(world, tmp_path):
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "dtype": "float16"})

    class Blow(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            with torch.no_grad():
                pl_module.drafter.norm.weight.fill_(1e5)

    with pytest.warns(UserWarning, match="logits are NaN or Inf"):
        fit(world, tmp_path, [Blow(), cb], max_steps=2)
    (line,) = records(tmp_path / "d")
    assert "tasks" not in line and "NonFiniteError" in line["error"] and cb.reports == []


def cache_with(world: Path, folder: Path, hidden_fill=None, prompt_len: int = 4, tokens: int = 20) -> Path:
    write_cache(world, folder, [("t", tokens, prompt_len)])
    if hidden_fill is not None:
        from dflash_callbacks.cache.format import HiddenStateCache

        task = HiddenStateCache(folder).task("t")
        hidden = task.hidden.clone()
        hidden[3] = hidden_fill
        info = HiddenStateCache(folder)
        write_task(folder, "t", task.input_ids, hidden, prompt_len)
        assert info.layer_ids  # the manifest stays valid: write_task records the new size and sha256
    return folder


def test_nan_hidden_states_in_the_cache_are_refused_before_training(world, tmp_path):
    cb = eval_cb(world, tmp_path, cache=cache_with(world, tmp_path / "nan-cache", hidden_fill=float("nan")))
    refused_before_training(world, tmp_path, cb, r"task 't': .* holds NaN or Inf hidden states at 1 of 20 positions")


def test_a_target_head_of_another_vocabulary_or_width_is_refused_before_training(world, tmp_path):
    paths = world_paths(world)
    vocab, hidden = paths["config"].vocab_size, paths["config"].hidden_size
    for name, shape, message in [
        ("wide-vocab", (vocab + 4, hidden), rf"the target's lm_head has {vocab + 4} rows but the drafter's vocabulary is {vocab}"),
        ("other-width", (vocab, hidden * 2), rf"the target's lm_head is {hidden * 2} wide but the drafter's hidden size is {hidden}"),
    ]:
        target = tmp_path / name
        target.mkdir()
        save_file({"model.embed_tokens.weight": torch.randn(*shape), "lm_head.weight": torch.randn(*shape)},
                  str(target / "model.safetensors"))
        (target / "config.json").write_text("{}")
        refused_before_training(world, tmp_path, eval_cb(world, tmp_path, target=target), message)


def test_the_baseline_is_cached_per_target_head_and_every_report_names_its_target(random_target_dir, zlab_tiny, tmp_path):
    """Two real tiny targets of the same shapes and other weights (a re-trained target): the
    baseline scored against one is never taken from the shared baseline cache for the other;
    each report names the head it was scored with, and two reports of two heads are not
    comparable (`scoring.basis`). A report written before the target was recorded still loads and compares."""
    other = save_random_target(tmp_path / "other-target", seed=1)
    cache = extract_cache(random_target_dir, tmp_path / "cache", [Task("t", "def f(x):")], [1, 2, 4],
                          max_new_tokens=12, chat_template=False, progress=False)

    def baseline(target: Path, cache_dir: str) -> EvalReport:
        spec = ServiceSpec(str(cache.path), str(target), str(zlab_tiny), SCORING, str(tmp_path / cache_dir))
        return ScoringService(spec).baseline()

    first, second = baseline(random_target_dir, "bc"), baseline(other, "bc")
    assert first.cache["target"] == head_fingerprint(random_target_dir) != second.cache["target"] == head_fingerprint(other)
    assert len(list((tmp_path / "bc").glob("baseline-*.json"))) == 2  # one per head, none reused
    assert baseline(other, "bc").to_dict() == second.to_dict()  # each head's is reused
    assert baseline(other, "fresh").tasks == second.tasks
    def differences(a: EvalReport, b: EvalReport) -> list[str]:
        return Basis.of_report(a).differences(Basis.of_report(b))

    assert any(d.startswith("target head ") for d in differences(second, first))
    old = EvalReport.from_dict({**first.to_dict(), "cache": {k: v for k, v in first.cache.items() if k != "target"}})
    assert differences(second, old) == [] and differences(first, first) == []


def test_a_damaged_cache_or_a_task_with_no_anchor_is_refused_before_training(world, tmp_path):
    truncated = shutil.copytree(world / "cache", tmp_path / "truncated")
    data = (truncated / "long.safetensors").read_bytes()
    (truncated / "long.safetensors").write_bytes(data[:-10])
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, cache=truncated),
                            r"task 'long': file .* is \d+ bytes but the manifest says \d+: truncated")
    flipped = shutil.copytree(world / "cache", tmp_path / "flipped")
    data = bytearray((flipped / "short.safetensors").read_bytes())
    data[-5] ^= 0x01
    (flipped / "short.safetensors").write_bytes(bytes(data))
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, cache=flipped),
                            r"task 'short': file .* has sha256 .* but the manifest says")
    no_anchor = cache_with(world, tmp_path / "no-anchor", prompt_len=19, tokens=20)
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, cache=no_anchor),
                            r"cache task 't' has no anchor to score: 19 prompt tokens and 20 in all")


def test_a_truncated_baseline_or_target_weight_file_is_listed_before_training(world, tmp_path):
    """The drafter's target and baseline are read by the preflight: a damaged safetensors file is
    a line naming it, never a raw SafetensorError from setup."""
    damaged = {}
    for name in ("baseline", "target"):
        damaged[name] = shutil.copytree(world / name, tmp_path / f"damaged-{name}") / "model.safetensors"
        damaged[name].write_bytes(damaged[name].read_bytes()[:100])
    cb = eval_cb(world, tmp_path, target=damaged["target"].parent, baseline=damaged["baseline"].parent)
    refused_before_training(world, tmp_path, cb, rf"(?s)target: {re.escape(str(damaged['target']))} is not a readable "
                            rf"safetensors file \(truncated or corrupt\?\).*\n  baseline .*{re.escape(str(damaged['baseline']))} is not")


def test_a_memory_budget_too_small_for_one_block_is_refused_before_training(world, tmp_path):
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "max_memory_gib": 0.001})
    refused_before_training(world, tmp_path, cb, r"max_memory_gib=0.001 is below what scoring needs at the least")


def test_a_device_that_is_not_here_is_refused_before_training(world, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA has the device")
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, device="cuda"),
                            r"scoring.device='cuda', but CUDA is not available here")


# ---------------------------------------------------------------- the stop callback, linked at setup


def test_a_monitor_that_is_not_scored_fails_before_training(world, tmp_path):
    counter = CountBatches()
    stop = TrailingBaselineStop(monitor="ddtree@8/live")
    with pytest.raises(ValueError, match=r"monitors 'ddtree@8/live', but 'dflash' scores only \['vanilla', 'ddtree@4'\]"):
        fit(world, tmp_path, [eval_cb(world, tmp_path), stop, counter], max_steps=4)
    assert counter.batches == 0


def test_the_stop_callback_finds_its_eval_callback_or_says_why_not(world, tmp_path):
    with pytest.raises(ValueError, match="needs a DrafterEvalCallback in trainer.callbacks"):
        fit(world, tmp_path, [TrailingBaselineStop(monitor="ddtree@4/live")], max_steps=1)
    two = [eval_cb(world, tmp_path), eval_cb(world, tmp_path, name="other", scoring={**SCORING, "topk": [2]})]
    with pytest.raises(ValueError, match=r"several DrafterEvalCallbacks \['dflash', 'other'\]; name the one"):
        fit(world, tmp_path, [*two, TrailingBaselineStop(monitor="ddtree@4/live")], max_steps=1)
    with pytest.raises(ValueError, match=r"eval_callback='nope'\): no DrafterEvalCallback of that name"):
        fit(world, tmp_path, [*two, TrailingBaselineStop(monitor="ddtree@4/live", eval_callback="nope")], max_steps=1)
    stop = TrailingBaselineStop(monitor="top@2/live", eval_callback="other", min_ratio=0.01, verbose=False)
    two = [eval_cb(world, tmp_path / "a"), eval_cb(world, tmp_path / "b", name="other", scoring={**SCORING, "topk": [2]})]
    fit(world, tmp_path, [*two, stop], max_steps=4)
    assert stop.source is two[1] and [s for s, _ in stop.history] == [2, 4]


@pytest.mark.parametrize("with_stop", [False, True])
def test_two_eval_callbacks_of_one_name_are_refused_before_training(world, tmp_path, with_stop):
    """Two eval callbacks on two caches, both left at name="dflash": their numbers were logged
    under the same keys (callback_metrics held whichever came last), and a stop told to follow
    "dflash" was told to name the one it follows. The checkpoint key is the name alone (a path
    spelled otherwise on resume lost the state), so Lightning refuses them when the Trainer is
    made, naming the key that must be unique."""
    other = write_cache(world, tmp_path / "other-cache", [("t", 20, 4)])
    counter = CountBatches()
    callbacks = [eval_cb(world, tmp_path), eval_cb(world, tmp_path, cache=other), counter]
    callbacks += [TrailingBaselineStop(monitor="ddtree@4/live", eval_callback="dflash")] if with_stop else []
    with pytest.raises(RuntimeError, match=r"more than one stateful callback of type `DrafterEvalCallback`.*"
                                           r"state_key` must be unique"):
        fit(world, tmp_path, callbacks, max_steps=4)
    assert counter.batches == 0
