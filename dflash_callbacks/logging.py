"""Metric keys and what goes to the loggers for one report.

Keys (AGG is live or dense, TASK a task name or `mean`):
    dflash/{method}/{AGG}/{TASK}          ours
    dflash/delta/{method}/{AGG}/{TASK}    ours - baseline
    dflash/ratio/{method}/{AGG}/{TASK}    ours / baseline
    dflash/baseline/{method}/{AGG}/{TASK} the baseline (logged with every report)
    dflash/step                           the snapshot's step (the x axis in W&B)
    dflash/score_seconds                  time from the snapshot to its report
    dflash/errors                         failed snapshots so far
"""

from __future__ import annotations

import math

from .scoring.report import AGGREGATES, EvalReport, ratio

PREFIX = "dflash"


def metric_key(method: str, aggregate: str, task: str = "mean", kind: str | None = None) -> str:
    parts = [PREFIX] + ([kind] if kind else []) + [method, aggregate, task]
    return "/".join(parts)


def report_metrics(report: EvalReport, baseline: EvalReport | None) -> dict[str, float]:
    """Every number of a report (and its comparison with the baseline), flat."""
    out: dict[str, float] = {}
    for task in list(report.tasks) + ["mean"]:
        for method in report.methods:
            for agg in AGGREGATES:
                ours = report.value(f"{method}/{agg}", task)
                out[metric_key(method, agg, task)] = ours
                if baseline is None or method not in baseline.methods or (task != "mean" and task not in baseline.tasks):
                    continue
                base = baseline.value(f"{method}/{agg}", task)
                out[metric_key(method, agg, task, "baseline")] = base
                out[metric_key(method, agg, task, "delta")] = ours - base
                out[metric_key(method, agg, task, "ratio")] = ratio(ours, base)
    return {k: v for k, v in out.items() if not math.isnan(v)}


def table_columns(report: EvalReport, baseline: EvalReport | None, aggregate: str = "live") -> list[str]:
    columns = ["task"]
    for method in report.methods:
        columns += [f"{method} ours"] + ([f"{method} baseline", f"{method} delta", f"{method} ratio"] if baseline else [])
    return columns


def table_rows(report: EvalReport, baseline: EvalReport | None, aggregate: str = "live") -> list[list]:
    """One row per task and one for the mean: per method ours (baseline, delta, ratio)."""
    rows = []
    for task in list(report.tasks) + ["mean"]:
        row: list = [task]
        for method in report.methods:
            ours = report.value(f"{method}/{aggregate}", task)
            row.append(round(ours, 4))
            if baseline is not None:
                base = baseline.value(f"{method}/{aggregate}", task)
                row += [round(base, 4), round(ours - base, 4), round(ratio(ours, base), 4)]
        rows.append(row)
    return rows


def wandb_define_metrics(run, report: EvalReport, baseline: EvalReport | None) -> None:
    """Eval keys plot against the snapshot step (`dflash/step`); the run summary keeps
    the best value of each."""
    run.define_metric(f"{PREFIX}/step")
    for key in report_metrics(report, baseline):
        run.define_metric(key, step_metric=f"{PREFIX}/step", summary="max")
    for key in ("score_seconds", "errors"):
        run.define_metric(f"{PREFIX}/{key}", step_metric=f"{PREFIX}/step")
