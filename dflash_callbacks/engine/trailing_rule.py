"""The stop's rule, pure: the threshold a drafter must reach against the baseline, whether a report
trails it (with `confidence`, on the upper end of the paired interval too), the decision over a
history with patience, grace and the projection, and whether a threshold can ever be reached.
`TrailingRule` reads only its `settings` (a `StopSettings`); `StopPolicy` (stop.py) follows a run with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..scoring.intervals import MIN_TASKS
from ..settings import StopSettings, split_monitor

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
    """Return ``monitor`` if it reads ``METHOD/AGGREGATE`` (e.g. ``"ddtree@8/live"``: its tau) or
    ``speedup/METHOD/AGGREGATE`` (its predicted speed-up), else raise ``ValueError`` naming both forms."""
    try:
        speedup, parsed = split_monitor(monitor)
    except ValueError as e:
        raise ValueError(f"`monitor`: {e}") from None
    return ("speedup/" if speedup else "") + str(parsed)


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
    return split_monitor(monitor)[1].method.block or run_block


class TrailingRule:
    """The pure pieces of the stop, on `self.settings` (each setting also an attribute: `rule.patience`)."""

    settings: StopSettings
    NAME: str | None = None  # what its lines call it (None: its class's name)

    @property
    def shown_name(self) -> str:
        return self.NAME or type(self).__name__

    @property
    def monitor(self) -> str:
        return self.settings.monitor

    @property
    def tau_monitor(self) -> str:
        """The monitor's METHOD/AGGREGATE (a speed-up monitor's without its `speedup/`)."""
        return str(split_monitor(self.monitor)[1])

    @property
    def speedup(self) -> bool:
        """Whether it judges the predicted speed-up (`speedup/METHOD/AGGREGATE`, scoring.costs) rather than tau."""
        return split_monitor(self.monitor)[0]

    @property
    def min_ratio(self) -> float | None:
        return self.settings.min_ratio

    @property
    def min_delta(self) -> float | None:
        return self.settings.min_delta

    @property
    def patience(self) -> int:
        return self.settings.patience

    @property
    def grace_steps(self) -> int:
        return self.settings.grace_steps

    @property
    def projection(self) -> bool:
        return self.settings.projection

    @property
    def projection_window(self) -> int:
        return self.settings.projection_window

    @property
    def action(self) -> str:
        return self.settings.action

    @property
    def verbose(self) -> bool:
        return self.settings.verbose

    @property
    def confidence(self) -> float | None:
        return self.settings.confidence

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
        name = self.shown_name
        if self.speedup:
            return None  # a speed-up's ratio to the baseline's may pass any tau's: its costs decide
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
