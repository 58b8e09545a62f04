"""The "thread" runner's scorer: the ScoringService in this process, on the runner's thread."""

from __future__ import annotations

import threading

from ...scoring.report import EvalReport
from ...scoring.service import ScoringService, ServiceSpec
from ..run_folder import RunFolder
from .jobs import Job


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
