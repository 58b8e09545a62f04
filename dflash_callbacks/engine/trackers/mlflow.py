"""MLflow as a destination of a run's reports: `MlflowTracker(tracking_uri, experiment, run_id=None)` (the
watchers' `--mlflow-uri URI --mlflow-experiment NAME [--mlflow-run-id ID]`; the `mlflow` extra).

It talks through an `MlflowClient` of its own: no active run is set, so the fluent API of the
program (and of its other threads) sees nothing of it. With `run_id` it attaches to that run (and
leaves it as it found it); without, it makes a run in `experiment` (made if missing) at its first
write and ends it at `close()`. Nothing reaches the server before the first write, so a server down
at the start costs reports only what a server down later does: the delivery keeps them.

- metrics: one `log_batch` per 1000 keys at the snapshot's step; a key with a character Lightning's
  MLFlowLogger drops (it keeps letters, digits, `_ / . -` and space; MLflow refuses `@`) has it
  dropped, so the same report has the same keys under Lightning and everywhere else: `ddtree@4` is
  `ddtree4`. A report sent again carries the timestamps of its first try: the server keeps one copy
  of what reached it twice.
- the per-task table: `log_table` into one table of the run, artifact `NAME.json`, each row with its
  step first (`log_table` appends); rows sent again after a try that failed are not appended twice.
- the plot: artifact `NAME.png`.

Each request is bounded (`timeout_s`, `retries`): MLflow's own default retries a dead server for
minutes, on the training thread. MLflow reads these settings from the environment only
(MLFLOW_HTTP_REQUEST_TIMEOUT, _MAX_RETRIES, _BACKOFF_FACTOR; and MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR, off:
no progress bar on stderr at each table), so each is set for the length of each call of this tracker,
unless the program set it itself (a request of another thread in that moment gets them too)."""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from .optional import require

BATCH = 1000  # MLflow's most metrics per log_batch
_ILLEGAL = re.compile(r"[^a-zA-Z0-9_/. -]")  # Lightning's MLFlowLogger keeps these and drops the rest
_ENV_LOCK = threading.Lock()


def mlflow_name(key: str) -> str:
    """A logged key as MLflow gets it under every entry point: the characters Lightning's MLFlowLogger drops
    (all but letters, digits, `_ / . -` and space) dropped, as that logger does with the same keys."""
    return _ILLEGAL.sub("", key)


def mlflow_names(keys) -> dict[str, str]:
    """{key: its MLflow name}; ValueError when two keys would have the same name."""
    names: dict[str, str] = {}
    seen: dict[str, str] = {}  # name -> the first key that has it
    for key in keys:
        name = names[key] = mlflow_name(key)
        if seen.setdefault(name, key) != key:
            raise ValueError(f"the keys {seen[name]!r} and {key!r} are both {name!r} in MLflow (the characters it "
                             "refuses dropped): rename a task or the prefix")
    return names


@contextmanager
def bounded_requests(timeout_s: float, retries: int):
    """MLflow's HTTP timeout and retries, and no progress bar on stderr, for the length of one call (each
    one the program set itself stands)."""
    settings = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(timeout_s))),
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries), "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    with _ENV_LOCK:
        ours = {name: value for name, value in settings.items() if name not in os.environ}
        try:
            os.environ.update(ours)
            yield
        finally:
            for name in ours:
                os.environ.pop(name, None)


