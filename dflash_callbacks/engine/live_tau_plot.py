"""The picture of a run, `live_tau.png` (the demo's, and `dflash-callbacks plot RUN`'s for any run
folder): live tau of ours against the baseline, one panel per method.

The panel of the method the stop monitors is marked, with what the stop judged: its threshold,
the grace period (shaded: reports there are never judged), the projection it fitted
(`a + b*log(step)` to the last `projection_window` reports up to the stop) out to the last
step, and the step of the report it stopped at, the same step in the title and on every panel.

Each line is drawn by `draw_tau` (ours, per report) or `draw_level` (the baseline), which
take optional `lo`/`hi` bounds and shade between them: the place for an interval per number.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from .stop import MIN_PROJECTION_POINTS, PROJECTION_CURVE, StopPolicy, fit_projection, projected_value
from ..scoring.methods import Monitor
from ..scoring.report import EvalReport

OURS, BASELINE, STOP = "tab:blue", "black", "tab:red"


def draw_tau(ax, steps: Sequence[int], tau: Sequence[float], *, lo: Sequence[float] | None = None,
             hi: Sequence[float] | None = None, label: str, color: str) -> None:
    """One value per report, with its interval shaded when `lo` and `hi` are given."""
    ax.plot(steps, tau, marker="o", markersize=4, color=color, label=label)
    if lo is not None and hi is not None:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)


def draw_level(ax, value: float, *, lo: float | None = None, hi: float | None = None, label: str, color: str) -> None:
    """A level across the panel (the baseline's), with its interval shaded when `lo` and `hi` are given."""
    ax.axhline(value, color=color, linestyle="--", linewidth=1.2, label=label)
    if lo is not None and hi is not None:
        ax.axhspan(lo, hi, color=color, alpha=0.08, linewidth=0)


def judged_values(reports: Sequence[EvalReport], stop: StopPolicy) -> dict[int, float]:
    """The number `stop` judges in each report, by step: its monitored tau, or for a speed-up monitor
    (`speedup/METHOD/AGG`) the predicted speed-up its results.jsonl line keeps, else the one its scoring's costs
    predict (a report with neither is left out)."""
    if not stop.speedup:
        return {r.step: r.value(stop.monitor) for r in reports}
    return {r.step: found["ours"][0] for r in reports if (found := kept_speedup(r, None, stop))}


def kept_speedup(report: EvalReport, baseline: EvalReport | None, stop: StopPolicy) -> dict | None:
    """The run-level speed-ups of the stop's method in `report` (`speed.speedup_record`'s entry): as its
    results.jsonl line keeps them, else predicted on its scoring's costs (with `baseline`, the baseline's too);
    None without costs."""
    from ..scoring.costs import CostsError
    from ..scoring.speed import report_contexts, report_costs, speedup_record, speedup_values

    found = (report.extra.get("speedup") or {}).get(stop.tau_monitor)
    if found and (baseline is None or "baseline" in found):
        return found
    try:
        costs = report_costs(report)
        if costs is None:
            return None
        values = speedup_values(report, baseline, costs, report_contexts(report))
    except (CostsError, ValueError, KeyError):
        return None
    return speedup_record(values).get(stop.tau_monitor)


def projection_points(values: dict[int, float], window: int, until: int | None) -> dict[int, float]:
    """What the stop fits: the last `window` of `values` (step -> judged number) up to step `until`, with
    positive steps and finite values."""
    judged = [(s, v) for s, v in sorted(values.items()) if until is None or s <= until]
    return {s: v for s, v in judged[-window:] if s > 0 and math.isfinite(v)}


def live_tau_figure(reports: Sequence[EvalReport], baseline: EvalReport | None, *, title: str,
                    stop: StopPolicy | None = None, stop_step: int | None = None,
                    stop_reason: str | None = None, horizon: int | None = None) -> Figure:
    """The figure: `stop_step` is the step of the report the stop acted on (None: it did not),
    `stop_reason` its explanation, `horizon` the last step training would have reached."""
    methods = reports[0].methods
    monitor = Monitor.parse(stop.tau_monitor) if stop is not None else None
    cols = 1 if len(methods) == 1 else 2
    rows = -(-len(methods) // cols)
    fig = Figure(figsize=(11, 1.8 + 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    steps = [r.step for r in reports]
    right = max(max(steps), horizon or 0)  # the last step drawn: the run's last step, when known
    for ax, method in zip(axes, methods):
        monitored = monitor is not None and str(monitor.method) == method
        key = f"{method}/live"
        bands = all(r.intervals is not None for r in reports)  # reports of scorer version 4 and later
        draw_tau(ax, steps, [r.value(key) for r in reports], label="ours (95% interval shaded)" if bands else "ours",
                 color=OURS, lo=[r.interval(key)[0] for r in reports] if bands else None,
                 hi=[r.interval(key)[1] for r in reports] if bands else None)
        if baseline is not None and method in baseline.methods:
            base = baseline.value(key)
            lo, hi = baseline.interval(key) if baseline.intervals is not None else (None, None)
            draw_level(ax, base, lo=lo, hi=hi, label="baseline" if lo is None else "baseline (95% interval shaded)",
                       color=BASELINE)
            ax.annotate(f"baseline {base:.2f}", (1, base), xycoords=("axes fraction", "data"), xytext=(-4, 4),
                        textcoords="offset points", ha="right", fontsize=9)
        if monitored and monitor.aggregate == "live":
            right = max(right, draw_stop_rule(ax, reports, baseline, stop, stop_step, horizon))
        if stop_step is not None:
            ax.axvline(stop_step, color=STOP, linewidth=1.5, label=f"stopped at step {stop_step}")
        ax.set_title(f"{method}: monitored by the stop" if monitored else method, fontsize=11,
                     color=STOP if monitored else "black", fontweight="bold" if monitored else "normal")
        if monitored:
            for spine in ax.spines.values():
                spine.set(color=STOP, linewidth=2)
        ax.grid(alpha=0.3)
    for i, ax in enumerate(axes):
        ax.set_visible(i < len(methods))
        if i + cols >= len(methods):  # no panel below it
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("training step", fontsize=10)
        if i % cols == 0:
            ax.set_ylabel("live tau (tokens per target forward)", fontsize=10)
    low, high = axes[0].get_ylim()
    axes[0].set_ylim(low, high + 0.08 * (high - low))  # room for the baselines' labels near the top
    axes[0].set_xlim(0, 1.02 * right)
    handles = {}
    for ax in axes[: len(methods)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(len(handles), 3), fontsize=10,
               frameon=False)
    heading = title
    if stop_reason:
        heading += "\n" + "\n".join(textwrap.wrap(stop_reason, 130))
    fig.suptitle(heading, fontsize=11)
    return fig


def draw_stop_rule(ax, reports: Sequence[EvalReport], baseline: EvalReport | None, stop: StopPolicy,
                   stop_step: int | None, horizon: int | None) -> int:
    """On the monitored panel: the grace period, the threshold, and the projection; returns the
    last step drawn (the projection's horizon). A speed-up monitor's threshold and projection are drawn in
    tau (the panel's): its speed-up divided by the method's cost factor (speed-up / tau, the same in every
    report of a run)."""
    if stop.grace_steps > 0:
        ax.axvspan(0, stop.grace_steps, color="0.6", alpha=0.18, linewidth=0,
                   label=f"grace period (before step {stop.grace_steps}: not judged)")
    values, per_tau, unit = judged_values(reports, stop), 1.0, ""
    if stop.speedup:
        latest = max((r for r in reports if r.step in values), key=lambda r: r.step, default=None)
        if latest is None:
            return 0  # no speed-up kept: nothing of the stop to draw
        per_tau, unit = values[latest.step] / latest.value(stop.tau_monitor), " speed-up, drawn in tau"
    base = None if baseline is None else baseline_number(reports, baseline, stop)
    if base is not None:
        ax.axhline(stop.threshold(base) / per_tau, color=STOP, linestyle=":", linewidth=1.5,
                   label=f"stop threshold ({stop.describe_threshold(base)}{unit})")
    points = projection_points(values, stop.projection_window, stop_step)
    if not stop.projection or len(points) < MIN_PROJECTION_POINTS:
        return 0
    a, b = fit_projection(list(points), [v / per_tau for v in points.values()])
    first, last = min(points), max(horizon or 0, max(points))
    xs = [first + (last - first) * i / 100 for i in range(101)]
    ys = [projected_value(a, b, x) for x in xs]
    ax.plot(xs, ys, color=STOP, linestyle="--", linewidth=1.2, alpha=0.8,
            label=f"projection {PROJECTION_CURVE} of the stop ({ys[-1]:.2f} at step {last})")
    ax.plot([last], [ys[-1]], marker="x", color=STOP, markersize=8)
    return last


def replay_stop(reports: Sequence[EvalReport], baseline: EvalReport, stop: StopPolicy,
                max_steps: int | None) -> tuple[int | None, str | None]:
    """(the step of the first report `stop` would have stopped at, its reason), deciding after each report
    in step order as it did while training (its ratio's interval from the report's `versus_baseline`);
    (None, None) when it would not have stopped."""
    from .run_state import history_entry

    base = baseline_number(reports, baseline, stop)
    if base is None:
        return None, None
    history = []
    for report in sorted(reports, key=lambda r: r.step):
        history.append(history_entry(report, report.extra.get("versus_baseline")))
        if stop.speedup and "speedup" not in history[-1]:
            history.pop()  # a report without its speed-up kept (scored before the run had costs)
            continue
        points, bounds = stop.series(history)
        decision = stop.decide(points, base, max_steps, bounds)
        if decision.stop:
            return report.step, decision.reason
    return None, None


def baseline_number(reports: Sequence[EvalReport], baseline: EvalReport, stop: StopPolicy) -> float | None:
    """The baseline's number `stop` judges against: its tau, or its predicted speed-up as the latest report
    that keeps one has it (None: none does)."""
    if not stop.speedup:
        return baseline.value(stop.monitor)
    found = kept_speedup(max(reports, key=lambda r: r.step), baseline, stop) if reports else None
    return float(found["baseline"][0]) if found and "baseline" in found else None


def plot_live_tau(reports: Sequence[EvalReport], baseline: EvalReport | None, path: Path, **kwargs) -> Path:
    """`live_tau_figure(reports, baseline, **kwargs)` saved as a PNG at `path`."""
    live_tau_figure(reports, baseline, **kwargs).savefig(path, dpi=100)
    return path
