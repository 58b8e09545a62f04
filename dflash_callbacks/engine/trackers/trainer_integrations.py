"""The trackers of a transformers Trainer's own integrations, the ones its `report_to` named:
`trainer_trackers(trainer.callback_handler)`; from inside a TrainerCallback's hook, which is given no
Trainer, `trainer_trackers(calling_handler())`.

- TensorBoardCallback: our keys go through its `SummaryWriter`, into its folder, at the snapshot's step;
- MLflowCallback: into the run it started (or found active), through a client of our own.

Neither goes through `Trainer.log`: no row is added to the Trainer's log history, and none of its keys is
written twice. Both integrations let go of what they hold in their `on_train_end`, which runs before
ours (the Trainer puts the integrations first): the last reports still reach the same folder (the
writer opens a new event file there) and the same run (logging into an ended MLflow run is allowed).
Integrations other than these two are not reached here (W&B has its own way: `ActiveWandb`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import tensorboard as tb
from .mlflow import MlflowTracker


class TrainerTensorBoard:
    """Writes through a TensorBoardCallback's writer (the one it holds now, else the last one seen)."""

    name = "tensorboard"

    def __init__(self, callback):
        self.callback = callback
        self._writer = getattr(callback, "tb_writer", None)  # kept: the callback drops it in its on_train_end
        self.last_step = 0

    def _writer_now(self):
        writer = getattr(self.callback, "tb_writer", None)
        if writer is not None:
            self._writer = writer
        elif self._writer is None:  # the callback has not opened one yet (a report before its on_train_begin)
            raise RuntimeError("the Trainer's TensorBoardCallback has no writer yet")
        return self._writer

    def _write(self, write) -> None:
        writer = self._writer_now()
        write(writer)
        writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._write(lambda w: tb.write_scalars(w, metrics, step))
        self.last_step = max(self.last_step, int(step))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
        self._write(lambda w: tb.write_table(w, name, columns, rows, step))

    def log_image(self, name: str, path: Path) -> None:
        self._write(lambda w: tb.write_image(w, name, Path(path), self.last_step))

    def close(self) -> None:
        """Closes the writer only when the callback let go of it (it reopened for our last reports)."""
        if self._writer is not None and getattr(self.callback, "tb_writer", None) is not self._writer:
            self._writer.close()


class TrainerMlflow:
    """Writes into the MLflow run an MLflowCallback started: the fluent API's active run of this thread
    (the training thread), looked up until found, then kept (the callback ends it before our last
    reports)."""

    name = "mlflow"

    def __init__(self, callback):
        self.callback = callback
        self.tracker: MlflowTracker | None = None
        try:
            self._tracker()  # the run now, if it has started (the callback ends it before our last reports)
        except RuntimeError:
            pass

    def _tracker(self) -> MlflowTracker:
        if self.tracker is None:
            mlflow = self.callback._ml_flow  # the module the callback imported
            run = mlflow.active_run()
            if run is None:
                raise RuntimeError("the Trainer's MLflowCallback has no active run yet")
            self.tracker = MlflowTracker(mlflow.get_tracking_uri(), run_id=run.info.run_id)
        return self.tracker

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._tracker().log_metrics(metrics, step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
        self._tracker().log_table(name, columns, rows, step)

    def log_image(self, name: str, path: Path) -> None:
        self._tracker().log_image(name, path)

    def close(self) -> None:
        pass  # the run is the Trainer's


def trainer_trackers(handler) -> list:
    """A tracker for each TensorBoard and MLflow integration among the callbacks of `handler` (a Trainer's
    `callback_handler`). Call it once the Trainer has started training (in `on_train_begin`, where
    the integrations, before ours, have opened their writer and run), on rank 0 (the integrations
    open nothing on the others); a report that comes earlier is held by the delivery until they have."""
    callbacks = getattr(handler, "callbacks", None)
    if callbacks is None:
        raise TypeError(f"trainer_trackers takes a Trainer's callback_handler, got {type(handler).__name__}")
    from transformers.integrations import MLflowCallback, TensorBoardCallback

    found = []
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback):
            found.append(TrainerTensorBoard(callback))
        elif isinstance(callback, MLflowCallback):
            found.append(TrainerMlflow(callback))
    return found


def calling_handler():
    """The Trainer's CallbackHandler running the hook this is called from (its `call_event` frame, up the
    stack): a TrainerCallback's hooks get the model and the optimizer, never the Trainer or its handler."""
    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner
        frame = frame.f_back
    raise RuntimeError("calling_handler() finds the Trainer's CallbackHandler only from inside a TrainerCallback hook")
