"""The one grammar of the logged metric keys: every key a report is logged under is built here.

    PREFIX/{method}/{AGG}/{TASK}          ours (PREFIX: the evaluation's `name`; AGG an aggregate:
                                          live, dense or pooled;
                                          TASK a task name or `mean`)
    PREFIX/baseline/{method}/{AGG}/{TASK} the baseline (logged with every report)
    PREFIX/delta/{method}/{AGG}/{TASK}    ours - baseline
    PREFIX/ratio/{method}/{AGG}/{TASK}    ours / baseline
    .../mean_lo, .../mean_hi              the 95% interval of each run-level mean, baseline, delta and
                                          ratio (deltas and ratios paired with the baseline)
    PREFIX/speedup/{method}/{AGG}/{TASK}  with scoring.costs: the predicted speed-up of ours (`scoring.speed`),
    PREFIX/speedup/baseline/..., PREFIX/speedup/ratio/...   the baseline's and ours / the baseline's (paired),
                                          each run-level one with its `_lo` and `_hi`; none without costs
    PREFIX/step                           the snapshot's step (the x axis in W&B)
    PREFIX/score_seconds                  time from the snapshot to its report
    PREFIX/errors                         failed evaluations so far
    PREFIX/live_table, PREFIX/curve/{method}, PREFIX/band/{method}   W&B's table and plots

A report's keys are the families in `REPORT_FAMILIES`, in order (a new family of keys is one
function `(prefix, report, baseline, versus) -> {key: value}` added there), then its predicted speed-ups
(`report_speedups`), of the values the publisher makes once per report for these keys and its history entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from typing import Any

from ..scoring.methods import AGGREGATES
from ..scoring.report import EvalReport
from ..scoring.table import comparison, ratio

COMPARED = ("baseline", "delta", "ratio")  # the kinds of key a baseline adds beside ours
SPEEDUP = "speedup"  # the family of the predicted speed-ups: PREFIX/speedup/[baseline/ | ratio/]METHOD/AGG/TASK
MEAN_ENDS = ("/mean", "/mean_lo", "/mean_hi")  # the run-level keys the host's metrics hold


def key(prefix: str, method: str, agg: str, task: str, kind: str | None = None) -> str:
    """One number's key: ours (`kind` None) or the baseline's, the delta's or the ratio's."""
    return f"{prefix}/{kind + '/' if kind else ''}{method}/{agg}/{task}"


def bounds_keys(value_key: str, lo: float, hi: float) -> dict[str, float]:
    """The 95% interval of the number logged at `value_key` (a run-level `.../mean`)."""
    return {f"{value_key}_lo": lo, f"{value_key}_hi": hi}


def step_key(prefix: str) -> str:
    return f"{prefix}/step"


def seconds_key(prefix: str) -> str:
    return f"{prefix}/score_seconds"


def errors_key(prefix: str) -> str:
    return f"{prefix}/errors"


def table_key(prefix: str) -> str:
    return f"{prefix}/live_table"


def live_table(report: EvalReport, baseline: EvalReport | None) -> tuple[list[str], list[list]]:
    """The per-task table every tracker logs under `table_key`: `scoring.table.comparison` of the live
    aggregate, its numbers to 4 decimals."""
    columns, rows = comparison(report, baseline)
    return columns, [[row[0], *(round(x, 4) for x in row[1:])] for row in rows]


def curve_key(prefix: str, method: str) -> str:
    return f"{prefix}/curve/{method}"


def band_key(prefix: str, method: str) -> str:
    return f"{prefix}/band/{method}"


def compared_keys(prefix: str, method: str, agg: str, task: str, ours: float, base: float | None) -> dict[str, float]:
    """One number of ours and, with the baseline's, the baseline's, the delta and the ratio."""
    out = {key(prefix, method, agg, task): ours}
    if base is not None:
        out.update({key(prefix, method, agg, task, "baseline"): base,
                    key(prefix, method, agg, task, "delta"): ours - base,
                    key(prefix, method, agg, task, "ratio"): ratio(ours, base)})
    return out


def report_values(prefix: str, report: EvalReport, baseline: EvalReport | None, versus: dict | None) -> dict[str, float]:
    """Every number of a report, per task and the mean, with its comparison with the baseline (no NaN)."""
    out: dict[str, float] = {}
    for task in list(report.tasks) + ["mean"]:
        for method in report.methods:
            compared = baseline is not None and method in baseline.methods and (task == "mean" or task in baseline.tasks)
            for agg in AGGREGATES:
                base = baseline.value(f"{method}/{agg}", task) if compared else None
                out.update(compared_keys(prefix, method, agg, task, report.value(f"{method}/{agg}", task), base))
    return {k: v for k, v in out.items() if not math.isnan(v)}


def report_bounds(prefix: str, report: EvalReport, baseline: EvalReport | None, versus: dict | None) -> dict[str, float]:
    """The interval beside each run-level mean: ours, and with `versus` (the paired comparison with the
    baseline, `scoring.intervals.paired_comparison`) the baseline's, the delta's and the ratio's. Empty for a
    report without intervals (written before scorer version 4)."""
    if report.intervals is None:
        return {}
    out = {}
    for method in report.methods:
        for agg in AGGREGATES:
            out.update(bounds_keys(key(prefix, method, agg, "mean"), *report.interval(f"{method}/{agg}")))
    if versus is None or baseline is None or baseline.intervals is None:
        return out
    for monitor, per_task in versus.items():
        method, agg = monitor.rsplit("/", 1)
        mean = per_task["mean"]
        for kind, (lo, hi) in zip(COMPARED, (baseline.interval(monitor), (mean.delta.lo, mean.delta.hi),
                                             (mean.ratio.lo, mean.ratio.hi))):
            out.update(bounds_keys(key(prefix, method, agg, "mean", kind), lo, hi))
    return out


MADE_HERE: Any = object()
"""`speedups=` not given: the speed-ups are made from the report (`speedup_values`)."""


def speedup_values(report: EvalReport, baseline: EvalReport | None, versus: dict | None,
                   speedups: Any = MADE_HERE) -> dict | None:
    """`speedups` where given, else the report's predicted speed-ups, `scoring.speed.report_speedups` (on
    `versus`: no bootstrap; ~0.6 ms, so the publisher makes them once per report); None without costs, and
    where the costs do not hold a method's round (preflight refuses that; the fastest line says it)."""
    if speedups is not MADE_HERE:
        return speedups
    from ..scoring.speed import report_speedups as made

    return made(report, baseline, versus)


