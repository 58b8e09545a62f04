"""Where scoring runs. One background thread per run takes jobs (snapshots) in order,
waits for its copy to land, writes it to the run folder when snapshots are kept, has a
scorer score it, and hands back exactly one outcome per job, success or failure; first
of all the baseline's. A report (or baseline) that does not stand on the run's basis
(`scoring.basis`: another cache, target head, block size, tasks or scoring field) is a
failure, never a number.

Scorers (one interface: `baseline()`, `late_baseline()`, `score(job)`, `close()`):
- "thread": the ScoringService in this process, on the runner's thread.
- "process": a worker process (a fresh Python that never imports the training script;
  its own CUDA context, e.g. on a spare GPU) scores the written snapshot. A worker that dies fails that job and is replaced for the next;
  a worker whose training process dies exits too (never an orphan).
- "external": `dflash-callbacks watch`, in another process or on another host sharing
  the folder, writes reports/step-XXXXXXXX.json; the scorer waits for the one whose
  snapshot_id is the job's. The watcher's baseline must be of the run's baseline
  weights; after a failure, the one a watcher's retry writes is taken (`late_baseline`).

The pending count (jobs submitted and not yet handed back) changes in one place: `poll`.
Jobs run one at a time, oldest first, so a snapshot is only ever pruned from disk once
it has been scored.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..files import file_version
from ..model import DFlashDrafter
from ..scoring.basis import Basis
from ..scoring.intervals import paired_comparison
from ..scoring.report import EvalReport
from ..scoring.scorer import Cancelled, NonFiniteError
from ..scoring.service import ScoringService, ServiceSpec, recorded_weights, weights_fingerprint
from .publish import results_record
from .run_folder import RunFolder, WatcherError
from .snapshot import Snapshot

WATCHER_TIMEOUT = 120.0
"""External runner: seconds without a watcher heartbeat after which a wait is said to have no watcher."""
POLL_SECONDS = 0.2
CANCEL_GRACE = 30.0
"""Seconds `close` waits, after cancelling, for the runner's thread to stop (a thread scorer
stops between tasks); what it still holds then is recorded as not scored."""
ANY_SNAPSHOT = object()
"""What `ExternalScorer._wait` takes for the baseline: a report of any snapshot id (a
baseline drafter folder may be a snapshot, whose report names its id)."""


@dataclass
class Job:
    """One snapshot to score: in memory (`snapshot`, written first when snapshots are kept),
    already on disk (`folder`: left unscored by a killed run, found on resume), or a checkpoint
    outside the run folder (`folder`, a trainer's folder or file, and `read`, which reads it
    when the job runs: `watch --checkpoints`; thread runner only), reported as `step` and
    `snapshot_id`."""

    step: int
    snapshot_id: str
    snapshot: Snapshot | None = None
    folder: Path | None = None
    read: Callable[[], DFlashDrafter] | None = None


@dataclass(kw_only=True)
class Outcome:
    report: EvalReport | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass(kw_only=True)
class SnapshotOutcome(Outcome):
    step: int
    snapshot_id: str
    on_disk: Path | None = None  # cancelled or abandoned with its snapshot (or checkpoint) here: a resume scores it
    versus: dict | None = None  # the report against the baseline (intervals.paired_comparison), made off the training thread
    record: tuple[dict, str | None] | None = None  # its results.jsonl line, and why the reader would refuse it (idem)


@dataclass(kw_only=True)
class BaselineOutcome(Outcome):
    notes: list[str] = field(default_factory=list)  # what the run is told of it, worked out off the training thread


class ScorerError(RuntimeError):
    """A failure already worded elsewhere (the worker's or the watcher's `describe`)."""


def describe(error: BaseException) -> str:
    """How every runner (and `watch`) words a failure: "ExceptionName: message"; a
    ScorerError keeps the words of the process that failed."""
    return str(error) if isinstance(error, ScorerError) else f"{type(error).__name__}: {error}"


def is_non_finite(error: str) -> bool:
    """Whether a failure (`describe`d, by any runner or a watcher) is NaN or Inf in the numbers."""
    return error.startswith(f"{NonFiniteError.__name__}:")


# ---------------------------------------------------------------- scorers


class ThreadScorer:
    """The ScoringService in this process, built on first use."""

    def __init__(self, spec: ServiceSpec, run: RunFolder, cancel: threading.Event, closing: threading.Event):
        self.spec, self.cancel = spec, cancel
        self.service: ScoringService | None = None

    def _service(self) -> ScoringService:
        if self.service is None:
            self.service = ScoringService(self.spec)
        return self.service

    def baseline(self) -> EvalReport | None:
        return self._service().baseline(cancel=self.cancel)

    def score(self, job: Job) -> EvalReport:
        service = self._service()
        if job.snapshot is not None:
            s = job.snapshot
            return service.score(s.config, s.state, step=s.step, snapshot_id=s.snapshot_id, cancel=self.cancel)
        if job.read is not None:
            return service.score_loaded(job.read(), step=job.step, snapshot_id=job.snapshot_id, name=str(job.folder),
                                        cancel=self.cancel)
        return service.score_folder(job.folder, cancel=self.cancel)

    def close(self) -> None:
        self.service = None

    def late_baseline(self) -> EvalReport | None:
        return None  # its baseline failed in this process: trying again fails again


WORKER_CODE = ("import json, signal, sys; sys.path[:] = json.loads(sys.argv[1]); "
               "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; "
               "from dflash_callbacks.engine.orphans import die_with_parent; die_with_parent(int(sys.argv[3])); "
               "from dflash_callbacks.engine.runners import worker_main; worker_main()")
"""What the worker runs: a fresh Python that imports only this package. (A multiprocessing
spawn would import the training script again, and run all of it where it lacks an
`if __name__ == "__main__":` guard: a second training run in the worker.) It ignores
SIGINT and SIGTERM: a Ctrl-C in the terminal (sent to the whole process group) or a
preemption's SIGTERM (sent to every process of the job) is the training process's to
handle; the worker ends when the training process closes its jobs, kills it, or dies."""


def worker_main() -> None:
    """Body of the worker (`python -c WORKER_CODE SYS_PATH SPEC_JSON PARENT_PID ANSWER_FD THREADS`, the
    training process's import path, as a multiprocessing spawn would pass it): one job per
    stdin line ("baseline" or a snapshot folder, JSON), one `[report dict | null, error |
    null]` line per job on ANSWER_FD, a pipe nothing else writes to (what prints, at start-up
    too, goes to the stdout and stderr the training process has)."""
    spec = json.loads(sys.argv[2])  # argv[3], the training process's pid: die_with_parent has it
    answers = os.fdopen(int(sys.argv[4]), "w")
    import torch

    # the cores the training process does not use (its intra-op threads): never a contest for the same ones
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - int(sys.argv[5])))
    service = None
    for line in sys.stdin:  # EOF: the training process closed it, or died
        job = json.loads(line)
        try:
            service = service or ScoringService(ServiceSpec.from_dict(spec), owns_process=True)
            report = service.baseline() if job == "baseline" else service.score_folder(job)
            answer = [None if report is None else report.to_dict(), None]
        except Exception as e:  # reported to the training process, which decides
            answer = [None, describe(e) + "\n" + traceback.format_exc(limit=3)]
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def import_path() -> list[str]:
    """The training process's sys.path as the worker takes it: its strings (imports skip
    anything else, such as a pathlib.Path a script put there)."""
    return [entry for entry in sys.path if isinstance(entry, str)]


class ProcessScorer:
    """A worker process (`worker_main`), replaced when it dies."""

    def __init__(self, spec: ServiceSpec, run: RunFolder, cancel: threading.Event, closing: threading.Event):
        self.spec, self.cancel = spec, cancel
        self.process: subprocess.Popen | None = None
        self.answers: int | None = None  # the read end of the worker's answer pipe
        self.restarts = -1
        self._unread = b""  # the worker's answer line read so far

    def _ensure_worker(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self._stop_worker()  # one that died between jobs: its pipes are closed
        read_end, write_end = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", WORKER_CODE, json.dumps(import_path()), json.dumps(self.spec.to_dict()),
                 str(os.getpid()), str(write_end), str(torch.get_num_threads())], stdin=subprocess.PIPE,
                pass_fds=(write_end,))
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the worker's alone: its exit ends the pipe
        self.answers, self._unread = read_end, b""
        self.restarts += 1

    def _answer(self) -> bytes | None:
        """The worker's next answer line, None when none came within POLL_SECONDS."""
        while b"\n" not in self._unread:
            if not select.select([self.answers], [], [], POLL_SECONDS)[0]:
                return None
            chunk = os.read(self.answers, 1 << 20)
            if not chunk:  # the worker is gone (or going): its exit code tells
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                return None
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line

    def _run(self, job: str) -> EvalReport | None:
        self._ensure_worker()
        try:
            self.process.stdin.write((json.dumps(job) + "\n").encode())
            self.process.stdin.flush()
        except OSError:  # a worker that died since it was started: its exit code is read below
            pass
        while True:
            line = self._answer()
            if line is None:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    self._stop_worker()
                    raise RuntimeError(f"the scoring worker died (exit code {code})") from None
                if self.cancel.is_set():
                    self._stop_worker()
                    raise Cancelled("scoring was cancelled") from None
                continue
            raw, error = json.loads(line)
            if error is not None:
                raise ScorerError(error)
            return None if raw is None else EvalReport.from_dict(raw)

    def baseline(self) -> EvalReport | None:
        return self._run("baseline") if self.spec.baseline is not None else None

    def score(self, job: Job) -> EvalReport:
        return self._run(str(job.folder))

    def _stop_worker(self) -> None:
        if self.process is not None:
            self.process.kill()  # no-op once it exited
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # unkillable for now (a device in a bad state): not waited on again
            try:
                self.process.stdin.close()
            except OSError:  # a job still buffered for a worker that is gone
                pass
            os.close(self.answers)
        self.process, self.answers = None, None

    def late_baseline(self) -> EvalReport | None:
        return None  # its baseline failed in the worker: trying again fails again

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.stdin.close()  # end of jobs: the worker exits
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._stop_worker()


