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
from collections.abc import Callable
from typing import Any

from typing_extensions import Unpack

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, EarlyStopping
from torch import nn

from ..engine.drafters import check_drafter_config, drafter_config_of, refuse_collective_wrappers, resolve_drafter
from ..engine.eval_engine import EvalEngine
from ..engine.adapter import EvalAdapter
from ..model import DrafterConfig
from ..settings import LIGHTNING_NAMES, EvalSettings, LightningEvalFields, eval_settings
from .host import LightningHost, fit_ends

RENAME = LIGHTNING_NAMES  # Lightning's own spelling (`ModelCheckpoint`'s every_n_train_steps); both are taken


class DrafterEvalCallback(EvalAdapter, Callback):
    """Snapshot the drafter every `every_n_train_steps` steps and score it in the background.

    Takes an `EvalSettings` (`settings=`) or its fields, and where the drafter is.

    Args:
        cache, target, baseline: the hidden-state cache, the target's folder and the baseline (a drafter folder
            or a saved report); by position or by name.
        settings: an `EvalSettings` instead of its fields.
        **fields: any other field of `EvalSettings` (every_n_train_steps, also spelled every_n_steps,
            scoring, runner, ...: `LightningEvalFields`;
            docs/configuration.md lists each with its default).
        drafter: attribute path on the LightningModule, or a function module -> drafter.
        drafter_config: a DrafterConfig or config.json path, when the drafter has none at `.config`.
    """

    def __init__(self, cache: str | os.PathLike[str] | None = None, target: str | os.PathLike[str] | None = None,
                 baseline: str | os.PathLike[str] | None = None, *, settings: EvalSettings | None = None,
                 drafter: str | Callable[[pl.LightningModule], nn.Module] = "drafter",
                 drafter_config: DrafterConfig | str | os.PathLike[str] | None = None,
                 **fields: Unpack[LightningEvalFields]):
        super().__init__()
        given = {"cache": cache, "target": target, "baseline": baseline}
        self.engine = EvalEngine(eval_settings(settings, given, fields, type(self).__name__), names=RENAME)
        if not (isinstance(drafter, str) or callable(drafter)):
            raise TypeError("drafter must be an attribute name or a function LightningModule -> drafter")
        self.drafter, self.drafter_config = drafter, check_drafter_config(drafter_config)


    @property
    def every_n_train_steps(self) -> int:
        return self.engine.settings.every_n_steps

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    def _module(self, pl_module: nn.Module) -> nn.Module:
        return resolve_drafter(pl_module, self.drafter, type(self).__name__)

    # ------------------------------------------------------------------ hooks
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
        self.engine.end(trainer.global_step, trainer.current_epoch, self._module(pl_module), where="the fit")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.engine.end(error=exception, where="the fit")


def eval_callbacks(callbacks) -> list[DrafterEvalCallback]:
    """The DrafterEvalCallbacks among `callbacks` (two of one name share a checkpoint key, so Lightning
    refuses them when the Trainer is made)."""
    return [cb for cb in callbacks if isinstance(cb, DrafterEvalCallback)]


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


__all__ = ["DrafterEvalCallback"]
