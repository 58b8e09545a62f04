"""The one interface every destination of a run's reports implements (W&B, TensorBoard, MLflow, `log=`).

A tracker only writes: it raises on any failure and keeps no counts. What calls it (the publisher)
catches, counts the error, keeps what the tracker missed and sends it again later, so a tracker that
fails never loses a report: `results.jsonl` stays the record. Keys are the engine's metric keys
(`engine/metric_keys.py`), floats only, at the snapshot's training step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    name: str
    """What a warning or the summary calls it: "wandb", "tensorboard", "mlflow", "log=my_fn"."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Every key of one report at the snapshot's step."""

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
        """The per-task table of one report, in the tracker's table form where it has one."""

    def log_image(self, name: str, path: Path) -> None:
        """The run's plot (a PNG file), once at the end."""

    def close(self) -> None:
        """Flush and let go of what this tracker opened itself (never a run the user opened)."""


def checked_trackers(trackers: Iterable[Tracker] | None) -> list[Tracker]:
    """`trackers=` of an adapter as a list: TypeError naming what is not a Tracker, ValueError for two of one
    name (a warning or the summary could not tell them apart)."""
    found = [] if trackers is None else [trackers] if isinstance(trackers, Tracker) else list(trackers)
    wrong = [t for t in found if not isinstance(t, Tracker)]
    if wrong:
        raise TypeError(f"trackers: each needs name, log_metrics, log_table, log_image and close "
                        f"(TensorBoardTracker, MlflowTracker or your own); got {wrong[0]!r}")
    names = [t.name for t in found]
    if len(set(names)) < len(names):
        raise ValueError(f"trackers: two have one name (give each its own `name`): {names}")
    return found
