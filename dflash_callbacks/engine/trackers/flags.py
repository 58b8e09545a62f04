"""The watchers' tracker flags as trackers: `--tensorboard DIR` and `--mlflow-uri URI --mlflow-experiment NAME
[--mlflow-run-id ID]`. Every mistake in them at once, in one ValueError naming the flags; a tracker whose
extra is not installed is `MissingExtra` (one line naming the extra). Nothing is written and no server is
reached here: each tracker opens what it writes to at its first report."""

from __future__ import annotations

from .mlflow import MlflowTracker
from .tensorboard import TensorBoardTracker


def tracker_flag_problems(tensorboard: str | None = None, mlflow_uri: str | None = None,
                          mlflow_experiment: str | None = None, mlflow_run_id: str | None = None) -> list[str]:
    """Every mistake in the flags, one line each ([]: none); nothing imported (the CLI checks them before torch
    loads)."""
    problems = []
    if tensorboard is not None and not str(tensorboard).strip():
        problems.append("--tensorboard needs a folder")
    mlflow = (mlflow_uri, mlflow_experiment, mlflow_run_id)
    if any(v is not None for v in mlflow):
        if mlflow_uri is None:
            problems.append("--mlflow-experiment and --mlflow-run-id need --mlflow-uri URI (http://host:port, "
                            "sqlite:///path, ...)")
        if mlflow_experiment is None and mlflow_run_id is None:
            problems.append("--mlflow-uri needs --mlflow-experiment NAME (the run is made there) or --mlflow-run-id "
                            "ID (the run to attach to)")
    return problems


def watcher_trackers(tensorboard: str | None = None, mlflow_uri: str | None = None,
                     mlflow_experiment: str | None = None, mlflow_run_id: str | None = None,
                     run_name: str | None = None) -> list:
    """The trackers the flags ask for (none: []); `run_name` names a run MLflow makes (the run folder's)."""
    problems = tracker_flag_problems(tensorboard, mlflow_uri, mlflow_experiment, mlflow_run_id)
    if problems:
        raise ValueError("; ".join(problems))
    trackers = []
    if tensorboard is not None:
        trackers.append(TensorBoardTracker(tensorboard))
    if mlflow_uri is not None:
        trackers.append(MlflowTracker(mlflow_uri, mlflow_experiment, mlflow_run_id, run_name=run_name))
    return trackers