class MlflowTracker:
    """The reports of this run in an MLflow run at `tracking_uri` (`http://host:port`, `sqlite:///...`,
    a folder...): the run `run_id` when given, else a new run of `experiment`."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str | None = None, run_id: str | None = None, *,
                 run_name: str | None = None, timeout_s: float = 5.0, retries: int = 1):
        for label, value in (("tracking_uri", tracking_uri), ("experiment", experiment), ("run_id", run_id),
                             ("run_name", run_name)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{label} must be a non-empty string or None, got {value!r}")
        if tracking_uri is None:
            raise ValueError("tracking_uri is required (--mlflow-uri): http://host:port, sqlite:///path or a folder")
        if experiment is None and run_id is None:
            raise ValueError("MLflow needs an experiment to make the run in (--mlflow-experiment NAME) or a run to "
                             "attach to (--mlflow-run-id ID)")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0) or not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"timeout_s must be > 0 and retries an int >= 0, got {timeout_s!r} and {retries!r}")
        self._tracking = require("mlflow.tracking", "mlflow", "mlflow")
        require("pandas", "mlflow", "mlflow")  # log_table writes through pandas
        self._entities = require("mlflow.entities", "mlflow", "mlflow")
        self._client = None  # made at the first write: a sqlite URI's client makes its database
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.timeout_s, self.retries = float(timeout_s), retries
        self.run_id = run_id
        self._attached = run_id is not None  # a run of the user's: never ended here
        self._checked = False
        self._stamps: dict[int, int] = {}  # step -> the timestamp of the first try of its metrics
        self._tried: dict[str, set[int]] = {}  # per table: the steps whose last try failed

    @property
    def client(self):
        if self._client is None:
            self._client = self._tracking.MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _run(self) -> str:
        """The run's id: the one given (checked once to exist, in `experiment` when named) or, at the
        first write, a new run of `experiment`."""
        if self._checked:
            return self.run_id
        if self.run_id is not None:
            run = self.client.get_run(self.run_id)
            if self.experiment is not None:
                found = self.client.get_experiment(run.info.experiment_id)
                if found.name != self.experiment:
                    raise ValueError(f"the MLflow run {self.run_id} is in the experiment {found.name!r}, "
                                     f"not {self.experiment!r}")
        else:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self._checked = True
        return self.run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        names = mlflow_names(metrics)
        stamp = self._stamps.setdefault(int(step), int(time.time() * 1000))
        batch = [self._entities.Metric(names[k], float(v), stamp, int(step)) for k, v in metrics.items()]
        with bounded_requests(self.timeout_s, self.retries):
            run_id = self._run()
            for start in range(0, len(batch), BATCH):
                self.client.log_batch(run_id, metrics=batch[start:start + BATCH], synchronous=True)
        self._stamps.pop(int(step), None)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
        """The rows, each with the step first, appended to the run's one table `NAME.json` (`log_table`
        appends to a table already there; one file for the run, as MLflow's tag of logged tables holds
        8000 characters). Sent again after a try that failed, rows of the step found there already are
        not appended twice."""
        data = {"step": [int(step)] * len(rows), **{str(c): [row[i] for row in rows] for i, c in enumerate(columns)}}
        artifact = f"{name}.json"
        with bounded_requests(self.timeout_s, self.retries):
            run_id = self._run()
            if step in self._tried.get(artifact, ()) and int(step) in self._table_steps(run_id, artifact):
                self._tried[artifact].discard(step)  # an earlier try appended them, then failed
                return
            self._tried.setdefault(artifact, set()).add(step)
            self.client.log_table(run_id, data=data, artifact_file=artifact)
        self._tried[artifact].discard(step)

    def _table_steps(self, run_id: str, artifact: str) -> set[int]:
        """The steps of the rows of the run's table `artifact` (empty when it has none yet)."""
        folder = posixpath.dirname(artifact) or None
        if artifact not in [a.path for a in self.client.list_artifacts(run_id, folder)]:
            return set()
        with tempfile.TemporaryDirectory() as tmp:
            table = json.loads(Path(self.client.download_artifacts(run_id, artifact, tmp)).read_text())
        column = table["columns"].index("step")
        return {int(row[column]) for row in table["data"]}

    def log_image(self, name: str, path: Path) -> None:
        folder, _, stem = name.rpartition("/")
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / f"{stem}.png"
            shutil.copyfile(path, copy)
            with bounded_requests(self.timeout_s, self.retries):
                self.client.log_artifact(self._run(), os.fspath(copy), artifact_path=folder or None)

    def close(self) -> None:
        """Ends the run this tracker made (a run it attached to is left running)."""
        if self._checked and not self._attached:
            with bounded_requests(self.timeout_s, self.retries):
                self.client.set_terminated(self.run_id)
