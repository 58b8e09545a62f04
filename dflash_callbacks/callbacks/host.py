"""A Lightning Trainer as the engine's host (`engine.host.Host`): its ranks and strategy's broadcast,
its loggers (a WandbLogger's run gets the tables and curves), `callback_metrics`, and when the fit
loop ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..engine.host import Host, Logger, WandbRun


class LightningHost(Host):
    """A Trainer as the engine's host."""

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer
        self.rank, self.world_size = trainer.global_rank, trainer.world_size

    def broadcast(self, obj: Any) -> Any:
        return self.trainer.strategy.broadcast(obj, src=0)

    def default_dirpath(self, name: str) -> Path:
        return Path(self.trainer.default_root_dir) / name

    def loggers(self) -> list[Logger]:
        return [(type(logger).__name__, logger.log_metrics) for logger in self.trainer.loggers
                if not isinstance(logger, WandbLogger)]

    def wandb_runs(self) -> list[WandbRun]:
        """Each WandbLogger's run; a row holds the logger's own x axis too, at the report's step."""
        return [("WandbLogger", logger.experiment,
                 lambda row, step, run=logger.experiment: run.log({**row, "trainer/global_step": step}))
                for logger in self.trainer.loggers if isinstance(logger, WandbLogger)]

    def set_metrics(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.trainer.callback_metrics[key] = torch.tensor(value, dtype=torch.float32)

    def horizon(self) -> int | None:
        return horizon(self.trainer)

    def ending(self) -> str | None:
        return ending(self.trainer)

    def info(self, text: str) -> None:
        rank_zero_info(text)

    def warn(self, text: str) -> None:
        rank_zero_warn(text)


def fit_ends(trainer: pl.Trainer) -> bool:
    """Whether the fit loop ends after this epoch: Lightning's `FitLoop.done` without its side
    effects (at max_epochs it moves the epoch counter on before the epoch has completed, so
    ModelCheckpoint and the hooks after ours saw the last epoch as the next one, and it logs)."""
    def reached(current: int, limit: int | None) -> bool:
        return limit is not None and limit != -1 and current >= limit

    epochs, step = trainer.fit_loop.epoch_progress.current.processed, trainer.global_step
    return (reached(step, trainer.max_steps) or reached(epochs, trainer.max_epochs)
            or (trainer.should_stop and epochs >= (trainer.min_epochs or 0) and step >= (trainer.min_steps or 0)))


def ending(trainer: pl.Trainer) -> str | None:
    """Why the fit loop ends without the stop (a report of the last snapshot, drained in on_train_end,
    or one that came after another callback stopped training), or None while training goes on."""
    if trainer.should_stop:
        return "trainer.should_stop is already set"
    if 0 < trainer.max_steps <= trainer.global_step:
        return f"max_steps={trainer.max_steps} reached"
    if trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.fit_loop.epoch_progress.current.processed:
        return f"max_epochs={trainer.max_epochs} reached"
    return None


def horizon(trainer: pl.Trainer) -> int | None:
    """The last training step: max_steps, else the trainer's estimate from max_epochs; None if unknown."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    if trainer.max_steps is not None and trainer.max_steps > 0:
        return trainer.max_steps
    try:
        estimate = trainer.estimated_stepping_batches
    except MisconfigurationException:
        return None
    return int(estimate) if estimate != float("inf") and estimate > 0 else None
