"""The stop decision: stop training when the drafter keeps trailing the baseline drafter with
no prospect of catching up. No framework here.

`StopPolicy` holds the settings, the pure pieces (`threshold`, `is_trailing`, `decide`, the
projection) and what one stop has seen (its history, its count, its reason). `Stops` is the
set of policies that follow one engine's reports, with the stop they decided until it has
reached every rank. Each adapter maps them onto its loop: `TrailingBaselineStop` (Lightning)
is a `StopPolicy`, and so is what `DrafterEvaluator(stop=...)` and the transformers callback take.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checks import did_you_mean
from ..scoring.intervals import MIN_TASKS
from ..scoring.methods import Monitor
from ..settings import StopSettings, built, describe, fields_of, signature

if TYPE_CHECKING:
    from ..scoring.intervals import Comparison
    from ..scoring.report import EvalReport

MIN_PROJECTION_POINTS = 3
PROJECTION_CURVE = "a+b*log(step)"


@dataclass(frozen=True)
class Decision:
    """What :meth:`StopPolicy.decide` concluded from a history.

    ``stop``: the policy says stop. ``reason``: a human-readable explanation (also when not stopping).
    ``wait_count``: consecutive trailing reports at the end of the history (after the grace period).
    ``projected``: the projected value at the horizon, when a projection was made.
    """

    stop: bool
    reason: str
    wait_count: int = 0
    projected: float | None = None


@dataclass(frozen=True)
class Moment:
    """Where training stands when a report arrives: the step now, the last step (None when not
    known: the projection's horizon), and why training ends anyway (None while it goes on)."""

    step: int
    horizon: int | None = None
    ending: str | None = None


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


def monitor_block(monitor: str, run_block: int) -> int:
    """The block size `monitor` is scored at: its method's `:bB` (`vanilla:b2/live`: 2), else the run's."""
    return Monitor.parse(monitor).method.block or run_block


class StopPolicy:
    r"""Stop training when the drafter trails the baseline for ``patience`` reports in a row.

    A report *trails* when ``ours < threshold(baseline)``, where ``threshold`` is ``min_ratio * baseline``
    (ratio mode) or ``baseline + min_delta`` (delta mode), both on the monitored number of the two reports
    (mean over tasks), and, with ``confidence`` (the default), only when the whole 95% interval of the
    ratio (delta) against the baseline, paired on the same anchors, lies below ``min_ratio`` (``min_delta``):
    a gap the cache can not tell from noise never counts. Equal to the threshold (up to float rounding) is
    not trailing; a non-finite ``ours`` trails. Reports before ``grace_steps`` are recorded, never judged.

    With ``projection``, a trailing run is only stopped when the curve ``a + b * log(step)``, fitted (least
    squares) to the last ``projection_window`` reports, does not reach the threshold by the end of training.
    Acceptance length versus step rises fast and then saturates; a log curve keeps rising, so it is
    over-optimistic compared to the saturating truth and a "will not reach it" verdict is conservative.
    Fewer than 3 usable reports (positive, distinct steps, finite values) in the window: the projection
    cannot conclude and training is not stopped. The horizon is the loop's last step (Lightning:
    ``max_steps``, else its estimate from ``max_epochs``); with no finite horizon only a flat or falling
    curve stops. A decision taken when training ends anyway (the last step's report; another callback
    stopped training) only warns, whatever the action. Once the baseline's report is in hand, a cache too
    small to ever resolve ``min_ratio`` (the baseline's own interval wider than the margin) is said in one
    line; a report without an interval (scored before scorer version 4) is judged by its value.

    Takes a `StopSettings` or its fields as keywords (each readable as an attribute: ``policy.patience``).

    Args:
{args}

    Attributes:
        history: ``[(step, value), ...]`` of our monitored value, sorted by step.
        wait_count: consecutive trailing reports at the end of the history.
        stop_reason: why training was (or, with ``action="warn"`` or once it ends anyway, would be) stopped;
            ``None`` before.
        stopped_step: the training step at which the stop reached every rank (0 if never). The reason
            names the report's (snapshot's) step, which is earlier because scoring runs in the background.
    """

    def __init__(self, *args: Any, **fields: Any) -> None:
        self.settings = built(StopSettings, args, fields, type(self).__name__)
        if self.min_ratio is not None and self.min_ratio > 1:
            warnings.warn(f"{type(self).__name__}(min_ratio={self.min_ratio:g}): the drafter must reach "
                          f"{self.min_ratio:g}x the baseline or training stops; a share is written as a fraction "
                          "(0.9 for 90%)", UserWarning, stacklevel=2)
        if self.patience < 2:
            warnings.warn(f"{type(self).__name__}(patience={self.patience}): one report below the threshold stops "
                          "training, and over many reports a drafter right at the threshold trips one by chance: "
                          "patience, not the 95% level, keeps false stops down (the default 3; docs/numbers.md)",
                          UserWarning, stacklevel=2)
        self.reset()

    __init__.__signature__ = signature(StopSettings)

    def reset(self) -> None:
        """The state of a run that has seen nothing yet (a resume then loads its checkpoint's)."""
        self.history: list[tuple[int, float]] = []
        self.bounds: dict[int, float] = {}  # step -> the upper end of the ratio's (delta's) interval
        self.wait_count = 0
        self.stop_reason: str | None = None
        self.stopped_step = 0
        self.last_decision: Decision | None = None
        self._warned_no_baseline = False

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

    def trails(self, value: float, upper: float | None, baseline_value: float) -> bool:
        """Whether one report trails: ``is_trailing`` on its value and, with ``confidence``, the upper end
        of its ratio's (delta's) interval, ``upper``, below ``min_ratio`` (``min_delta``) too. ``upper``
        None (a report without an interval) leaves the value alone to judge; ``math.inf`` (a cache of fewer
        than MIN_TASKS tasks: no run-level interval) never trails."""
        if not self.is_trailing(value, baseline_value):
            return False
        if self.confidence is None or upper is None or not math.isfinite(value):
            return True
        limit = self.min_ratio if self.min_delta is None else self.min_delta
        return upper < limit and not math.isclose(upper, limit, rel_tol=1e-9, abs_tol=1e-12)

    def decide(
        self, history: Sequence[Sequence[float]], baseline_value: float, max_steps: int | None = None,
        bounds: dict[int, float] | None = None,
    ) -> Decision:
        """Decide from ``history`` (``(step, value)`` pairs) against ``baseline_value``; ``bounds`` maps a
        step to the upper end of its ratio's (delta's) interval (``confidence``: see ``trails``).

        ``max_steps`` is the projection horizon (``None`` or ``<= 0``: unknown). Pure: reads only the
        constructor settings.
        """
        bounds = bounds or {}
        ordered = sorted((int(s), float(v)) for s, v in history)
        eligible = [(s, v) for s, v in ordered if s >= self.grace_steps]
        if not eligible:
            return Decision(False, f"no report at or after grace_steps={self.grace_steps} yet")
        thr = self.threshold(baseline_value)
        wait = 0
        for step, value in reversed(eligible):
            if not self.trails(value, bounds.get(step), baseline_value):
                break
            wait += 1
        last_step, last_value = eligible[-1]
        if wait == 0:
            upper = bounds.get(last_step)
            if self.is_trailing(last_value, baseline_value) and self.confidence is not None and upper == math.inf:
                return Decision(False, f"{self.monitor} {last_value:.2f} < {self.describe_threshold(baseline_value)}, "
                                       f"but the cache has fewer than {MIN_TASKS} tasks, too few for a run-level "
                                       "interval: not judged")
            if self.is_trailing(last_value, baseline_value) and self.confidence is not None and upper is not None:
                kind, limit = ("ratio", self.min_ratio) if self.min_delta is None else ("delta", self.min_delta)
                return Decision(False, f"{self.monitor} {last_value:.2f} < {self.describe_threshold(baseline_value)}, "
                                       f"but the {kind}'s 95% interval reaches {upper:.2f} >= {limit:g}: not "
                                       "distinguishable from the threshold at this cache size, not trailing")
            return Decision(
                False, f"{self.monitor} {last_value:.2f} >= {self.describe_threshold(baseline_value)}: not trailing"
            )
        trailing = f"{self.monitor} {last_value:.2f} < {self.describe_threshold(baseline_value)}"
        if self.confidence is not None and bounds.get(last_step) is not None:
            kind = "ratio" if self.min_delta is None else "delta"
            trailing += f" (the {kind}'s 95% interval reaches {bounds[last_step]:.2f})"
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

    def unreachable(self, most_tau: Callable[[int], int], run_block: int) -> str | None:
        """One line when this stop's threshold is above the most tau can be at the block its monitor is scored
        at (`monitor_block`: its `:bB`, else the run's `run_block`), `most_tau(block)` (the drafter's proposals
        per block + 1), for any baseline (a baseline's tau is at least 1): ours could never reach it. None when
        it can be reached."""
        name = type(self).__name__
        block_size = monitor_block(self.monitor, run_block)
        top = most_tau(block_size)
        most = f"{top}, the most tau can be at block size {block_size} ({top - 1} proposals + 1)"
        if self.min_delta is not None and 1 + self.min_delta > top:
            return (f"{name}(min_delta={self.min_delta:g}): its threshold, the baseline's tau + {self.min_delta:g}, "
                    f"is above {most}, for any baseline, so it can never be reached; give a min_delta below "
                    f"{top - 1}, e.g. -0.5")
        if self.min_delta is None and self.min_ratio > top:
            return (f"{name}(min_ratio={self.min_ratio:g}): its threshold, {self.min_ratio:g} x the baseline's tau, "
                    f"is above {most}, for any baseline, so it can never be reached; min_ratio is a share of the "
                    "baseline's tau: e.g. min_ratio=0.9 for 90%")
        return None

    # ----- following a run ---------------------------------------------------------------------------

    def on_report(self, report: EvalReport, baseline: EvalReport | None, now: Moment,
                  info: Callable[[str], None], warn: Callable[[str], None], prefix: str = "dflash",
                  versus: Comparison | None = None) -> str | None:
        """Record ``report`` and decide (rank 0, on the training thread); ``versus`` is its paired
        comparison with the baseline on this monitor (for ``confidence``). Returns the reason to stop
        training with, or None. Without a baseline the value is recorded but nothing is decided (said once)."""
        step = now.step if report.step is None else int(report.step)
        upper = None if versus is None else math.inf if versus.too_few_tasks else \
            versus.ratio.hi if self.min_delta is None else versus.delta.hi
        self.record(step, self.read(report, "report"), upper)
        if self.stop_reason and self.stopped_step and now.ending:
            return None  # a report of the final snapshot after our stop: recorded, the reason stands
        if baseline is None:
            if not self._warned_no_baseline:
                warn(f"{type(self).__name__}: no baseline report, {self.monitor} is recorded but not judged")
                self._warned_no_baseline = True
            return None
        base = self.read(baseline, "baseline report")
        if not math.isfinite(base):
            warn(f"{type(self).__name__}: the baseline's {self.monitor} is {base}, not judging step {step}")
            return None

        decision = self.decide(self.history, base, now.horizon, self.bounds)
        self.last_decision = decision
        self.wait_count = decision.wait_count
        if not decision.stop:
            if self.verbose:
                info(f"{prefix}: step {step}: {decision.reason}")
            return None
        if self.action == "warn" or now.ending:
            why = "action='warn'" if self.action == "warn" else f"training ends anyway: {now.ending}"
            self.stop_reason = f"{prefix}: trailing the baseline at step {step} ({why}, not stopping): {decision.reason}"
            warn(self.stop_reason)
            return None
        reason = f"{prefix}: stopping at step {step}: {decision.reason}"
        info(reason)
        return reason

    def stopped(self, reason: str, step: int) -> None:
        """The stop this policy decided reached every rank at training step `step`."""
        self.stopped_step = step
        self.stop_reason = reason

    def read(self, report: EvalReport, what: str) -> float:
        try:
            return float(report.value(self.monitor))
        except KeyError as e:
            raise RuntimeError(
                f"{type(self).__name__} monitors {self.monitor!r}, which the {what} at step {report.step} lacks: "
                f"{e.args[0]}"
            ) from e

    def record(self, step: int, value: float, upper: float | None = None) -> None:
        self.history = sorted([(s, v) for s, v in self.history if s != step] + [(step, value)])
        self.bounds.pop(step, None)
        if upper is not None:
            self.bounds[step] = upper

    def load_history(self, history: list[dict]) -> None:
        """This run's reports so far (``[{"step", "mean": {method: {aggregate: value}}, "versus": ...}]``,
        a resume's rebuilt from results.jsonl): the monitored value of each, and its interval's upper end."""
        monitor = Monitor.parse(self.monitor)
        kind = "ratio" if self.min_delta is None else "delta"
        self.history, self.bounds = [], {}
        for h in history:
            versus = (h.get("versus") or {}).get(self.monitor)
            upper = None if versus is None else math.inf if versus.get("verdict") == "too few tasks" else \
                float(versus[kind][2])
            self.record(int(h["step"]), float(h["mean"][str(monitor.method)][monitor.aggregate]), upper)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [[s, v] for s, v in self.history],
            "bounds": [[s, u] for s, u in sorted(self.bounds.items())],
            "wait_count": self.wait_count,
            "stopped_step": self.stopped_step,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the history and counters. A stop that was decided but had not reached every rank is
        not restored: resuming is a deliberate choice to go on, and the next trailing report decides again."""
        self.history = [(int(s), float(v)) for s, v in state_dict["history"]]
        self.bounds = {int(s): float(u) for s, u in state_dict.get("bounds", [])}  # none before intervals
        self.wait_count = int(state_dict["wait_count"])
        self.stopped_step = int(state_dict["stopped_step"])
        self.stop_reason = state_dict["stop_reason"]


StopPolicy.__doc__ = StopPolicy.__doc__.replace("{args}", describe(StopSettings))
for _field in fields_of(StopSettings):  # policy.monitor, policy.patience, ...: the settings' own values
    setattr(StopPolicy, _field.name, property(lambda self, name=_field.name: getattr(self.settings, name),
                                              doc=_field.metadata["help"]))


class Stops:
    """The policies that follow one engine's reports, and the stop one of them decided (on rank 0),
    until it has reached every rank (`deliver`)."""

    def __init__(self) -> None:
        self.policies: list[StopPolicy] = []
        self.pending: tuple[int, str] | None = None  # (policy index, reason): decided, not yet delivered

    def add(self, policy: StopPolicy, methods: list[str], source: str) -> None:
        """Follow `policy`, after checking that its monitor is one of `methods` (what `source` scores)."""
        method = str(Monitor.parse(policy.monitor).method)
        if method not in methods:
            raise ValueError(f"{type(policy).__name__} monitors {policy.monitor!r}, but {source!r} scores only "
                             f"{methods}; monitor one of those, or add it to that callback's scoring "
                             "(ddtree_budgets / topk / block_sizes / attentions)"
                             + did_you_mean(policy.monitor, [f"{m}/{Monitor.parse(policy.monitor).aggregate}"
                                                             for m in methods]))
        if policy not in self.policies:
            self.policies.append(policy)

    def remove(self, policy: StopPolicy) -> None:
        if policy in self.policies:
            self.policies.remove(policy)

    def judge(self, policy: StopPolicy, report: EvalReport, baseline: EvalReport | None, now: Moment,
              info: Callable[[str], None], warn: Callable[[str], None], prefix: str,
              versus: Comparison | None = None) -> None:
        """`policy` records the report and decides (rank 0); the first stop decided waits for delivery."""
        reason = policy.on_report(report, baseline, now, info, warn, prefix, versus)
        if reason is not None and self.pending is None:
            self.pending = (self.policies.index(policy), reason)

    def take(self) -> tuple[int, str] | None:
        """The stop to deliver now (rank 0), once."""
        pending, self.pending = self.pending, None
        return pending

    def deliver(self, decided: tuple[int, str] | None, step: int) -> str | None:
        """On every rank: tell the policy its stop arrived at `step`; the reason, or None."""
        if decided is None:
            return None
        index, reason = decided
        self.policies[index].stopped(reason, step)
        return reason
