"""The stop: stop training when the drafter keeps trailing the baseline drafter with no prospect of
catching up. No framework here.

`StopPolicy` is the settings and the rule (`trailing_rule.TrailingRule`); its one call after each report,
`evaluate(history, baseline, now, state)`, returns a `Verdict` (should it stop, why, and the stop's new
`StopState`), as Lightning's `EarlyStopping._evaluate_stopping_criteria` returns `(should_stop, reason)`.
The state lives in the engine's `RunState` (one per stop followed), which reduces the decision across
ranks in one place; a policy reads it there (`follow`). Each adapter maps policies onto its loop:
`TrailingBaselineStop` (Lightning) is a `StopPolicy`, and so is what `DrafterEvaluator(stop=...)` and the
transformers callback take.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Unpack

from ..checks import did_you_mean
from ..scoring.methods import Monitor
from ..scoring.report import EvalReport
from ..settings import StopFields, StopSettings, stop_settings
from .trailing_rule import (  # noqa: F401  (the rule's names, where the stop is imported from)
    MIN_PROJECTION_POINTS, PROJECTION_CURVE, Decision, Moment, TrailingRule, fit_projection, monitor_block,
    projected_value, validate_monitor,
)


@dataclass(frozen=True)
class StopState:
    """What one stop has seen of a run: its count of trailing reports, its reason (why it stopped training,
    or would have), the training step its stop reached every rank at (0: never), its latest decision, and
    whether it said it has no baseline."""

    wait_count: int = 0
    stop_reason: str | None = None
    stopped_step: int = 0
    last_decision: Decision | None = None
    warned_no_baseline: bool = False

    def reached(self, reason: str, step: int) -> StopState:
        return dataclasses.replace(self, stop_reason=reason, stopped_step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "stopped_step": self.stopped_step, "stop_reason": self.stop_reason}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any]) -> StopState:
        """A checkpoint's (an earlier version's also held the history, now rebuilt from the run's). A stop
        decided that had not reached every rank is not restored: resuming is a deliberate choice to go on,
        and the next trailing report decides again."""
        return cls(wait_count=int(state_dict["wait_count"]), stopped_step=int(state_dict["stopped_step"]),
                   stop_reason=state_dict["stop_reason"])


@dataclass(frozen=True)
class Verdict:
    """What `StopPolicy.evaluate` concluded from one report: whether training stops, the reason (also a
    reason given without stopping: action="warn", training ending anyway), the stop's new state, and the
    lines to say, `("info" | "warn", text)`."""

    should_stop: bool
    reason: str | None
    state: StopState
    said: list[tuple[str, str]] = field(default_factory=list)


class StopPolicy(TrailingRule):
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
        settings: a `StopSettings`, or the monitor (``METHOD/AGGREGATE``) by position.
        **fields: any field of `StopSettings` (monitor, min_ratio, min_delta, patience, grace_steps, projection,
            projection_window, action, verbose, confidence: `StopFields`; docs/configuration.md lists each
            with its default).

    Attributes:
        history: ``[(step, value), ...]`` of our monitored value in the run followed, sorted by step.
        last_decision: the `Decision` on the latest report judged (None before).
        wait_count: consecutive trailing reports at the end of the history.
        stop_reason: why training was (or, with ``action="warn"`` or once it ends anyway, would be) stopped;
            ``None`` before.
        stopped_step: the training step at which the stop reached every rank (0 if never). The reason
            names the report's (snapshot's) step, which is earlier because scoring runs in the background.
    """

    def __init__(self, settings: StopSettings | str | None = None, **fields: Unpack[StopFields]) -> None:
        self.settings = stop_settings(settings, fields, self.shown_name)
        if self.min_ratio is not None and self.min_ratio > 1:
            warnings.warn(f"{self.shown_name}(min_ratio={self.min_ratio:g}): the drafter must reach "
                          f"{self.min_ratio:g}x the baseline or training stops; a share is written as a fraction "
                          "(0.9 for 90%)", UserWarning, stacklevel=2)
        if self.patience < 2:
            warnings.warn(f"{self.shown_name}(patience={self.patience}): one report below the threshold stops "
                          "training, and over many reports a drafter right at the threshold trips one by chance: "
                          "patience, not the 95% level, keeps false stops down (the default 3; docs/numbers.md)",
                          UserWarning, stacklevel=2)
        self._follow: Callable[[], tuple[list[dict], StopState] | None] | None = None
        self.reset()

    def reset(self) -> None:
        """The state of a stop that has seen nothing yet (a resume then loads its checkpoint's); an engine
        that follows it starts its run from this."""
        self._kept: tuple[list[dict], StopState] = ([], StopState())

    # ----- what it has seen -------------------------------------------------------------------------
    def follow(self, read: Callable[[], tuple[list[dict], StopState] | None] | None,
               kept: tuple[list[dict], StopState] | None = None) -> None:
        """Read the run's history and this stop's state with `read()` (the engine's that follows it); None:
        no engine follows it any more, and `kept` is what it had seen."""
        self._follow = read
        if kept is not None:
            self._kept = (list(kept[0]), kept[1])

    def _seen(self) -> tuple[list[dict], StopState]:
        found = self._follow() if self._follow is not None else None
        return found if found is not None else self._kept

    @property
    def state(self) -> StopState:
        return self._seen()[1]

    @property
    def wait_count(self) -> int:
        return self.state.wait_count

    @property
    def stop_reason(self) -> str | None:
        return self.state.stop_reason

    @property
    def stopped_step(self) -> int:
        return self.state.stopped_step

    @property
    def last_decision(self) -> Decision | None:
        return self.state.last_decision

    @property
    def history(self) -> list[tuple[int, float]]:
        return self.series(self._seen()[0])[0]

    @property
    def bounds(self) -> dict[int, float]:
        return self.series(self._seen()[0])[1]

    def series(self, history: list[dict]) -> tuple[list[tuple[int, float]], dict[int, float]]:
        """The monitored value of each report of `history` (``[{"step", "mean", "versus", "speedup"}]``), by
        step, and the upper end of its ratio's (delta's) interval (inf: too few tasks for one). A speed-up
        monitor reads the run-level speed-ups each entry keeps (`speed.speedup_record`): ours, and the upper end
        of the paired ratio with the baseline's."""
        if self.speedup:
            return self._speedup_series(history)
        monitor = Monitor.parse(self.monitor)
        kind = "ratio" if self.min_delta is None else "delta"
        points, bounds = {}, {}
        for h in history:
            step, versus = int(h["step"]), (h.get("versus") or {}).get(self.monitor)
            try:
                points[step] = float(h["mean"][str(monitor.method)][monitor.aggregate])
            except KeyError:
                raise RuntimeError(f"{self.shown_name} monitors {self.monitor!r}, which the report at step {step} "
                                   f"lacks: it holds the methods {sorted(h['mean'])}") from None
            if versus is not None:
                bounds[step] = math.inf if versus.get("verdict") == "too few tasks" else float(versus[kind][2])
        return sorted(points.items()), bounds

    def _speedup_series(self, history: list[dict]) -> tuple[list[tuple[int, float]], dict[int, float]]:
        points, bounds = {}, {}
        for h in history:
            if "speedup" not in h and h is not history[-1]:
                continue  # a report of the run before it had costs (a resume that added them): not judged
            step, found = int(h["step"]), self._speedup_of(h)
            points[step] = float(found["ours"][0])
            if "ratio" in found and found.get("verdict") is not None:  # paired: the tau comparison's interval
                bounds[step] = math.inf if found["verdict"] == "too few tasks" else float(found["ratio"][2])
        return sorted(points.items()), bounds

    def _speedup_of(self, entry: dict) -> dict:
        """The run-level speed-ups of the monitored method in a history entry, or RuntimeError saying why not."""
        found = (entry.get("speedup") or {}).get(self.tau_monitor)
        if found is None:
            held = sorted(entry.get("speedup") or {})
            raise RuntimeError(f"{self.shown_name} monitors {self.monitor!r}, which the report at step {entry['step']} "
                               + (f"lacks: it holds the speed-ups of {held}" if held else
                                  "has no speed-up of: its scoring has no costs (scoring.costs=PATH)"))
        return found

    # ----- the one call after each report --------------------------------------------------------------
    def evaluate(self, history: list[dict], baseline: EvalReport | None, now: Moment, state: StopState,
                 prefix: str = "dflash", step: int | None = None) -> Verdict:
        """Judge the run's `history` (its newest report last to arrive, of snapshot step `step`; default:
        `now.step`) against the baseline's report, from this stop's `state`; rank 0, on the training thread.
        Without a baseline nothing is decided (said once)."""
        step = now.step if step is None else int(step)
        if state.stop_reason and state.stopped_step and now.ending:
            return Verdict(False, None, state)  # a report of the final snapshot after our stop: the reason stands
        name = self.shown_name
        if baseline is None:
            if state.warned_no_baseline:
                return Verdict(False, None, state)
            return Verdict(False, None, dataclasses.replace(state, warned_no_baseline=True),
                           [("warn", f"{name}: no baseline report, {self.monitor} is recorded but not judged")])
        base = self.baseline_value(history, baseline)
        if not math.isfinite(base):
            return Verdict(False, None, state, [("warn", f"{name}: the baseline's {self.monitor} is {base}, not "
                                                          f"judging step {step}")])
        points, bounds = self.series(history)
        decision = self.decide(points, base, now.horizon, bounds)
        state = dataclasses.replace(state, last_decision=decision, wait_count=decision.wait_count)
        if not decision.stop:
            said = [("info", f"{prefix}: step {step}: {decision.reason}")] if self.verbose else []
            return Verdict(False, None, state, said)
        if self.action == "warn" or now.ending:
            why = "action='warn'" if self.action == "warn" else f"training ends anyway: {now.ending}"
            reason = f"{prefix}: trailing the baseline at step {step} ({why}, not stopping): {decision.reason}"
            return Verdict(False, reason, dataclasses.replace(state, stop_reason=reason), [("warn", reason)])
        reason = f"{prefix}: stopping at step {step}: {decision.reason}"
        return Verdict(True, reason, state, [("info", reason)])

    def baseline_value(self, history: list[dict], baseline: EvalReport) -> float:
        """The baseline's monitored number: its tau, or (a speed-up monitor) its predicted speed-up on the run's
        costs, as the latest entry of `history` keeps it."""
        if not self.speedup:
            return self.read(baseline, "baseline report")
        found = self._speedup_of(history[-1])
        if "baseline" not in found:
            raise RuntimeError(f"{self.shown_name} monitors {self.monitor!r}, but the report at step "
                               f"{history[-1]['step']} holds no speed-up of the baseline's {self.tau_monitor}")
        return float(found["baseline"][0])

    def read(self, report: EvalReport, what: str) -> float:
        try:
            return float(report.value(self.monitor))
        except KeyError as e:
            raise RuntimeError(
                f"{self.shown_name} monitors {self.monitor!r}, which the {what} at step {report.step} lacks: "
                f"{e.args[0]}"
            ) from e

    # ----- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint's state, taken by the engine that follows this stop when its run starts."""
        self._kept = ([], StopState.from_state_dict(state_dict))

    @property
    def loaded(self) -> StopState:
        """The state a run followed from now starts from: a checkpoint's, or what it saw last."""
        return self._kept[1]


