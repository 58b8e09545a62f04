"""Where scoring runs: one background thread per run takes jobs (snapshots) in order, waits for its copy
to land, writes it to the run folder when snapshots are kept, has a scorer score it (`SCORERS`: "thread",
"process", "external"), and hands back exactly one outcome per job, success or failure; first of all the
baseline's. A report (or baseline) that does not stand on the run's basis (`scoring.basis`: another cache,
target head, block size, tasks or scoring field) is a failure, never a number.

The pending count (jobs submitted and not yet handed back) changes in one place: `poll`. Jobs run one at a
time, oldest first, so a snapshot is only ever pruned from disk once it has been scored.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ...scoring.basis import Basis
from ...scoring.report import EvalReport
from ...scoring.scorer import Cancelled
from ...scoring.service import ServiceSpec
from ..run_folder import RunFolder
from .external_scorer import ExternalScorer
from .jobs import BaselineOutcome, Job, Outcome, SnapshotOutcome, describe
from .process_scorer import ProcessScorer
from .thread_scorer import ThreadScorer

CANCEL_GRACE = 30.0
"""Seconds `close` waits, after cancelling, for the runner's thread to stop (a thread scorer
stops between tasks); what it still holds then is recorded as not scored."""
SCORERS = {"thread": ThreadScorer, "process": ProcessScorer, "external": ExternalScorer}
Prepare = Callable[[EvalReport, float, "EvalReport | None"], tuple["dict | None", "tuple[dict, str | None] | None"]]


class BackgroundRunner:
    def __init__(self, kind: str, spec: ServiceSpec, run: RunFolder, keep_last: int, basis: Basis,
                 notes: Callable[[EvalReport], list[str]] | None = None, prepare: Prepare | None = None):
        """`notes(baseline)`: the lines the run is told once the baseline's report is in (the stops' setup
        warnings, `reports.unresolvable`); `prepare(report, seconds, baseline)`: what the publisher wants made
        of each report (its comparison with the baseline, its results.jsonl line). Both are made on this
        runner's thread: they may take a while."""
        self.run, self.keep_last, self.basis, self.has_baseline = run, keep_last, basis, spec.baseline is not None
        self._notes, self._prepare = notes, prepare
        self._baseline_failed = False
        self._baseline_report: EvalReport | None = None  # to compare each report with, on this thread
        self._cancel, self._closing = threading.Event(), threading.Event()
        self._cancel_reason = "scoring was cancelled"
        self._keep = False  # closed after training failed: snapshots in memory are written for a resume
        self.scorer = SCORERS[kind](spec, run, self._cancel, self._closing)
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._pending: dict[int, str] = {}  # step -> snapshot_id: submitted, not yet handed back by poll
        self._unscored: set[Path] = set()  # snapshot folders on disk queued as jobs (a resume's), not yet scored
        self._lock = threading.Lock()
        self._abandoned = False  # closed while its thread was still busy: nothing more goes out
        self._thread = threading.Thread(target=self._loop, name="dflash-eval", daemon=True)
        self._thread.start()

    # ---- training thread
    def submit(self, job: Job) -> None:
        with self._lock:
            self._pending[job.step] = job.snapshot_id
            if job.folder is not None:
                self._unscored.add(job.folder)
        self._inbox.put(job)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def pending_steps(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    def poll(self) -> list[Outcome]:
        """Every outcome produced since the last poll, oldest first."""
        out = []
        while True:
            try:
                outcome = self._outbox.get_nowait()
            except queue.Empty:
                return out
            if isinstance(outcome, SnapshotOutcome):
                with self._lock:
                    self._pending.pop(outcome.step, None)
            out.append(outcome)

    def close(self, wait: bool, timeout: float, reason: str, keep: bool = False) -> None:
        """With `wait`, let every submitted job finish within `timeout` seconds; whatever is
        left then (or everything, without `wait`) ends as an error outcome saying `reason`.
        With `keep` (training failed), a snapshot still in memory is written to the run folder
        instead, its outcome `on_disk`: a resume scores it, as if a kill had left it there."""
        self._cancel_reason, self._keep = reason, keep
        self._inbox.put(None)
        if wait:
            self._closing.set()
            self._thread.join(timeout)
        self._cancel.set()
        self._thread.join(CANCEL_GRACE)
        if self._thread.is_alive():  # stuck inside one task: its jobs end here, and it hands back nothing more
            self._abandon(f"{reason}; the scorer did not stop within {CANCEL_GRACE:g} s")
        self.scorer.close()

    def _abandon(self, reason: str) -> None:
        if self._keep:  # the jobs the stuck thread has not taken: written here, for a resume
            while True:
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None and job.snapshot is not None:
                    self._write_for_resume(job)
                    job.snapshot.release()
            self._inbox.put(None)  # the thread ends after its task
        with self._lock:
            self._abandoned = True
            ready = []
            while not self._outbox.empty():
                ready.append(self._outbox.get_nowait())
            handed = {o.step for o in ready if isinstance(o, SnapshotOutcome)}
            ready += [SnapshotOutcome(step=step, snapshot_id=snapshot_id, error=f"not scored: {reason}",
                                      on_disk=self._written(step, snapshot_id))
                      for step, snapshot_id in sorted(self._pending.items()) if step not in handed]
            for outcome in ready:
                self._outbox.put(outcome)

    def _write_for_resume(self, job: Job) -> Path | None:
        """`keep`: a cancelled job's snapshot still in memory, written to the run folder (None when
        writing fails: its outcome is then an error line)."""
        if job.folder is None and job.snapshot is not None:
            try:
                job.folder = self.run.write_snapshot(job.snapshot)
            except Exception:
                return None
        return job.folder if job.folder is not None and job.folder.exists() else None

    def _written(self, step: int, snapshot_id: str) -> Path | None:
        """The snapshot folder of this step and id, when it is on disk."""
        folder = self.run.snapshot_path(step)
        return folder if self.run.snapshot_id(folder) == snapshot_id else None

    def _put(self, outcome: Outcome) -> None:
        with self._lock:
            if not self._abandoned:
                self._outbox.put(outcome)

    # ---- background thread
    def _loop(self) -> None:
        if self.has_baseline:
            self._baseline(late=False)
        while (job := self._inbox.get()) is not None:
            if self._baseline_failed:
                self._baseline(late=True)
            self._put(self._run(job))
        while True:  # after close: a job still queued gets its outcome too
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._put(self._run(job))

    def _pruned(self, folder: Path) -> None:
        """A snapshot found on disk is done: keep_last holds again (a resume with a smaller keep_last),
        unless it is left for a resume to score."""
        with self._lock:
            self._unscored.discard(folder)
            unscored = set(self._unscored)
        if not self._cancel.is_set():
            try:
                self.run.prune(self.keep_last, unscored=unscored)
            except OSError:
                pass  # a folder that can not be removed now is removed by the next prune

    def _baseline(self, late: bool) -> None:
        """One BaselineOutcome (a report on this run's basis, or an error); `late`: after a
        failure, only when the scorer has news (a watcher scored it since)."""
        started = time.monotonic()
        try:
            report = self.scorer.late_baseline() if late else self.scorer.baseline()
            if late and report is None:
                return
            problems = [] if report is None else self.basis.mismatches(report, "the baseline")
            if problems:
                raise RuntimeError("; ".join(problems))
            self._baseline_report = report
            self._put(BaselineOutcome(report=report, seconds=time.monotonic() - started, notes=self._notes_on(report)))
            self._baseline_failed = False
        except Exception as e:
            self._put(BaselineOutcome(error=describe(e), seconds=time.monotonic() - started))
            self._baseline_failed = True

    def _notes_on(self, report: EvalReport | None) -> list[str]:
        if report is None or self._notes is None:
            return []
        try:
            return self._notes(report)
        except Exception as e:  # a note that can not be made is one line too, never a failed baseline
            return [f"the notes on the baseline's report failed: {describe(e)}"]

    def _run(self, job: Job) -> SnapshotOutcome:
        started = time.monotonic()
        try:
            if self._cancel.is_set():
                raise Cancelled(self._cancel_reason)
            if job.snapshot is not None:
                job.snapshot.wait()  # the copy into host buffers has landed (CUDA: a side stream)
            if job.snapshot is not None and self.keep_last > 0:
                try:
                    self.run.prune(self.keep_last - 1)  # every snapshot on disk is scored: jobs run in order
                    job.folder = self.run.write_snapshot(job.snapshot)
                except OSError as e:
                    raise RuntimeError(f"writing the snapshot failed: {describe(e)}") from e
            report = self.scorer.score(job)
            if (report.step, report.snapshot_id) != (job.step, job.snapshot_id):
                raise RuntimeError(f"the report names step {report.step} snapshot {report.snapshot_id}, but step "
                                   f"{job.step} snapshot {job.snapshot_id} was scored; not recorded")
            problems = self.basis.mismatches(report, f"the report of step {job.step}")
            if problems:
                raise RuntimeError("; ".join(problems) + "; not recorded")
            outcome = SnapshotOutcome(step=job.step, snapshot_id=job.snapshot_id, report=report)
        except Cancelled:
            on_disk = self._write_for_resume(job) if self._keep else \
                job.folder if job.folder is not None and job.folder.exists() else None
            outcome = SnapshotOutcome(step=job.step, snapshot_id=job.snapshot_id, error=f"not scored: {self._cancel_reason}",
                                      on_disk=on_disk)
        except Exception as e:
            outcome = SnapshotOutcome(step=job.step, snapshot_id=job.snapshot_id, error=describe(e))
        finally:
            if job.snapshot is not None:
                try:
                    job.snapshot.wait()  # also when not scored: no copy may still be landing in a reused buffer
                except Exception as e:  # a broken device: this job fails, the runner goes on
                    outcome = SnapshotOutcome(step=job.step, snapshot_id=job.snapshot_id,
                                              error=f"waiting for the snapshot's copy failed: {describe(e)}")
                job.snapshot.release()
            elif job.folder is not None and job.folder.parent == self.run.snapshots_dir:
                self._pruned(job.folder)
        outcome.seconds = time.monotonic() - started
        if outcome.report is not None and self._prepare is not None:
            outcome.versus, outcome.record = self._prepare(outcome.report, outcome.seconds, self._baseline_report)
        return outcome
