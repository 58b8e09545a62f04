r"""
TrailingBaselineStop
^^^^^^^^^^^^^^^^^^^^

Stop training when the drafter keeps trailing the baseline drafter with no prospect of catching up.

At ``setup`` it links to its report source, the ``DrafterEvalCallback`` in ``trainer.callbacks`` (the one
named by ``eval_callback``, or the only one), checks that the monitored method is one that callback scores,
and subscribes to its reports. It reads one monitored number from each report (on rank 0, on the training
thread), keeps the history, and decides. On a resume the history is rebuilt from the run's results.jsonl, so
reports that arrived after the checkpoint still count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ..checks import check_bool, check_choice, check_int, check_number
from ..scoring.methods import Monitor
from .publish import ReportSource, report_sources

if TYPE_CHECKING:
    from dflash_callbacks.scoring.report import EvalReport

ACTIONS = ("stop", "warn")
DEFAULT_MIN_RATIO = 0.9
MIN_PROJECTION_POINTS = 3
PROJECTION_CURVE = "a+b*log(step)"


@dataclass(frozen=True)
class Decision:
    """What :meth:`TrailingBaselineStop.decide` concluded from a history.

    ``stop``: the policy says stop. ``reason``: a human-readable explanation (also when not stopping).
    ``wait_count``: consecutive trailing reports at the end of the history (after the grace period).
    ``projected``: the projected value at the horizon, when a projection was made.
    """

    stop: bool
    reason: str
    wait_count: int = 0
    projected: float | None = None


def validate_monitor(monitor: str) -> str:
    """Return ``monitor`` if it reads ``METHOD/AGGREGATE`` (e.g. ``"ddtree@8/live"``), else raise ``ValueError``."""
    try:
        return str(Monitor.parse(monitor))
    except ValueError as e:
        raise ValueError(f"`monitor`: {e}") from None


def fit_projection(steps: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``value = a + b * log(step)``; returns ``(a, b)``.

    Needs positive steps and at least two distinct ones, else ``ValueError``.
    """
    if len(steps) != len(values):
        raise ValueError(f"steps and values differ in length: {len(steps)} vs {len(values)}")
    if any(s <= 0 for s in steps):
        raise ValueError(f"steps must be positive for a log fit, got {list(steps)}")
    if len(set(steps)) < 2:
        raise ValueError(f"a fit needs at least 2 distinct steps, got {list(steps)}")
    xs = [math.log(s) for s in steps]
    x_mean, y_mean = sum(xs) / len(xs), sum(values) / len(values)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    sxy = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, values))
    b = sxy / sxx
    return y_mean - b * x_mean, b


def projected_value(a: float, b: float, step: float) -> float:
    """The fitted curve ``a + b * log(step)`` at ``step`` (> 0)."""
    return a + b * math.log(step)