class ExternalScorer:
    """Waits for `dflash-callbacks watch` to write the report of each snapshot."""

    def __init__(self, spec: ServiceSpec, run: RunFolder, cancel: threading.Event, closing: threading.Event):
        self.spec, self.run, self.cancel, self.closing = spec, run, cancel, closing
        self._weights: str | None = None  # the fingerprint of this run's baseline weights
        self._baseline_seen: tuple | None = None
        self._since = time.time()  # the run's start: a watcher had until WATCHER_TIMEOUT after it to show up

    def _wait(self, path: Path, snapshot_id: str | None, what: str) -> EvalReport:
        """The watcher's report at `path` naming `snapshot_id` (ANY_SNAPSHOT: whatever it
        names, the baseline's); its error for that snapshot (or for none) raises."""
        started, warned = time.time(), False
        while True:
            if path.is_file():
                found = self.run.read_report(path)
                ours = snapshot_id is ANY_SNAPSHOT or found.snapshot_id == snapshot_id
                if isinstance(found, WatcherError) and (ours or found.snapshot_id is None):
                    raise ScorerError(found.message)
                if isinstance(found, EvalReport) and ours:
                    return found
            if self.cancel.is_set():
                raise Cancelled("scoring was cancelled")
            heartbeat = self.run.last_heartbeat() or 0.0
            if self.closing.is_set() and time.time() - max(heartbeat, self._since) > WATCHER_TIMEOUT:
                # the run's, not this wait's, start: each snapshot left would wait WATCHER_TIMEOUT again
                raise RuntimeError(f"no `dflash-callbacks watch` has written to {self.run.path} for "
                                   f"{WATCHER_TIMEOUT:.0f} s; {what} was not scored")
            if time.time() - max(heartbeat, started) > WATCHER_TIMEOUT:
                if not warned:
                    warnings.warn(f"dflash: waiting for a watcher to score {what}: start `dflash-callbacks watch "
                                  f"--dir {self.run.path.parent} --cache ... --target ...` (a watcher that refuses "
                                  "this run, for flags or a cache other than its own, says why in its log)",
                                  stacklevel=1)
                    warned = True
            time.sleep(POLL_SECONDS)

    def baseline(self) -> EvalReport | None:
        if self.spec.baseline is None:
            return None
        source = Path(self.spec.baseline)
        if source.is_file():  # a saved report: read here, as every runner does
            return EvalReport.load(source)
        path = self.run.report_path(None)
        try:
            return self._same_weights(self._wait(path, ANY_SNAPSHOT, "the baseline"))
        finally:
            self._baseline_seen = file_version(path)  # what late_baseline looks past

    def late_baseline(self) -> EvalReport | None:
        """The watcher's baseline report when it has appeared since the baseline failed
        (the watcher retries each poll); None while there is none (new)."""
        path = self.run.report_path(None)
        key = file_version(path)
        if key is None or key == self._baseline_seen:
            return None
        self._baseline_seen = key
        found = self.run.read_report(path)
        return self._same_weights(found) if isinstance(found, EvalReport) else None

    def _same_weights(self, report: EvalReport) -> EvalReport:
        """The watcher's baseline report, if it scored this run's baseline weights."""
        if self._weights is None:
            self._weights = weights_fingerprint(self.spec.baseline)
        theirs = recorded_weights(report)
        if theirs != self._weights:
            raise RuntimeError(f"the watcher's baseline report is of weights {theirs}, this run's baseline "
                               f"{self.spec.baseline} is {self._weights}: start `dflash-callbacks watch` with "
                               f"--baseline {self.spec.baseline}")
        return report

    def score(self, job: Job) -> EvalReport:
        return self._wait(self.run.report_path(job.step), job.snapshot_id, f"step {job.step}")

    def close(self) -> None:
        pass


