"""The "external" runner's scorer: `dflash-callbacks watch`, in another process or on another host sharing
the folder, writes reports/step-XXXXXXXX.json; the scorer waits for the one whose snapshot_id is the job's.
The watcher's baseline must be of the run's baseline weights; after a failure, the one a watcher's retry
writes is taken (`late_baseline`)."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

from ...files import file_version
from ...scoring.report import EvalReport
from ...scoring.scorer import Cancelled
from ...scoring.service import ServiceSpec, recorded_weights, weights_fingerprint
from ..run_folder import RunFolder, WatcherError
from .jobs import Job, ScorerError

WATCHER_TIMEOUT = 120.0
"""Seconds without a watcher heartbeat after which a wait is said to have no watcher."""
POLL_SECONDS = 0.2
ANY_SNAPSHOT = object()
"""What `ExternalScorer._wait` takes for the baseline: a report of any snapshot id (a
baseline drafter folder may be a snapshot, whose report names its id)."""


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