def check_monitor(policy: StopPolicy, methods: list[str], source: str, costs: str | None = None) -> None:
    """`policy`'s monitor is one of `methods` (what `source` scores), or ValueError naming them; a speed-up
    monitor needs `costs` (the source's scoring.costs), or ValueError naming the forms that need none."""
    method = str(Monitor.parse(policy.tau_monitor).method)
    if policy.speedup and not costs:
        raise ValueError(f"{policy.shown_name} monitors {policy.monitor!r}, a predicted speed-up, but {source!r} "
                         "has no costs to predict it from: give its scoring costs=PATH (`dflash-callbacks profile "
                         f"--out PATH`), or monitor tau: {policy.tau_monitor!r}; the forms are METHOD/AGGREGATE (tau) "
                         "and speedup/METHOD/AGGREGATE (with scoring.costs)")
    if method not in methods:
        raise ValueError(f"{policy.shown_name} monitors {policy.monitor!r}, but {source!r} scores only "
                         f"{methods}; monitor one of those, or add it to that callback's scoring "
                         "(ddtree_budgets / topk / block_sizes / attentions)"
                         + did_you_mean(policy.tau_monitor, [f"{m}/{Monitor.parse(policy.tau_monitor).aggregate}"
                                                             for m in methods]))


def stop_policies(stop: StopPolicy | Sequence[StopPolicy] | type | None) -> list[StopPolicy]:
    """`stop=` of the plain-loop and transformers adapters, as a list (TypeError for anything else)."""
    if isinstance(stop, type):
        raise TypeError(f"stop={stop.__name__} is a class: give an instance, e.g. stop={stop.__name__}(monitor="
                        "'ddtree@8/live')")
    stops = [] if stop is None else [stop] if isinstance(stop, StopPolicy) else list(stop)
    if not all(isinstance(s, StopPolicy) for s in stops):
        raise TypeError("stop must be a TrailingBaselineStop (a StopPolicy), a list of them, or None; got "
                        f"{[type(s).__name__ for s in stops if not isinstance(s, StopPolicy)]}")
    return stops