class TrailingBaselineStop(Callback):
    r"""Stop training when the drafter trails the baseline for ``patience`` reports in a row.

    A report *trails* when ``ours < threshold(baseline)``, where ``threshold`` is ``min_ratio * baseline``
    (ratio mode) or ``baseline + min_delta`` (delta mode), both on the monitored number of the two reports
    (mean over tasks). Equal to the threshold (up to float rounding) is not trailing; a non-finite ``ours``
    trails.

    Args:
        monitor: ``METHOD/AGGREGATE``: METHOD is ``vanilla``, ``ddtree@N`` or ``top@K``; AGGREGATE is
            ``live`` or ``dense``.
        min_ratio: ours / baseline must be ``>= min_ratio`` (> 0, e.g. 0.9).
        min_delta: ours - baseline must be ``>= min_delta`` (any finite number, e.g. -0.5).
            Give at most one of ``min_ratio``/``min_delta``. With neither, ``min_ratio=0.9``
            (``DEFAULT_MIN_RATIO``): the drafter trails while it is below 90% of the baseline.
        patience: consecutive trailing reports (>= 1) before acting. A report at or above the threshold
            resets the count.
        grace_steps: reports with ``step < grace_steps`` are kept in the history (and feed the projection)
            but are never decided on and never count toward ``patience``.
        projection: when ``True``, a trailing run is only stopped when the curve fitted to the last
            ``projection_window`` reports does not reach the threshold by the end of training.
            The curve is ``value = a + b * log(step)`` (least squares). Acceptance length versus step
            rises fast and then saturates; a log curve keeps rising, so it is over-optimistic compared to
            the saturating truth and a "will not reach it" verdict is conservative. Rules:

            * fewer than 3 usable reports (positive, distinct steps, finite values) in the window: the
              projection cannot conclude and the callback does **not** stop (it waits for more reports);
            * the horizon is ``trainer.max_steps``, or, when that is unset, the trainer's
              ``estimated_stepping_batches`` (from ``max_epochs``); with no finite horizon, a rising curve
              (``b > 0``) eventually reaches any threshold, so only a flat or falling curve stops.
        projection_window: how many of the latest reports the fit uses (>= 3).
        action: ``"stop"`` sets ``trainer.should_stop``; ``"warn"`` only warns with the reason. A decision
            taken when training ends anyway (``max_steps``/``max_epochs`` reached: the report of the last
            snapshot; or ``should_stop`` set by another callback) only warns, whatever the action.
        sync_every_n_steps: on multi-process runs, every this many global steps all ranks receive rank 0's
            pending decision (``trainer.strategy.broadcast``), so a stop lands within
            ``sync_every_n_steps`` steps of the report. A single process stops at the report itself.
        verbose: log a status line for every report that does not stop training.
        eval_callback: the ``name`` of the DrafterEvalCallback to follow; ``None``: the only one in
            ``trainer.callbacks``.

    Attributes:
        history: ``[(step, value), ...]`` of our monitored value, sorted by step.
        wait_count: consecutive trailing reports at the end of the history.
        stop_reason: why training was (or, with ``action="warn"`` or once it ends anyway, would be) stopped;
            ``None`` before.
        stopped_step: ``trainer.global_step`` when ``trainer.should_stop`` was set (0 if never). The reason
            names the report's (snapshot's) step, which is earlier because scoring runs in the background.

    Decisions are made from the history by :meth:`decide` against the current baseline value, so a
    resumed run (see ``state_dict``) continues the same count.
    """

    def __init__(
        self,
        monitor: str = "ddtree@8/live",
        min_ratio: float | None = None,
        min_delta: float | None = None,
        patience: int = 3,
        grace_steps: int = 0,
        projection: bool = False,
        projection_window: int = 5,
        action: str = "stop",
        sync_every_n_steps: int = 1,
        verbose: bool = True,
        eval_callback: str | None = None,
    ) -> None:
        super().__init__()
        self.monitor = validate_monitor(monitor)
        if min_ratio is not None and min_delta is not None:
            raise ValueError(f"give one of `min_ratio` or `min_delta`, not both (got {min_ratio} and {min_delta})")
        self.min_ratio = check_number("`min_ratio`", min_ratio, above=0, optional=True)
        self.min_delta = check_number("`min_delta`", min_delta, optional=True)
        if self.min_ratio is None and self.min_delta is None:
            self.min_ratio = DEFAULT_MIN_RATIO
        if self.min_ratio is not None and self.min_ratio > 1:
            rank_zero_warn(f"TrailingBaselineStop(min_ratio={self.min_ratio:g}): the drafter must reach "
                           f"{self.min_ratio:g}x the baseline or training stops; a share is written as a fraction "
                           f"(0.9 for 90%)")
        self.patience = check_int("`patience`", patience, 1)
        self.grace_steps = check_int("`grace_steps`", grace_steps, 0)
        self.projection = check_bool("`projection`", projection)
        self.projection_window = check_int("`projection_window`", projection_window, MIN_PROJECTION_POINTS)
        self.action = check_choice("`action`", action, ACTIONS)
        self.sync_every_n_steps = check_int("`sync_every_n_steps`", sync_every_n_steps, 1)
        self.verbose = check_bool("`verbose`", verbose)
        if eval_callback is not None and not isinstance(eval_callback, str):
            raise ValueError(f"`eval_callback` must be the name of a DrafterEvalCallback or None; got {eval_callback!r}")
        self.eval_callback = eval_callback
        self.source: ReportSource | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._fresh()

    def _fresh(self) -> None:
        """The state of a fit that has seen nothing yet (a resume then loads its checkpoint's)."""
        self.history: list[tuple[int, float]] = []
        self.wait_count = 0
        self.stop_reason: str | None = None
        self.stopped_step = 0
        self.last_decision: Decision | None = None
        self._pending: str | None = None  # rank 0: a stop reason not yet broadcast
        self._last_sync_step: int | None = None
        self._warned_no_baseline = False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor)

    # ----- pure pieces -------------------------------------------------------------------------------

    def threshold(self, baseline_value: float) -> float:
        """The value ours must reach: ``min_ratio * baseline`` or ``baseline + min_delta``."""
        if self.min_delta is not None:
            return baseline_value + self.min_delta
        return self.min_ratio * baseline_value

    def is_trailing(self, ours: float, baseline_value: float) -> bool:
        """``ours < threshold(baseline_value)``, float rounding aside (1e-9 relative counts as equal, so
        ``0.9 x 5.2`` does not make 4.68 trail); a non-finite ``ours`` trails."""
        thr = self.threshold(baseline_value)
        return not math.isfinite(ours) or (ours < thr and not math.isclose(ours, thr, rel_tol=1e-9, abs_tol=1e-12))

    def describe_threshold(self, baseline_value: float) -> str:
        """E.g. ``"0.9 x baseline 5.20 = 4.68"`` or ``"baseline 5.20 - 0.5 = 4.70"``."""
        thr = self.threshold(baseline_value)
        if self.min_delta is not None:
            sign = "-" if self.min_delta < 0 else "+"
            return f"baseline {baseline_value:.2f} {sign} {abs(self.min_delta):g} = {thr:.2f}"
        return f"{self.min_ratio:g} x baseline {baseline_value:.2f} = {thr:.2f}"

    def decide(
        self, history: Sequence[Sequence[float]], baseline_value: float, max_steps: int | None = None
    ) -> Decision:
        """Decide from ``history`` (``(step, value)`` pairs) against ``baseline_value``.

        ``max_steps`` is the projection horizon (``None`` or ``<= 0``: unknown). Pure: reads only the
        constructor settings.
        """
        ordered = sorted((int(s), float(v)) for s, v in history)
        eligible = [(s, v) for s, v in ordered if s >= self.grace_steps]
        if not eligible:
            return Decision(False, f"no report at or after grace_steps={self.grace_steps} yet")
        thr = self.threshold(baseline_value)
        wait = 0
        for _, value in reversed(eligible):
            if not self.is_trailing(value, baseline_value):
                break
            wait += 1
        last_step, last_value = eligible[-1]
        if wait == 0:
            return Decision(
                False, f"{self.monitor} {last_value:.2f} >= {self.describe_threshold(baseline_value)}: not trailing"
            )
        trailing = f"{self.monitor} {last_value:.2f} < {self.describe_threshold(baseline_value)}"
        if wait < self.patience:
            return Decision(False, f"{trailing}: trailing {wait}/{self.patience} reports", wait)
        trailing += f" for {wait} reports in a row (steps {eligible[-wait][0]}-{last_step})"
        if not self.projection:
            return Decision(True, trailing, wait)

        stop, projection, projected = self._projection(ordered, thr, last_step, max_steps)
        return Decision(stop, trailing + projection, wait, projected)

    def _projection(
        self, ordered: list[tuple[int, float]], thr: float, last_step: int, max_steps: int | None
    ) -> tuple[bool, str, float | None]:
        """(stop, explanation, projected value) from the curve fitted to the last ``projection_window`` reports."""
        points = {s: v for s, v in ordered[-self.projection_window :] if s > 0 and math.isfinite(v)}
        if len(points) < MIN_PROJECTION_POINTS:
            text = f", but the projection needs {MIN_PROJECTION_POINTS} reports with positive steps and finite values"
            return False, f"{text}, has {len(points)}: not stopping yet", None
        a, b = fit_projection(list(points), list(points.values()))
        if max_steps is None or max_steps <= 0:
            if b > 0:
                text = f"; projection {PROJECTION_CURVE} still rises (b={b:.3f}) with no known last step: not stopping"
                return False, text, None
            return True, f"; projection {PROJECTION_CURVE} does not rise (b={b:.3f}), never reaching {thr:.2f}", None
        projected = projected_value(a, b, max(max_steps, last_step))
        reaches = projected >= thr or math.isclose(projected, thr, rel_tol=1e-9)
        verdict = f">= {thr:.2f}: not stopping" if reaches else f"< {thr:.2f}"
        text = f"; projection {PROJECTION_CURVE} reaches {projected:.2f} by max_steps={max_steps} {verdict}"
        return not reaches, text, projected

    # ----- hooks -------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Link to the report source and check the monitor against what it scores, before training."""
        if stage != "fit":
            return
        self._fresh()  # nothing of an earlier fit with this callback: its reason, its undelivered stop
        self.source = find_source(trainer.callbacks, self.eval_callback)
        method = str(Monitor.parse(self.monitor).method)
        scored = self.source.scored_methods()
        if method not in scored:
            raise ValueError(
                f"TrailingBaselineStop monitors {self.monitor!r}, but {self.source.name!r} scores only {scored}; "
                f"monitor one of those, or add it to that callback's scoring (ddtree_budgets / topk)"
            )
        if not self.source.has_baseline():
            rank_zero_warn(f"TrailingBaselineStop: {self.source.name!r} has no baseline, so {self.monitor} is recorded "
                           "but never judged and training is never stopped; give that callback baseline=...")
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._unsubscribe = self.source.subscribe(lambda report, baseline: self.on_dflash_report(
            trainer, pl_module, report, baseline))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The history of this run so far (all of results.jsonl on a resume)."""
        if trainer.is_global_zero and self.source is not None:
            monitor = Monitor.parse(self.monitor)
            self.history = [(int(h["step"]), float(h["mean"][str(monitor.method)][monitor.aggregate]))
                            for h in self.source.run_history(trainer, pl_module)]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def on_dflash_report(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        report: EvalReport,
        baseline: EvalReport | None,
    ) -> None:
        """Record ``report`` and decide. Called on rank 0 only, on the training thread.

        Without a baseline the value is recorded but nothing is decided (warned once). On a single process
        a stop sets ``trainer.should_stop`` at once; on several, it waits for the next sync in
        :meth:`on_train_batch_end`.
        """
        step = trainer.global_step if report.step is None else int(report.step)
        self._record(step, self._read(report, "report"))
        if trainer.should_stop and self.stop_reason and self.stopped_step == trainer.global_step:
            return  # a report of the final snapshot after our stop: recorded, the reason stands
        if baseline is None:
            if not self._warned_no_baseline:
                rank_zero_warn(f"TrailingBaselineStop: no baseline report, {self.monitor} is recorded but not judged")
                self._warned_no_baseline = True
            return
        base = self._read(baseline, "baseline report")
        if not math.isfinite(base):
            rank_zero_warn(f"TrailingBaselineStop: the baseline's {self.monitor} is {base}, not judging step {step}")
            return

        decision = self.decide(self.history, base, _horizon(trainer))
        self.last_decision = decision
        self.wait_count = decision.wait_count
        if not decision.stop:
            if self.verbose:
                rank_zero_info(f"dflash: step {step}: {decision.reason}")
            return
        ending = _ending(trainer)
        if self.action == "warn" or ending:
            why = "action='warn'" if self.action == "warn" else f"training ends anyway: {ending}"
            self.stop_reason = f"dflash: trailing the baseline at step {step} ({why}, not stopping): {decision.reason}"
            rank_zero_warn(self.stop_reason)
            return
        reason = f"dflash: stopping at step {step}: {decision.reason}"
        rank_zero_info(reason)
        if trainer.world_size > 1:
            self._pending = reason
        else:
            self._apply(trainer, reason)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Multi-process runs: every ``sync_every_n_steps`` global steps, broadcast rank 0's pending stop."""
        if trainer.world_size <= 1:
            return
        step = trainer.global_step
        if step % self.sync_every_n_steps or step == self._last_sync_step:
            return
        self._last_sync_step = step
        reason = trainer.strategy.broadcast(self._pending, src=0)
        self._pending = None
        if reason is not None:
            self._apply(trainer, reason)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [[s, v] for s, v in self.history],
            "wait_count": self.wait_count,
            "stopped_step": self.stopped_step,
            "stop_reason": self.stop_reason,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the history and counters. A stop that was pending but not yet broadcast is not restored:
        resuming is a deliberate choice to go on, and the next trailing report decides again."""
        self.history = [(int(s), float(v)) for s, v in state_dict["history"]]
        self.wait_count = int(state_dict["wait_count"])
        self.stopped_step = int(state_dict["stopped_step"])
        self.stop_reason = state_dict["stop_reason"]

    # ----- helpers -----------------------------------------------------------------------------------

    def _read(self, report: EvalReport, what: str) -> float:
        try:
            return float(report.value(self.monitor))
        except KeyError as e:
            raise RuntimeError(
                f"TrailingBaselineStop monitors {self.monitor!r}, which the {what} at step {report.step} lacks: "
                f"{e.args[0]}"
            ) from e

    def _record(self, step: int, value: float) -> None:
        self.history = sorted([(s, v) for s, v in self.history if s != step] + [(step, value)])

    def _apply(self, trainer: pl.Trainer, reason: str) -> None:
        trainer.should_stop = True
        self.stopped_step = trainer.global_step
        self.stop_reason = reason


def find_source(callbacks: Sequence[Callback], name: str | None) -> ReportSource:
    """The report source TrailingBaselineStop follows: the one called `name`, or the only one."""
    sources = report_sources(callbacks)
    names = [cb.name for cb in sources]
    if name is not None:
        sources = [cb for cb in sources if cb.name == name]
        if not sources:
            raise ValueError(f"TrailingBaselineStop(eval_callback={name!r}): no DrafterEvalCallback of that name in "
                             f"trainer.callbacks; found {names}")
    if not sources:
        raise ValueError("TrailingBaselineStop needs a DrafterEvalCallback in trainer.callbacks (it stops on its reports)")
    if len(sources) > 1:
        raise ValueError(f"trainer.callbacks holds several DrafterEvalCallbacks {names}; name the one to follow with "
                         f"TrailingBaselineStop(eval_callback=...)")
    return sources[0]


def _ending(trainer: pl.Trainer) -> str | None:
    """Why the fit loop ends without us (a report of the last snapshot, drained in ``on_train_end``, or one that
    came after another callback stopped training), or ``None`` while training goes on."""
    if trainer.should_stop:
        return "trainer.should_stop is already set"
    if 0 < trainer.max_steps <= trainer.global_step:
        return f"max_steps={trainer.max_steps} reached"
    if trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.fit_loop.epoch_progress.current.processed:
        return f"max_epochs={trainer.max_epochs} reached"
    return None


def _horizon(trainer: pl.Trainer) -> int | None:
    """The last training step: ``max_steps``, else the trainer's estimate from ``max_epochs``; ``None`` if unknown."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return trainer.max_steps
    try:
        estimate = trainer.estimated_stepping_batches
    except MisconfigurationException:
        return None
    return int(estimate) if math.isfinite(estimate) and estimate > 0 else None
