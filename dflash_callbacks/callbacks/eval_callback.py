"""DrafterEvalCallback: the evaluation engine (`dflash_callbacks.engine`) on a Lightning Trainer.

The hooks, and what the engine does in them:

    setup:                      every input checked before training (preflight), every rank
    on_train_start:             rank 0 opens the run folder (a fresh one, or the resumed run's)
    on_train_batch_end:         rank 0 publishes finished reports; every `every_n_train_steps`
                                it starts a copy of the drafter's weights; every
                                `sync_every_n_steps` the ranks exchange the news (the means in
                                `callback_metrics`, the stop's decision)
    on_before_optimizer_step,
    on_validation_start:        the copy has landed before anything writes the weights
    on_train_epoch_end (the last), else on_train_end:
                                the last step's snapshot, before any callback's on_train_end can
                                write the weights (WeightAveraging)
    on_train_end:               the last reports, then the run folder is released
    on_exception:               the run folder is released; unscored snapshots stay for a resume
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..checks import check_int
from ..engine.drafters import check_drafter_config, drafter_config_of, refuse_collective_wrappers, resolve_drafter
from ..engine.evaluator import EngineView, EvalEngine, Host
from ..engine.publish import Logger
from ..model import DrafterConfig
from ..scoring.config import ScoringConfig
from ..scoring.report import EvalReport


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

    def wandb_runs(self) -> list[tuple[str, Any, Callable[[dict, int], object]]]:
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


def eval_callbacks(callbacks) -> list[DrafterEvalCallback]:
    """The DrafterEvalCallbacks among `callbacks` (two of one name share a checkpoint key, so Lightning
    refuses them when the Trainer is made)."""
    return [cb for cb in callbacks if isinstance(cb, DrafterEvalCallback)]


class DrafterEvalCallback(EngineView, Callback):
    """Snapshot the drafter every `every_n_train_steps` steps and score it in the background.

    Args:
        cache: hidden-state cache folder (`dflash-callbacks extract`).
        target: the target's folder; only `embed_tokens` and `lm_head` are read.
        baseline: a published drafter folder (scored once, cached) or a saved report JSON.
        every_n_train_steps: snapshot cadence in optimizer steps (>= 1).
        drafter: attribute path on the LightningModule, or a function module -> drafter.
        drafter_config: a DrafterConfig or config.json path, when the drafter has none at `.config`.
        scoring: a ScoringConfig or a dict (or OmegaConf DictConfig) of its fields (copied, never changed).
        runner: "thread" | "process" | "external".
        device: where scoring runs ("auto": cuda when available); overrides scoring.device.
        busy: "skip" (no new snapshot while one is pending) or "queue" (up to `max_pending`).
        max_pending: snapshots pending at once with busy="queue" (>= 1).
        keep_last: snapshots kept on disk (0: none written; runner "thread" only).
        on_error: "warn" (training goes on) or "raise".
        wait_on_end: score and log the last step before `fit` returns.
        dirpath: the folder that holds this callback's runs, one subfolder per run
            (default: <default_root_dir>/<name>).
        baseline_cache_dir: where baseline reports are cached across runs
            (default: $XDG_CACHE_HOME/dflash_callbacks/baselines, ~/.cache/... without it).
        wait_timeout: seconds `fit` waits at the end for pending reports (> 0); what is
            still pending then is recorded as an error.
        name: the metric prefix, the default folder name, the checkpoint key, and what
            TrailingBaselineStop(eval_callback=...) names: unique among the Trainer's callbacks.
        verbose: print a one-line summary per report.
        sync_every_n_steps: on several processes, every this many steps rank 0's news reach every
            rank: the means (in `callback_metrics` on every rank) and a stop (>= 1).
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        target: str | os.PathLike,
        baseline: str | os.PathLike | None = None,
        every_n_train_steps: int = 500,
        drafter: str | Callable[[pl.LightningModule], nn.Module] = "drafter",
        drafter_config: DrafterConfig | str | os.PathLike | None = None,
        scoring: ScoringConfig | Mapping | None = None,
        runner: str = "thread",
        device: str | None = None,
        busy: str = "skip",
        max_pending: int = 1,
        keep_last: int = 2,
        on_error: str = "warn",
        wait_on_end: bool = True,
        dirpath: str | os.PathLike | None = None,
        baseline_cache_dir: str | os.PathLike | None = None,
        wait_timeout: float = 3600.0,
        name: str = "dflash",
        verbose: bool = True,
        sync_every_n_steps: int = 1,
    ):
        super().__init__()
        check_int("every_n_train_steps", every_n_train_steps, 1)
        self.engine = EvalEngine(
            cache, target, baseline, every_n_train_steps, scoring, runner, device, busy, max_pending, keep_last,
            on_error, wait_on_end, dirpath, baseline_cache_dir, wait_timeout, name, verbose, sync_every_n_steps,
            cadence="every_n_train_steps")
        if not (isinstance(drafter, str) or callable(drafter)):
            raise TypeError("drafter must be an attribute name or a function LightningModule -> drafter")
        self.drafter, self.drafter_config = drafter, check_drafter_config(drafter_config)
        self.name = name

    # ------------------------------------------------------------------ what the engine holds
    @property
    def scoring(self) -> ScoringConfig:
        return self.engine.scoring

    @property
    def every_n_train_steps(self) -> int:
        return self.engine.every_n_steps

    @property
    def metrics(self) -> dict[str, float]:
        """The latest means, as callback_metrics holds them."""
        return self.engine.metrics

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    # ------------------------------------------------------------------ hooks
    def _module(self, pl_module: nn.Module) -> nn.Module:
        return resolve_drafter(pl_module, self.drafter, type(self).__name__)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_stock_early_stopping(trainer.callbacks, self.name)
        module = self._module(pl_module)
        refuse_collective_wrappers(module, pl_module, f"{type(self).__name__}(drafter={self.drafter!r})")
        config = drafter_config_of(module, self.drafter_config, type(self).__name__, pl_module, self.drafter)
        self.engine.check(LightningHost(trainer), module, config, trainer.max_steps)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of an earlier version keyed this callback's state by its cache path as written
        (a resume that spelled it otherwise lost it): read that key when this one is absent."""
        states = checkpoint.get("callbacks", {})
        if self.state_key not in states:
            old = [k for k in states if k.startswith(f"{type(self).__qualname__}{{'name': {self.name!r}, 'cache': ")]
            if len(old) == 1:
                self.load_state_dict(states[old[0]])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def on_train_start(self, trainer, pl_module) -> None:
        self.engine.start(LightningHost(trainer), self._module(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.engine.on_step(trainer.global_step, trainer.current_epoch, self._module(pl_module)) is not None:
            trainer.should_stop = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.engine.copy_landed()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.engine.copy_landed()  # before any callback's on_validation_epoch_start (an EMA swap writes the weights)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if fit_ends(trainer):  # the last hook before any callback's on_train_end (WeightAveraging writes the weights)
            self.engine.finish(trainer.global_step, trainer.current_epoch, self._module(pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        self.engine.finish(trainer.global_step, trainer.current_epoch, self._module(pl_module))  # unless taken
        if self.engine.wait_on_end:
            self.engine.close(True, f"wait_timeout={self.engine.wait_timeout:g} s ran out at the end of training")
        else:
            self.engine.close(False, "wait_on_end=False: fit returned without waiting for it")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.engine.close(False, f"the fit stopped on {type(exception).__name__}", publish=False)


def _refuse_stock_early_stopping(callbacks, name: str) -> None:
    """Lightning's EarlyStopping on one of our keys counts one report at every check (and would stop
    at the NaN a key holds before the first report): DrafterEarlyStopping counts each report once."""
    from .early_stopping import DrafterEarlyStopping

    for cb in callbacks:
        if (isinstance(cb, EarlyStopping) and not isinstance(cb, DrafterEarlyStopping)
                and str(cb.monitor).startswith(f"{name}/")):
            raise ValueError(f"EarlyStopping(monitor={cb.monitor!r}) would count the same report at every check "
                             "and stop at the NaN that key holds before the first report: use "
                             f"dflash_callbacks.DrafterEarlyStopping(monitor={cb.monitor!r}, ...), which checks "
                             "once per report, or TrailingBaselineStop")


__all__ = ["DrafterEvalCallback", "EvalReport"]
