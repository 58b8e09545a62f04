"""`EvalAdapter`: what every adapter (Lightning, the plain loop, the transformers Trainer) shows of its
engine, under one set of names, read-only."""

from __future__ import annotations

from collections.abc import Callable

from ..scoring.report import EvalReport
from ..settings import EvalSettings
from .eval_engine import EvalEngine
from .publisher import Subscriber
from .run_folder import RunFolder


class EvalAdapter:
    """The engine's state as an adapter's attributes (`self.engine`)."""

    engine: EvalEngine

    @property
    def settings(self) -> EvalSettings:
        return self.engine.settings

    @property
    def scoring(self):
        return self.engine.scoring

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def metrics(self) -> dict[str, float]:
        """The latest means, as the loop's own metrics hold them (every rank; NaN before the first report)."""
        return self.engine.state.shown

    @property
    def history(self) -> list[dict]:
        """This run's reports, by step: [{"step", "mean", "intervals", "versus"}] (every rank)."""
        return self.engine.history

    @property
    def errors(self) -> int:
        return self.engine.errors

    @property
    def skipped(self) -> int:
        return self.engine.state.skipped

    @property
    def reports(self) -> list[EvalReport]:
        """The reports published by this process (rank 0), in arrival order."""
        return self.engine.publisher.reports

    @property
    def baseline_report(self) -> EvalReport | None:
        return self.engine.baseline_report

    @property
    def run(self) -> RunFolder | None:
        return self.engine.run

    @property
    def run_id(self) -> str | None:
        return self.engine.run_id

    @property
    def should_stop(self) -> bool:
        """Whether a stop has reached this rank."""
        return self.engine.state.should_stop

    @property
    def stop_reason(self) -> str | None:
        """Why a stop stopped training (or would have), None before."""
        return self.engine.state.stop_reason

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(report, baseline)` on the training thread of rank 0 for every new report; returns a
        function that unsubscribes it. A subscriber that raises is reported like any failure."""
        return self.engine.subscribe(fn)

    def state_dict(self) -> dict:
        """Primitives only, the same on every rank: put it in your checkpoint."""
        return self.engine.state_dict()
