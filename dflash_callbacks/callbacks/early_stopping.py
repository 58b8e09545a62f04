"""DrafterEarlyStopping: Lightning's EarlyStopping on a drafter metric, checked once per report.

Stock EarlyStopping checks at every validation (or epoch end), and a drafter metric changes only
when a report arrives: it counted one report at every check (patience 3 stopped after 2 reports),
and the NaN a key holds before the first report stopped training at once. This one checks when
`<name>/step` (the step the means are of) changes: patience counts reports. With several
processes the means reach every rank at the same step, so the cross-rank decision never hangs.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping


class DrafterEarlyStopping(EarlyStopping):
    """EarlyStopping on a key of DrafterEvalCallback (e.g. ``"dflash/ratio/ddtree@8/live/mean"``),
    checked once per report. The arguments are EarlyStopping's; ``mode`` defaults to ``"max"`` (a
    higher tau is better) and ``check_on_train_epoch_end`` is not taken (the report decides when)."""

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "max", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 log_rank_zero_only: bool = False):
        if not isinstance(monitor, str) or monitor.count("/") < 2:
            raise ValueError(f"DrafterEarlyStopping monitors a key of DrafterEvalCallback, NAME/.../mean such as "
                             f"'dflash/ratio/ddtree@8/live/mean'; got {monitor!r}")
        super().__init__(monitor, min_delta, patience, verbose, mode, strict, check_finite, stopping_threshold,
                         divergence_threshold, check_on_train_epoch_end=False, log_rank_zero_only=log_rank_zero_only)
        self.step_key = f"{monitor.split('/')[0]}/step"
        self.last_report_step: float | None = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # checked when a report arrives, never at validation

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.callback_metrics.get(self.step_key)
        if step is None or self._should_skip_check(trainer) or float(step) == self.last_report_step:
            return
        self.last_report_step = float(step)
        self._run_early_stopping_check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_report_step": self.last_report_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.last_report_step = state_dict.get("last_report_step")
