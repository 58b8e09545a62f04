"""TensorBoard as a destination of a run's reports: `TensorBoardTracker(log_dir)` (the watchers'
`--tensorboard DIR`) writes event files into `log_dir` through torch's `SummaryWriter` (the
`tensorboard` extra). Each key is a scalar at the snapshot's step; the per-task table is a text
summary (a markdown table, tag `NAME/text_summary` as TensorBoard names text); the run's plot is an
image at the last step logged.

Every write is flushed before the call returns, so a folder that can not be written fails the call
that wrote into it (the delivery keeps that report and sends it again); the writer is then dropped
and the next call opens a fresh one (a new event file in the same folder: TensorBoard reads them
all)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .optional import require


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The table as TensorBoard's text plugin renders one (markdown)."""
    lines = ["| " + " | ".join(str(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_scalars(writer, metrics: Mapping[str, float], step: int) -> None:
    for key, value in metrics.items():
        writer.add_scalar(key, float(value), global_step=int(step))


def write_table(writer, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
    writer.add_text(name, markdown_table(columns, rows), global_step=int(step))


def write_image(writer, name: str, path: Path, step: int) -> None:
    """A PNG file as an image summary (matplotlib reads it: height x width x channels, in [0, 1])."""
    from matplotlib.image import imread

    writer.add_image(name, imread(os.fspath(path)), global_step=int(step), dataformats="HWC")


class TensorBoardTracker:
    """Event files of this run in `log_dir` (made at the first write)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike):
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise ValueError(f"log_dir must be a folder's path, got {log_dir!r}")
        self._summary = require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.log_dir = Path(log_dir)
        self._writer = None
        self.last_step = 0  # where the plot goes: the last step logged

    def _write(self, write) -> None:
        if self._writer is None:
            self._writer = self._summary.SummaryWriter(log_dir=os.fspath(self.log_dir))
        try:
            write(self._writer)
            self._writer.flush()
        except BaseException:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except Exception:
                pass  # the failure that matters is the one raised below
            raise

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._write(lambda w: write_scalars(w, metrics, step))
        self.last_step = max(self.last_step, int(step))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
        self._write(lambda w: write_table(w, name, columns, rows, step))

    def log_image(self, name: str, path: Path) -> None:
        self._write(lambda w: write_image(w, name, Path(path), self.last_step))

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

