"""Where scoring runs. Every runner takes snapshots from the training thread with
`submit` (which never blocks) and hands back `Outcome`s from `poll`.

- "thread": a daemon thread of the training process writes the snapshot and scores it.
- "process": the thread writes the snapshot; a spawned worker process (its own CUDA
  context, e.g. on a spare GPU) loads and scores it. A worker that dies is reported as
  an error for that snapshot and replaced for the next one.
- "external": the thread only writes snapshots; `dflash-callbacks watch`, in another
  process or on another host sharing the folder, writes `reports/step-XXXXXXXX.json`
  (and `reports/baseline.json`), which `poll` picks up.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..scoring.report import EvalReport
from .evaluator import Evaluator, EvaluatorSpec
from .snapshot import Snapshot, prune_snapshots, snapshot_dir, write_snapshot

RUNNERS = ("thread", "process", "external")
BASELINE = -1  # Outcome.step of the baseline's report


@dataclass
class Outcome:
    step: int  # BASELINE for the baseline's report
    report: EvalReport | None = None
    error: str | None = None
    seconds: float = 0.0


def report_file(reports_dir: Path, step: int) -> Path:
    return Path(reports_dir) / ("baseline.json" if step == BASELINE else f"step-{step:08d}.json")


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class LocalScorer:
    """Scores in the calling thread with an Evaluator built on first use."""

    def __init__(self, spec: EvaluatorSpec):
        self.spec = spec
        self.evaluator: Evaluator | None = None

    def _ready(self) -> Evaluator:
        if self.evaluator is None:
            self.evaluator = Evaluator(self.spec)
        return self.evaluator

    def baseline(self) -> EvalReport | None:
        return self._ready().baseline()

    def score(self, snapshot: Snapshot, folder: Path | None) -> EvalReport:
        return self._ready().score_state(snapshot.config, snapshot.state, snapshot.step, f"step {snapshot.step}")

    def close(self) -> None:
        pass


def _worker_main(spec: EvaluatorSpec, jobs, results) -> None:
    """Body of the spawned worker: (step, folder) in, (step, report dict | None, error) out."""
    scorer = LocalScorer(spec)
    while True:
        job = jobs.get()
        if job is None:
            return
        step, folder = job
        try:
            report = scorer.baseline() if step == BASELINE else scorer._ready().score_folder(folder, step)
            results.put((step, None if report is None else report.to_dict(), None))
        except Exception as e:  # reported to the training process, which decides
            results.put((step, None, describe(e) + "\n" + traceback.format_exc(limit=3)))


class ProcessScorer:
    """Scores in a spawned worker process, replaced when it dies."""

    def __init__(self, spec: EvaluatorSpec, poll_seconds: float = 0.2):
        self.spec, self.poll_seconds = spec, poll_seconds
        self.ctx = mp.get_context("spawn")
        self.process = None
        self.restarts = -1

    def _ensure_worker(self) -> None:
        if self.process is not None and self.process.is_alive():
            return
        self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.process = self.ctx.Process(
            target=_worker_main, args=(self.spec, self.jobs, self.results), daemon=True, name="dflash-eval-worker"
        )
        self.process.start()
        self.restarts += 1

    def _run(self, step: int, folder: Path | None) -> EvalReport | None:
        self._ensure_worker()
        self.jobs.put((step, None if folder is None else str(folder)))
        while True:
            try:
                done_step, raw, error = self.results.get(timeout=self.poll_seconds)
            except queue.Empty:
                if not self.process.is_alive():
                    code = self.process.exitcode
                    self.process = None
                    raise RuntimeError(f"the scoring worker died (exit code {code}) while scoring step {step}") from None
                continue
            if error is not None:
                raise RuntimeError(error)
            return None if raw is None else EvalReport.from_dict(raw)

    def baseline(self) -> EvalReport | None:
        return self._run(BASELINE, None) if self.spec.baseline is not None else None

    def score(self, snapshot: Snapshot, folder: Path | None) -> EvalReport:
        if folder is None:
            raise ValueError("runner='process' hands snapshots over on disk; keep_last must be >= 1")
        return self._run(snapshot.step, folder)

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.jobs.put(None)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()


class BackgroundRunner:
    """A daemon thread that writes each submitted snapshot (keeping the newest
    `keep_last` on disk) and, unless external, scores it; first of all the baseline."""

    def __init__(self, kind: str, spec: EvaluatorSpec, run_dir: Path, keep_last: int):
        if kind not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}; got {kind!r}")
        self.kind, self.run_dir, self.keep_last = kind, Path(run_dir), keep_last
        self.snapshots_dir, self.reports_dir = self.run_dir / "snapshots", self.run_dir / "reports"
        self.scorer = {"thread": LocalScorer, "process": ProcessScorer}[kind](spec) if kind != "external" else None
        self.has_baseline = spec.baseline is not None
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._in_flight = 0  # submitted snapshots not yet handed back (or, external: not yet written)
        self._lock = threading.Lock()
        self._awaiting: set[int] = set()  # external: steps written, reports not yet seen
        self._thread = threading.Thread(target=self._loop, name="dflash-eval", daemon=True)
        self._thread.start()

    # ---- training thread
    def submit(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._in_flight += 1
        self._inbox.put(snapshot)

    @property
    def pending(self) -> int:
        """Snapshots submitted and not yet handed back by poll (in memory or being scored)."""
        with self._lock:
            return self._in_flight + len(self._awaiting)

    def poll(self) -> list[Outcome]:
        out = []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        if self.kind == "external":
            out += self._collect_external()
        with self._lock:
            self._in_flight -= sum(1 for o in out if o.step != BASELINE and self.kind != "external")
        return out

    def close(self, wait: bool, timeout: float | None = None) -> None:
        """Stop the thread; with `wait`, after every submitted snapshot is done."""
        self._inbox.put(None if wait else "abort")
        self._thread.join(timeout=timeout if wait else 5)
        if self.scorer is not None:
            self.scorer.close()

    def wait_external(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while self.kind == "external" and self._awaiting and time.time() < deadline:
            time.sleep(0.2)
            for outcome in self._collect_external():
                self._outbox.put(outcome)

    # ---- background thread
    def _loop(self) -> None:
        if self.scorer is not None and self.has_baseline:
            self._outbox.put(self._attempt(BASELINE, self.scorer.baseline))
        elif self.kind == "external" and self.has_baseline:
            self._awaiting.add(BASELINE)
        while True:
            snapshot = self._inbox.get()
            if snapshot is None or snapshot == "abort":
                return
            started = time.time()
            try:
                folder = self._write(snapshot)
            except Exception as e:
                self._outbox.put(Outcome(snapshot.step, error=f"writing the snapshot failed: {describe(e)}"))
                continue
            if self.kind == "external":
                with self._lock:
                    self._awaiting.add(snapshot.step)
                    self._in_flight -= 1
                continue
            outcome = self._attempt(snapshot.step, lambda: self.scorer.score(snapshot, folder))
            outcome.seconds = time.time() - started
            del snapshot  # release the host copy before the next one
            self._outbox.put(outcome)

    def _write(self, snapshot: Snapshot) -> Path | None:
        snapshot.wait()
        if self.keep_last == 0:
            return None
        # make room first, so that no more than keep_last snapshots (finished or being written) are ever on disk
        prune_snapshots(self.snapshots_dir, self.keep_last - 1)
        return write_snapshot(self.snapshots_dir, snapshot)

    @staticmethod
    def _attempt(step: int, fn) -> Outcome:
        started = time.time()
        try:
            return Outcome(step, report=fn(), seconds=time.time() - started)
        except Exception as e:
            return Outcome(step, error=describe(e), seconds=time.time() - started)

    def _collect_external(self) -> list[Outcome]:
        out = []
        with self._lock:
            awaiting = sorted(self._awaiting)
        for step in awaiting:
            path = report_file(self.reports_dir, step)
            if not path.is_file():
                continue
            try:
                raw = json.loads(path.read_text())
                outcome = Outcome(step, error=raw["error"]) if "error" in raw else Outcome(step, EvalReport.from_dict(raw))
            except (ValueError, KeyError) as e:
                outcome = Outcome(step, error=f"unreadable report {path}: {describe(e)}")
            with self._lock:
                self._awaiting.discard(step)
            out.append(outcome)
        return out


__all__ = ["BASELINE", "BackgroundRunner", "Outcome", "RUNNERS", "report_file", "snapshot_dir"]
