"""Processes killed under a run, with real signals: a SIGKILLed training process takes its scoring worker
with it; the worker leaves a Ctrl-C and a SIGTERM to the training process; a run with the external runner
SIGKILLed and resumed adopts the report its watcher wrote meanwhile; a fit stopped by Ctrl-C leaves the
snapshot being scored to the resume; a SIGKILLed extraction resumes without redoing a task; a SIGKILLed
`watch --checkpoints` started again scores nothing twice and loses nothing. Every run folder goes through
the audit (runs.py). (A killed scoring worker and a SIGKILLed training run resumed, with every adapter:
contract/test_faults_every_adapter.py.)"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.cache.format import HiddenStateCache
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.engine.runners import background, jobs, process_scorer
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.model import save_drafter
from dflash_callbacks.scoring.service import ServiceSpec

from checkpoint_watch import assert_same, results, scored, spawn_watcher, trained, wait_for, watch_args
from runs import assert_clean, audit, reads_update_atime, records, wait_until
from suite_paths import REPO, SCRIPTS
from synthetic import build_world
from train_run import SCORING, eval_cb, fit, shared_world, world_paths, write_cache
from wandb_records import read_run


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


@pytest.fixture(scope="module")
def watched_world(tmp_path_factory):
    """The world of `watch --checkpoints`: its drafter, to save as if training moved it."""
    return build_world(tmp_path_factory.mktemp("watch-world"))


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


def command_line(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


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
    precise, workers = reads_update_atime(tmp_path), []

    def worker_started() -> bool:
        workers[:] = [pid for pid in worker_pids(proc.pid) if b"runners.process_worker" in command_line(pid)]
        return bool(workers)

    def scoring() -> bool:  # a snapshot's weights read since they were written (where atime records reads)
        for weights in (tmp_path / "run").glob("dflash/*/snapshots/step-*/model.safetensors"):
            try:
                written = weights.stat()
            except OSError:  # pruned meanwhile
                continue
            if written.st_atime_ns > written.st_mtime_ns or not precise:
                return True
        return False

    try:
        wait_until(worker_started, what="a scoring worker of the training process")
        wait_until(scoring, what="the scoring worker reading a snapshot")
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not any(alive(pid) for pid in workers), 15,
               "the end of the scoring worker with its SIGKILLed training process")  # it must not outlive it


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
    scorer = process_scorer.ProcessScorer(spec, None, threading.Event(), threading.Event())

    def interrupt():  # as soon as the worker ignores them (before the fix it never did: nothing is sent)
        wait_until(lambda: scorer.process and ignores(scorer.process.pid, signal.SIGINT, signal.SIGTERM),
                   what="the worker ignoring SIGINT and SIGTERM")
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(scorer.process.pid, sig)
            sent.append(sig)

    sent = []
    thread = threading.Thread(target=interrupt)  # the worker is the scoring thread's: it dies with that thread
    thread.start()
    try:
        baseline = scorer.baseline()
        thread.join()
        again = scorer.score(jobs.Job(0, "x", folder=paths["baseline"]))
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
        wait_until(lambda: list(root.glob("dflash/*/snapshots/step-00000002/snapshot.json"))
                   and (root / "ckpt" / "step=2.ckpt").is_file(), what="the snapshot and the checkpoint of step 2")
        snaps = list(root.glob("dflash/*/snapshots/step-00000002/snapshot.json"))
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


@pytest.mark.parametrize("tasks, grace", [([("slow", 300, 4), ("slow2", 300, 4)], background.CANCEL_GRACE),
                                          ([("slow", 900, 4)], 0.1)], ids=["cancelled", "abandoned"])


def test_a_snapshot_cancelled_when_the_fit_fails_is_scored_by_the_resume(world, tmp_path, monkeypatch, tasks, grace):
    """A fit that fails (Ctrl-C, a preemption's SIGTERM, an OOM) while step 2's written snapshot
    is being scored leaves it on disk unscored, with no error line: the resume scores it, as
    it would after a SIGKILL. Cancelled between two tasks, or abandoned inside one task that
    outlives the grace (it was an error line, so the resume never scored it)."""
    monkeypatch.setattr(background, "CANCEL_GRACE", grace)
    slow = write_cache(world, tmp_path / "slow-cache", tasks)

    class Preempted(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:  # once step 2's snapshot is written, and now being scored
                wait_until(lambda: list(tmp_path.glob("d/*/snapshots/step-00000002")), what="the snapshot of step 2")
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


def test_killed_extraction_resumes_without_redoing_finished_tasks(random_target_dir, tmp_path, caplog):
    tasks_file = tmp_path / "tasks.yaml"
    tasks_file.write_text("tasks:\n" + "".join(f"  - name: t{i}\n    prompt: Task number {i}.\n" for i in range(3)))
    out = tmp_path / "cache"
    argv = ["--target", str(random_target_dir), "--out", str(out), "--tasks", str(tasks_file),
            "--layer-ids", "1,2", "--max-new-tokens", "150"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_callbacks.cli", "extract", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest = out / "manifest.json"
    try:
        wait_until(lambda: proc.poll() is not None or (manifest.is_file() and json.loads(manifest.read_text())["tasks"]),
                   what="the first task in the manifest")
        assert proc.poll() is None, f"extraction ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()

    done = json.loads(manifest.read_text())["tasks"]
    assert [t["name"] for t in done] == ["t0"]
    for path in out.glob("*.safetensors"):  # whatever is visible is a complete file
        with safe_open(str(path), framework="pt") as f:
            assert f.get_tensor("input_ids").shape[0] == f.get_tensor("hidden").shape[0]
    first = (out / "t0.safetensors").stat()

    caplog.set_level(logging.INFO, logger="dflash_callbacks.cache.extract")
    assert cli_main(["extract", *argv]) == 0
    assert "t0: already in the cache, skipped" in caplog.text
    assert "t1: extracted" in caplog.text and "t0: extracted" not in caplog.text
    again = (out / "t0.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    cache = HiddenStateCache(out)
    assert cache.task_names == ["t0", "t1", "t2"]
    cache.verify()
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "t0.safetensors", "t1.safetensors", "t2.safetensors"]


def test_a_sigkilled_watcher_restarted_scores_nothing_twice_and_loses_nothing(watched_world, tmp_path):
    """Killed (SIGKILL) while it scores, with a torn line at the end of results.jsonl as a kill in
    an append leaves; the trainer saves one more checkpoint meanwhile. The watcher started again
    reopens its run folder, reads results.jsonl back and scores exactly the steps without a line,
    into the same W&B run id; the stop's patience counts the reports of before the kill."""
    root, out = tmp_path / "ckpts", tmp_path / "ckpts" / "dflash-eval"
    for step in (2, 4, 6, 8, 10):
        save_drafter(root / f"step_{step}", watched_world.config, trained(watched_world, step))
    log = tmp_path / "watch.log"
    args = watch_args(watched_world, root, "--settle-seconds", "0", "--poll-seconds", "0.1", "--min-ratio", "5",
                      "--patience", "5", "--monitor", "ddtree@4/live", "--wandb-project", "dflash-watch", baseline=True)
    proc = spawn_watcher(args, log)
    try:
        results_path = out / "results.jsonl"
        wait_for(lambda: results_path.is_file() and len(results_path.read_text().splitlines()) >= 2, proc, log)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    before = [json.loads(line)["step"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert 2 <= len(before) < 5 and before == sorted(before)
    with open(out / "results.jsonl", "a") as f:
        f.write('{"step": 12, "drafter": "step 12", "tas')  # torn: a kill in the middle of an append
    wandb_id = RunFolder(out).about()["wandb_id"]
    save_drafter(root / "step_12", watched_world.config, trained(watched_world, 12))
    assert not (out / "STOP.json").exists()

    proc = spawn_watcher([*args, "--once"], tmp_path / "again.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "again.log").read_text()[-4000:]
    again = (tmp_path / "again.log").read_text()
    assert f"resuming run dflash-eval in {out}: {len(before)} reports" in again
    reports, errors = results(out)
    assert sorted(reports) == [2, 4, 6, 8, 10, 12] and not errors
    assert [json.loads(line)["step"] for line in (out / "results.jsonl").read_text().splitlines()] == \
        [2, 4, 6, 8, 10, 12]
    assert audit(out) == {"runs": 1, "reports": 6, "lost": 0, "duplicated": 0, "mismatched": 0}
    for step in (2, 12):
        assert_same(reports[step], scored(watched_world, root / f"step_{step}", tmp_path))
    # min_ratio 5: every report trails; the fifth in a row (counted across the kill) stops, and stands
    stop = json.loads((out / "STOP.json").read_text())
    assert stop["stop"] is True and stop["monitor"] == "ddtree@4/live"
    assert "stopping at step 10: ddtree@4/live" in stop["reason"]
    assert "5 reports in a row (steps 2-10)" in stop["reason"]
    assert f"watch: STOP: {stop['reason']} (written to {out / 'STOP.json'})" in again
    assert "dflash: stopping at step 12" in again and again.count("watch: STOP") == 1
    assert RunFolder(out).about()["wandb_id"] == wandb_id
    killed, restarted = sorted((out / "wandb").glob("offline-run-*"))  # one W&B run id, an offline folder per start
    assert killed.name.endswith(wandb_id) and restarted.name.endswith(wandb_id)
    rows = [r for r in read_run(restarted)["history"] if "dflash/step" in r]
    assert [(r["_step"], r["dflash/step"]) for r in rows] == [(s, s) for s in (2, 4, 6, 8, 10, 12) if s not in before]
