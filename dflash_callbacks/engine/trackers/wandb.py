"""W&B as a destination of a run's reports (`WandbTracker`, a `base.Tracker`): per report one row at the
snapshot's step holding its metric keys (against PREFIX/step, each with a max summary), a table of the
live aggregate per task (PREFIX/live_table), one acceptance-curve plot per method (ours and the baseline:
the share of anchors whose streak reaches each depth, mean over tasks), one band plot per method
(PREFIX/band/METHOD: the live mean of ours and of the baseline at every report so far, each with its 95%
interval), and, once, the cache fingerprint and block sizes in the run config. The run is the user's (or
the active `wandb.run`: `ActiveWandb`); rows are written so that the loop's own logging keeps its steps
(`WandbRows`). The process's environment is never changed (W&B keeps its copies of the tables where its
own settings say). wandb is imported only to log.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...scoring.report import EvalReport
from ..metric_keys import band_key, curve_key, errors_key, live_table, seconds_key, step_key, table_key


def wandb_name(key: str) -> str:
    """A logged key as `define_metric` takes it: W&B reads an unescaped '.' as a nested summary
    path, so a task or prefix with a dot (`py3.11`) would lose its axis and max summary."""
    return key.replace(".", "\\.")


def mean_curve(report: EvalReport, method: str) -> list[float]:
    """The acceptance curve averaged over tasks (each task weighs the same)."""
    curves = [t[method]["curve"] for t in report.tasks.values()]
    return [sum(c[d] for c in curves) / len(curves) for d in range(min(len(c) for c in curves))]


class WandbTracker:
    """One W&B run's rows, written with `write(payload, step)` (the host's way: `WandbRows`, or the watcher's)."""

    def __init__(self, name: str, run: Any, write: Callable[[dict, int], object], prefix: str):
        self.name, self.run, self.write, self.prefix = name, run, write, prefix
        self._defined: set[str] | None = None  # the keys define_metric has seen
        self._bands: dict[str, list[tuple]] = {}  # per method: (step, ours, lo, hi, baseline, lo, hi) of each report

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.write(dict(metrics), step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[object]], step: int) -> None:
        import wandb

        self.write({name: wandb.Table(columns=list(columns), data=[list(row) for row in rows])}, step)

    def log_image(self, name: str, path: Path) -> None:
        import wandb

        self.run.log({name: wandb.Image(str(path))})

    def close(self) -> None:
        pass  # the run is the user's (or the watcher's, which finishes it)

    def log_report(self, report: EvalReport, baseline: EvalReport | None, metrics: dict,
                   write: Callable[[dict, int], object] | None = None) -> None:
        """One report in one row (`write`: the host's way of writing it now, default the tracker's): the
        metrics against `PREFIX/step` (each key defined the first time it is seen, with a max summary), the
        per-task table, the curves and the bands."""
        import wandb

        p, run, log = self.prefix, self.run, write or self.write
        if self._defined is None:
            run.define_metric(wandb_name(step_key(p)))
            run.config.update({p: {"cache": report.cache.get("path"), "cache_fingerprint": report.cache["fingerprint"],
                                   "target_fingerprint": report.cache.get("target"),
                                   "block_size": report.block_size, "drafter_block_size": report.drafter_block_size,
                                   "methods": report.methods, "scoring": report.scoring}}, allow_val_change=True)
            self._defined = {step_key(p)}  # the x axis itself: not plotted against itself
        defined = self._defined
        for key in [k for k in metrics if k not in defined]:  # each key the first time it is seen (the baseline's may come late)
            summary = "max" if key not in (seconds_key(p), errors_key(p)) else None
            run.define_metric(wandb_name(key), step_metric=wandb_name(step_key(p)), **({"summary": summary} if summary else {}))
            defined.add(key)
        columns, rows = live_table(report, baseline)
        extras = {table_key(p): wandb.Table(columns=columns, data=rows)}
        for method in report.methods:
            ys, keys = [mean_curve(report, method)], ["ours"]
            if baseline is not None and method in baseline.methods:
                ys.append(mean_curve(baseline, method))
                keys.append("baseline")
            depths = list(range(1, len(ys[0]) + 1))
            extras[curve_key(p, method)] = wandb.plot.line_series(
                xs=depths, ys=ys, keys=keys, xname="depth (draft tokens)",
                title=f"{method}: share of anchors accepting at least d tokens, step {report.step}")
        extras.update(self._band_plots(report, baseline))
        log({**metrics, **extras}, report.step)

    def _band_plots(self, report: EvalReport, baseline: EvalReport | None) -> dict:
        """PREFIX/band/METHOD: the live mean of ours and of the baseline at every report so far, each
        with its 95% interval (lo and hi as lines of their own: W&B's line plots draw no band)."""
        import wandb

        if report.intervals is None:
            return {}
        plots = {}
        for method in report.methods:
            monitor = f"{method}/live"
            compared = baseline is not None and baseline.intervals is not None and method in baseline.methods
            base = (baseline.value(monitor), *baseline.interval(monitor)) if compared else (None, None, None)
            rows = [r for r in self._bands.get(method, []) if r[0] != report.step]
            self._bands[method] = rows = sorted(rows + [(report.step, report.value(monitor), *report.interval(monitor),
                                                         *base)])
            columns = ["ours", "ours 95% lo", "ours 95% hi"] + (["baseline", "baseline 95% lo", "baseline 95% hi"]
                                                                 if compared else [])
            plots[band_key(self.prefix, method)] = wandb.plot.line_series(
                xs=[r[0] for r in rows], ys=[[r[1 + i] for r in rows] for i in range(len(columns))], keys=columns,
                xname="step", title=f"{method}/live: ours and the baseline, each with its 95% interval")
        return plots


class ActiveWandb:
    """The W&B run reports go to: the one given, else the active `wandb.run` when the script has started
    one (wandb is never imported here), never with `False`. Each run gets a `WandbRows` writer."""

    def __init__(self, given: Any = None):
        self.given = given
        self._rows: dict[int, Any] = {}

    def runs(self) -> list[WandbRun]:
        run = self.given
        if run is None:
            module = sys.modules.get("wandb")
            run = getattr(module, "run", None) if module is not None else None
        if run is None or run is False:
            return []
        rows = self._rows.setdefault(id(run), WandbRows(run))
        return [("wandb", run, rows.log)]


class WandbRows:
    """Writes our rows into a W&B run that the training loop may log to as well, with or without
    `step=`: each report in a row of its own, and W&B's step counter never moved past a step the loop
    has yet to log (W&B drops a row whose step is below its counter).

    A report joins the run's current row, uncommitted (the loop's next log commits it with its own).
    Only when our previous report still sits in that row (the loop has not logged since) is it
    committed first, which moves the counter one past the loop's last step."""

    def __init__(self, run):
        self.run = run
        self.row: int | None = None  # the step of the row our last report joined

    def log(self, payload: dict, step: int) -> None:
        """`payload`, of the report of training step `step` (which it holds as PREFIX/step)."""
        if self.row is not None and self.run.step == self.row:
            self.run.log({}, commit=True)
        self.run.log(payload, commit=False)
        self.row = self.run.step
