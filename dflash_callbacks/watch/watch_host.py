"""The checkpoint watcher as the engine's host (`WatchHost`): one process, lines on stdout and stderr, its
W&B run, and the last step it has seen."""

from __future__ import annotations

import sys

from ..engine.host import Host, Logger


class WatchHost(Host):
    """The watcher as the engine's host: one process, lines on stdout and stderr, its W&B run, and the
    last step it has seen (a stop decided on a report at or beyond --max-steps only warns)."""

    def __init__(self, max_steps: int | None, trackers: list | None = None):
        self.max_steps, self.latest = max_steps, 0
        self.wandb_run = None
        self.tracker_list = list(trackers or [])  # --tensorboard, --mlflow-uri

    def trackers(self) -> list:
        return list(self.tracker_list)

    def saw(self, step: int) -> None:
        """A checkpoint of `step` was submitted."""
        self.latest = max(self.latest, step)

    def use_wandb(self, run) -> None:
        """The W&B run the reports go to (None: none any more)."""
        self.wandb_run = run

    def loggers(self) -> list[Logger]:
        return []

    def wandb_runs(self) -> list:
        return [] if self.wandb_run is None else [("wandb", self.wandb_run, self.log_row)]

    def log_row(self, payload: dict, step: int) -> None:
        """One committed row per report, at the checkpoint's step; a step below W&B's counter (a
        checkpoint completed late) goes in the next row, `dflash/step` still placing it."""
        run = self.wandb_run
        if step >= run.step:
            run.log(payload, step=step, commit=True)
        else:
            run.log(payload, commit=True)

    def horizon(self) -> int | None:
        return self.max_steps

    def ending(self) -> str | None:
        if self.max_steps is not None and self.latest >= self.max_steps:
            return f"the checkpoint of step {self.latest} is at --max-steps {self.max_steps}"
        return None

    def info(self, text: str) -> None:
        print(text, flush=True)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)