def report_speedups(prefix: str, report: EvalReport, baseline: EvalReport | None, versus: dict | None,
                    speedups: Any = MADE_HERE) -> dict[str, float]:
    """With scoring.costs: the predicted speed-up of every method, aggregate and task, the baseline's and the
    paired ratio (`scoring.speed.speedup_metrics` of `speedup_values`); empty without them."""
    from ..scoring.speed import speedup_metrics

    values = speedup_values(report, baseline, versus, speedups)
    if values is None:
        return {}
    return {k: v for k, v in speedup_metrics(prefix, values).items() if not math.isnan(v)}


Family = Callable[[str, EvalReport, "EvalReport | None", "dict | None"], dict]
REPORT_FAMILIES: list[Family] = [report_values, report_bounds]


def report_metrics(prefix: str, report: EvalReport, baseline: EvalReport | None, versus: dict | None,
                   speedups: Any = MADE_HERE) -> dict[str, float]:
    """Every key a report is logged under, family by family (`REPORT_FAMILIES`), then its speed-ups
    (`speedups`: `speedup_values` made already; not given: made here)."""
    out: dict[str, float] = {}
    for family in REPORT_FAMILIES:
        out.update(family(prefix, report, baseline, versus))
    out.update(report_speedups(prefix, report, baseline, versus, speedups))
    return out


def run_counts(prefix: str, step: int, seconds: float, errors: int) -> dict[str, float]:
    """The keys beside every report: its step, the seconds it took, the errors so far."""
    return {step_key(prefix): float(step), seconds_key(prefix): seconds, errors_key(prefix): float(errors)}


# ------------------------------------------------------------------ the run-level means the host holds
def mean_keys(prefix: str, methods: list[str], has_baseline: bool, speedup: bool = False) -> list[str]:
    """Every run-level mean key a report publishes (with a baseline: its value, the delta and the ratio
    too; with `speedup`, scoring.costs: the predicted speed-ups, ours and with a baseline the baseline's and
    the ratio), each with its interval's `_lo` and `_hi`."""
    keys = []
    for method in methods:
        for agg in AGGREGATES:
            keys += list(compared_keys(prefix, method, agg, "mean", 0.0, 1.0 if has_baseline else None))
            if speedup:
                keys += [key(prefix, method, agg, "mean", kind) for kind in
                         [SPEEDUP] + [f"{SPEEDUP}/baseline", f"{SPEEDUP}/ratio"] * has_baseline]
    return [k + end for k in keys for end in ("", "_lo", "_hi")]


def is_mean_key(prefix: str, k: str) -> bool:
    """A run-level mean of ours (or its delta or ratio, or their intervals, or its speed-up); not the
    baseline's."""
    return k.startswith(f"{prefix}/") and k.endswith(MEAN_ENDS) and not k.startswith(
        (f"{prefix}/baseline/", f"{prefix}/{SPEEDUP}/baseline/"))


def held_means(metrics: dict[str, float]) -> dict[str, float]:
    """The keys of `metrics` the host's metrics hold (the run-level means, the baseline's too)."""
    return {k: v for k, v in metrics.items() if k.endswith(MEAN_ENDS)}


def restored_means(prefix: str, entry: dict, baseline: EvalReport | None) -> dict[str, float]:
    """A resume: the run-level means of a history entry (`{"step", "mean", "intervals", "versus", "speedup"}`),
    with the baseline's, the deltas and the ratios once the baseline is known, the intervals the entry keeps of
    its comparison, and (scoring.costs) the speed-ups it keeps."""
    means: dict[str, float] = {}
    base = baseline.mean if baseline is not None else {}
    for method, aggs in entry["mean"].items():
        for agg, ours in aggs.items():
            means.update(compared_keys(prefix, method, agg, "mean", ours, base.get(method, {}).get(agg)))
            bounds = {None: (entry.get("intervals") or {}).get(method, {}).get(agg)}
            if baseline is not None and baseline.intervals is not None and method in baseline.methods:
                bounds["baseline"] = baseline.interval(f"{method}/{agg}")
            for kind in ("delta", "ratio"):
                compared = (entry.get("versus") or {}).get(f"{method}/{agg}")
                bounds[kind] = compared[kind][1:] if compared else None
            for kind, pair in bounds.items():
                if pair is not None:
                    means.update(bounds_keys(key(prefix, method, agg, "mean", kind), pair[0], pair[1]))
    for monitor, found in (entry.get("speedup") or {}).items():  # scoring.costs: as results.jsonl keeps them
        method, agg = monitor.rsplit("/", 1)
        for kind, name in (("ours", SPEEDUP), ("baseline", f"{SPEEDUP}/baseline"), ("ratio", f"{SPEEDUP}/ratio")):
            if kind in found and (kind == "ours" or baseline is not None):
                value_key = key(prefix, method, agg, "mean", name)
                means.update({value_key: found[kind][0], **bounds_keys(value_key, *found[kind][1:])})
    return means
