"""Reports as the publisher hands them to the trackers: the keys it logs (`report_keys`) and the per-task
table of `scoring.table.comparison`, of reports made by hand (two tasks, one with a dot in its name;
vanilla and ddtree@4, whose '@' MLflow refuses) at the steps given; a real PNG plot; TensorBoard's event
files read back with its own `EventAccumulator`."""

from __future__ import annotations

from pathlib import Path

from dflash_callbacks.engine.trackers.delivery import Table
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.table import comparison

try:  # the one grammar of the keys (engine/metric_keys.py), where it has landed
    from dflash_callbacks.engine.metric_keys import report_metrics as _report_metrics

    def report_keys(prefix: str, report: EvalReport, baseline: EvalReport | None = None) -> dict[str, float]:
        """The keys the publisher logs for `report`: its numbers, their comparison with `baseline`, and the
        intervals of its own means."""
        return _report_metrics(prefix, report, baseline, None)
except ImportError:  # before it: publish.py's keys and scoring/intervals.py's bounds
    from dflash_callbacks.engine.publish import report_metrics as _report_metrics
    from dflash_callbacks.scoring.intervals import interval_metrics

    def report_keys(prefix: str, report: EvalReport, baseline: EvalReport | None = None) -> dict[str, float]:
        """The keys the publisher logs for `report`: its numbers, their comparison with `baseline`, and the
        intervals of its own means."""
        return {**_report_metrics(prefix, report, baseline), **interval_metrics(prefix, report)}

TASKS, METHODS = ("gsm8k", "py3.11"), ("vanilla", "ddtree@4")


def made_report(step: int) -> EvalReport:
    """A report whose every number moves with the step."""
    value = {(t, m): 1.5 + 0.01 * step + 0.3 * i + 0.7 * j for i, t in enumerate(TASKS) for j, m in enumerate(METHODS)}
    tasks = {t: {m: {"dense": value[t, m] + 0.2, "live": value[t, m], "pooled": value[t, m] - 0.1, "rounds": 10.0,
                     "curve": [1.0, 0.5]} for m in METHODS} for t in TASKS}
    aggregates = ("dense", "live", "pooled")  # pooled: every task of 10 rounds, its run-level number the plain mean
    mean = {m: {a: sum(tasks[t][m][a] for t in TASKS) / len(TASKS) for a in aggregates} for m in METHODS}
    spread = lambda x: [round(x - 0.1, 6), round(x + 0.1, 6)]  # noqa: E731
    intervals = {"confidence": 0.95, "resamples": 100, "seed": 0,
                 "mean": {m: {a: spread(mean[m][a]) for a in mean[m]} for m in METHODS},
                 "tasks": {t: {m: {a: spread(tasks[t][m][a]) for a in aggregates} for m in METHODS} for t in TASKS}}
    return EvalReport(drafter="made", cache={"path": "c", "fingerprint": "f"}, block_size=4, tasks=tasks, step=step,
                      intervals=intervals)


def report_payload(step: int, prefix: str = "dflash") -> tuple[dict[str, float], Table]:
    """(the keys logged, the table) of the made report of `step`."""
    report = made_report(step)
    metrics = {**report_keys(prefix, report), f"{prefix}/step": float(step), f"{prefix}/errors": 0.0}
    columns, rows = comparison(report)
    return metrics, Table(f"{prefix}/live_table", columns, [[r[0], *(round(x, 4) for x in r[1:])] for r in rows])


def make_plot(path: Path) -> Path:
    """A real PNG plot, 300 x 200 pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(3, 2), dpi=100)
    plt.plot([0, 1], [1, 0])
    fig.savefig(path)
    plt.close(fig)
    return path


def read_events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return events


def scalars(events) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of every scalar in the event files."""
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
