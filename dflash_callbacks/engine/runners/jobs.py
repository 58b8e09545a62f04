"""What a runner takes and hands back: a `Job` (one snapshot to score), its `SnapshotOutcome` (or the
baseline's `BaselineOutcome`), exactly one per job, success or failure; the `Scorer` protocol every scorer
implements; and how every runner words a failure (`describe`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ...model import DFlashDrafter
from ...scoring.report import EvalReport
from ...scoring.scorer import NonFiniteError
from ..snapshot import Snapshot


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


class Scorer(Protocol):
    """Where a job's report comes from (thread_scorer.py, process_scorer.py, external_scorer.py)."""

    def baseline(self) -> EvalReport | None:
        """The baseline's report (None without a baseline)."""

    def late_baseline(self) -> EvalReport | None:
        """After the baseline failed: its report when one has appeared since (None: none new)."""

    def score(self, job: Job) -> EvalReport:
        """The report of `job`, on the runner's thread; raises on any failure."""

    def close(self) -> None:
        """Let go of what it holds (a worker process, a service)."""