SCORERS = {"thread": ThreadScorer, "process": ProcessScorer, "external": ExternalScorer}


def versus_baseline(report: EvalReport, baseline: EvalReport | None) -> dict | None:
    """`report` against the baseline, paired (`intervals.paired_comparison`), or None without a
    baseline or intervals on both; a bootstrap of ~10 ms, so the runner makes it, not the training
    thread. A pair that can not be compared (other anchors) is left to the publisher to refuse."""
    if baseline is None or report.intervals is None or baseline.intervals is None:
        return None
    try:
        return paired_comparison(report, baseline)
    except ValueError:
        return None


# ---------------------------------------------------------------- the runner


class BackgroundRunner:
    def __init__(self, kind: str, spec: ServiceSpec, run: RunFolder, keep_last: int, basis: Basis,
                 notes: Callable[[EvalReport], list[str]] | None = None):
        """`notes(baseline)`: the lines the run is told once the baseline's report is in (the stops' setup
        warnings, `reports.unresolvable`), made on this runner's thread: they may take a while."""
        self.run, self.keep_last, self.basis, self.has_baseline = run, keep_last, basis, spec.baseline is not None
        self._notes = notes
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
            outcome = SnapshotOutcome(step=job.step, snapshot_id=job.snapshot_id, report=report,
                                      versus=versus_baseline(report, self._baseline_report))
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
        if outcome.report is not None:
            outcome.record = results_record(outcome.report, outcome.seconds, outcome.versus)
        return outcome
