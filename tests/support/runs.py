"""Reading back what a DrafterEvalCallback run wrote, auditing it, and the faults the fault
tests of every entry point inflict on it.

`audit(dirpath)` is the suite's count of reports lost, duplicated or mismatched: every
fault test passes its run folders through it, conftest.py adds the counts up and prints
them at the end of the session, and any non-zero count fails the session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from dflash_callbacks.engine.run_folder import RunFolder, is_run_folder
from dflash_callbacks.scoring.report import EvalReport

AUDIT = {"runs": 0, "reports": 0, "lost": 0, "duplicated": 0, "mismatched": 0}
DEADLINE = 300.0
"""Seconds a test waits for work done in another thread or process (scoring, a worker's start, a watcher):
generous enough for a busy machine, whose load stretches that work tenfold; the wait ends at the event."""


def wait_until(condition, timeout: float = DEADLINE, what: str = "the condition", every: float = 0.02) -> None:
    """Poll `condition()` until it holds; AssertionError naming `what` after `timeout` seconds (a deadline
    generous enough for a busy machine: a test waits for the event itself, never for a guess of its time)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        time.sleep(every)


def run_dirs(dirpath: Path) -> list[Path]:
    """The run folders under a callback's dirpath, oldest first."""
    return sorted(p for p in Path(dirpath).iterdir() if p.is_dir() and is_run_folder(p))


def run_dir(dirpath: Path) -> Path:
    """The one run folder under `dirpath`."""
    runs = run_dirs(dirpath)
    assert len(runs) == 1, f"expected one run folder in {dirpath}, found {[r.name for r in runs]}"
    return runs[0]


def records(dirpath: Path) -> list[dict]:
    """Every line of the one run's results.jsonl, as parsed JSON."""
    path = run_dir(dirpath) / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def audit(folder: Path, scored_elsewhere: list[EvalReport] = ()) -> dict:
    """Check one run folder (or every run under a dirpath): at most one report per step
    and one line per (step, snapshot) in results.jsonl (an error line of a step may precede
    the report of a later snapshot of that step: a resume that reached it again); each report names the snapshot id that snapshot.json of its step
    records (when still on disk); each watcher report of a snapshot (its step and id) ended
    in results.jsonl as a report or an error, and each report in `scored_elsewhere`
    (e.g. cb.reports) is in results.jsonl. Adds to AUDIT; returns the
    counts of this folder."""
    folders = [Path(folder)] if is_run_folder(folder) else run_dirs(folder)
    counts = {"runs": len(folders), "reports": 0, "lost": 0, "duplicated": 0, "mismatched": 0}
    recorded_anywhere = set()
    for path in folders:
        run = RunFolder(path)
        results = run.read_results()
        counts["reports"] += len(results.reports)
        steps = [r.step for r in results.reports]
        lines = [(r.step, r.snapshot_id) for r in results.reports] + [(e["step"], e.get("snapshot_id"))
                                                                      for e in results.errors]
        counts["duplicated"] += len(steps) - len(set(steps)) + len(lines) - len(set(lines))
        recorded = {(r.step, r.snapshot_id) for r in results.reports}
        recorded_anywhere |= recorded
        ended = recorded | {(e["step"], e.get("snapshot_id")) for e in results.errors}
        for report in results.reports:
            on_disk = run.snapshot_path(report.step)
            if on_disk.is_dir() and run.snapshot_id(on_disk) != report.snapshot_id:
                counts["mismatched"] += 1
        for step, file in run.list_reports():
            found = run.read_report(file)
            finished = isinstance(found, EvalReport) and found.step == step and found.snapshot_id is not None
            if finished and (step, found.snapshot_id) not in ended:
                counts["lost"] += 1
    counts["lost"] += sum((r.step, r.snapshot_id) not in recorded_anywhere for r in scored_elsewhere)
    for key, value in counts.items():
        AUDIT[key] += value
    return counts


def assert_clean(folder: Path, scored_elsewhere: list[EvalReport] = ()) -> dict:
    counts = audit(folder, scored_elsewhere)
    assert counts["lost"] == counts["duplicated"] == counts["mismatched"] == 0, counts
    return counts


def reads_update_atime(folder: Path) -> bool:
    """Whether this filesystem records reads in atime (relatime does, for a file not read
    since its last write); noatime mounts do not."""
    probe = folder / "atime-probe"
    probe.write_bytes(b"x")
    os.utime(probe, ns=(probe.stat().st_mtime_ns - 10**9, probe.stat().st_mtime_ns))
    probe.read_bytes()
    return probe.stat().st_atime_ns > probe.stat().st_mtime_ns


def kill_after_reports(cmd: list[str], dirpath: Path, log: Path, reports: int = 3, timeout: float = DEADLINE) -> Path:
    """Runs `cmd`, a training script whose evaluation writes its runs under `dirpath`, and SIGKILLs it
    once a results.jsonl there holds `reports` lines; returns that file. Fails, with the end of the
    script's output (`log`), when the script ends first or no such file comes within `timeout` s."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    found: list[Path] = []

    def reported() -> bool:
        found[:] = [p for p in sorted(Path(dirpath).glob("*/results.jsonl")) if p.read_text().count("\n") >= reports]
        return bool(found) or proc.poll() is not None

    try:
        try:
            wait_until(reported, timeout, f"{reports} reports", every=0.1)
        except AssertionError:
            pass  # said below, with the script's output
        assert proc.poll() is None and found, \
            f"the training run ended early or wrote no {reports} reports:\n{Path(log).read_text()[-4000:]}"
        results_path = found[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return results_path


def tear_as_a_kill_would(results_path: Path) -> Path:
    """What a kill in the middle of an append and of a snapshot write leaves in a run folder: a torn
    last line in results.jsonl (no newline) and a half-written snapshot folder, which it returns."""
    with open(results_path, "a") as f:
        f.write('{"step": 999998, "drafter": "step 999998", "tas')
    stale = results_path.parent / "snapshots" / ".step-99999998.tmp-deadbeef"
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 100)
    return stale


def unwritable_results_for_a_while(source) -> list[int]:
    """Subscribes to `source` (an eval callback or evaluator): after its first report a folder takes the
    place of results.jsonl, so every append fails; after the third the file is put back. Returns the
    steps of the reports seen, as they come."""
    seen = []

    def disk(report, baseline):
        seen.append(report.step)
        path = source.run.results_path
        if len(seen) == 1:
            path.rename(path.with_name("saved.jsonl"))
            path.mkdir()
        elif len(seen) == 3:
            path.rmdir()
            path.with_name("saved.jsonl").rename(path)

    source.subscribe(disk)
    return seen


def zero_task_files(cache: Path) -> None:
    """A disk going bad under a cache: its task files zeroed, the same size (the manifest still reads, the
    files do not)."""
    for file in Path(cache).glob("*.safetensors"):
        file.write_bytes(b"\0" * file.stat().st_size)


class OnFirstReport:
    """Subscribed to `source` (an eval callback or evaluator): runs `action` once, on the training thread,
    when its first report is published; `at` is that report's step."""

    def __init__(self, source, action):
        self.action, self.at = action, None
        source.subscribe(self)

    def __call__(self, report, baseline):
        if self.at is None:
            self.at = report.step
            self.action()
