"""Publishing a report, on the training thread of rank 0, in this order:

1. append it to results.jsonl (before anything else: a crash loses no finished report);
2. log it at the snapshot's step to every logger the host names (W&B runs get extras, below);
3. hand the run-level means to the engine (`trainer.callback_metrics` under Lightning);
4. hand it to the subscribers (the stops, and functions given to `subscribe`).

A step that fails (a full disk, a broken logger, a subscriber that raises) is reported
through `fail` and the other steps still run; a report that could not be appended is
kept and appended again before the next one. A report the strict reader refuses
(`EvalReport.from_dict`: a NaN, a tau out of range, ...) is an error for its step: an
error line takes its place in results.jsonl and none of its numbers is logged. A line that
can not be JSON at all is dropped and counted, never retried.

The metric keys are `metric_keys.py`'s.
W&B also gets, per report, a table of the live aggregate per task (PREFIX/live_table),
one acceptance-curve plot per method (ours and the baseline: the share of anchors whose
streak reaches each depth, mean over tasks), one band plot per method (PREFIX/band/METHOD:
the live mean of ours and of the baseline at every report so far, each with its 95%
interval), and, once, the cache fingerprint and block sizes in the run config. The process's
environment is never changed (W&B keeps its copies of the tables where its own settings say).
"""

from __future__ import annotations

from collections.abc import Callable

from ..scoring.intervals import paired_comparison
from ..scoring.report import EvalReport
from ..scoring.table import comparison
from .host import Logger
from .metric_keys import band_key, curve_key, errors_key, report_metrics, run_counts, seconds_key, step_key, table_key
from .run_folder import ResultsRecordError, ResultsWriteError, RunFolder

Subscriber = Callable[[EvalReport, "EvalReport | None"], object]


def versus_record(versus: dict, digits: int | None = 6) -> dict:
    """The run-level comparison with the baseline, as results.jsonl keeps it (rounded to `digits`; None: as
    computed, what the history of a live run holds):
    {METHOD/AGG: {"delta": [value, lo, hi], "ratio": [value, lo, hi], "verdict": ...}}."""
    out = {}
    for monitor, per_task in versus.items():
        mean = per_task["mean"]
        out[monitor] = {kind: [x if digits is None else round(x, digits) for x in (e.value, e.lo, e.hi)]
                        for kind, e in (("delta", mean.delta), ("ratio", mean.ratio))}
        out[monitor]["verdict"] = mean.verdict
    return out


def results_record(report: EvalReport, score_seconds: float, versus: dict | None) -> tuple[dict, str | None]:
    """The report's results.jsonl line (with `versus`, its run-level comparison with the baseline) and,
    when the strict reader would refuse it, why (None: it reads back). Milliseconds of work: the runner
    makes it off the training thread."""
    record = {**report.to_dict(), "score_seconds": score_seconds,
              **({"versus_baseline": versus_record(versus)} if versus else {})}
    try:
        EvalReport.from_dict(record)  # what the reader would refuse is never logged
    except ValueError as e:
        return record, str(e)
    return record, None


def versus_baseline(report: EvalReport, baseline: EvalReport | None) -> dict | None:
    """`report` against the baseline, paired (`intervals.paired_comparison`), or None without a
    baseline or intervals on both; a bootstrap of ~10 ms, so the runner makes it (`prepare`), not the
    training thread. A pair that can not be compared (other anchors) is left to the publisher to refuse."""
    if baseline is None or report.intervals is None or baseline.intervals is None:
        return None
    try:
        return paired_comparison(report, baseline)
    except ValueError:
        return None


def prepare(report: EvalReport, seconds: float, baseline: EvalReport | None) -> tuple[dict | None, tuple[dict, str | None]]:
    """What publishing a report takes that the runner makes off the training thread: its comparison with
    the baseline the runner has (`versus_baseline`) and its results.jsonl line (`results_record`)."""
    versus = versus_baseline(report, baseline)
    return versus, results_record(report, seconds, versus)


def wandb_name(key: str) -> str:
    """A logged key as `define_metric` takes it: W&B reads an unescaped '.' as a nested summary
    path, so a task or prefix with a dot (`py3.11`) would lose its axis and max summary."""
    return key.replace(".", "\\.")


def mean_curve(report: EvalReport, method: str) -> list[float]:
    """The acceptance curve averaged over tasks (each task weighs the same)."""
    curves = [t[method]["curve"] for t in report.tasks.values()]
    return [sum(c[d] for c in curves) / len(curves) for d in range(min(len(c) for c in curves))]


def summary_line(prefix: str, report: EvalReport, baseline: EvalReport | None) -> str:
    parts = []
    for method in report.methods:
        ours = report.value(f"{method}/live")
        text = f"{method} {ours:.2f}"
        if baseline is not None and method in baseline.methods:
            base = baseline.value(f"{method}/live")
            text += f" (baseline {base:.2f}, {100 * ours / base:.0f}%)" if base else ""
        parts.append(text)
    return f"{prefix} step {report.step}: live tau " + ", ".join(parts)


class Publisher:
    """Writes and logs one run's reports, on rank 0. `loggers()` and `wandb_runs()` name, at each
    report, where its numbers go (the host's: a logger added after the run started still counts);
    `fail(message)` reports a failure (a warning and an error count, or a raise)."""

    def __init__(self, prefix: str, run: RunFolder, fail: Callable[[str], None],
                 loggers: Callable[[], list[Logger]], wandb_runs: Callable[[], list]):
        self.prefix, self.run, self.fail = prefix, run, fail
        self.loggers, self.wandb_runs = loggers, wandb_runs
        self.unsaved: list[dict] = []  # records whose append failed, retried first
        self._wandb_defined: dict[int, set[str]] = {}  # per W&B run: the keys define_metric has seen
        self._bands: dict[str, list[tuple]] = {}  # per method: (step, ours, lo, hi, baseline, lo, hi) of each report

    def record(self, record: dict | None) -> bool:
        """Append a results.jsonl line (earlier failed ones first; None: only retry those);
        False if something could not be written. A record that is not JSON is dropped."""
        if record is not None:
            self.unsaved.append(record)
        written = True
        while self.unsaved:
            try:
                self.run.append(self.unsaved[0])
            except ResultsWriteError as e:
                self.fail(f"{e} ({len(self.unsaved)} line(s) held in memory, retried with the next report)")
                return False
            except ResultsRecordError as e:
                self.unsaved.pop(0)
                self.fail(str(e))
                written = False
                continue
            self.unsaved.pop(0)
        return written

    def record_report(self, report: EvalReport, score_seconds: float, versus: dict | None = None,
                      prepared: tuple[dict, str | None] | None = None) -> bool:
        """Append the report's results.jsonl line (`results_record`; `prepared`: made already, by the
        runner). A report the reader would refuse is an error line instead (and a failure): False, and
        none of its numbers may be logged."""
        record, refused = prepared or results_record(report, score_seconds, versus)
        if refused is not None:
            error = f"step {report.step}: the report is refused, none of its numbers is logged: {refused}"
            self.record({"step": report.step, "snapshot_id": report.snapshot_id, "error": error})
            self.fail(error)
            return False
        self.record(record)
        return True

    def publish(self, report: EvalReport, baseline: EvalReport | None, score_seconds: float,
                errors: int, versus: dict | None = None,
                prepared: tuple[dict, str | None] | None = None) -> dict[str, float] | None:
        """Record, then log to every logger at the report's step (`versus`: the paired comparison
        with the baseline, for the intervals of the deltas and ratios; `prepared`: its line, made by
        the runner); returns what was logged (None, and nothing logged, for a refused report)."""
        if not self.record_report(report, score_seconds, versus, prepared):
            return None
        metrics = report_metrics(self.prefix, report, baseline, versus)
        metrics.update(run_counts(self.prefix, report.step, score_seconds, errors))
        for name, log in self.loggers():
            self._guarded(name, report.step, lambda: log(metrics, report.step))
        for name, run, log in self.wandb_runs():
            self._guarded(name, report.step, lambda: self._log_wandb(run, log, report, baseline, metrics))
        return metrics

    def _guarded(self, name: str, step: int, log: Callable[[], object]) -> None:
        try:
            log()
        except Exception as e:  # one broken logger must not cost the others their numbers
            self.fail(f"logging step {step} to {name} failed: {type(e).__name__}: {e}")

    def log_error_count(self, errors: int, step: int) -> None:
        for _, log in self.loggers():
            try:
                log({errors_key(self.prefix): float(errors)}, step)
            except Exception:
                pass  # the warning already says it; a broken logger can not take the count

    def _log_wandb(self, run, log: Callable[[dict, int], object], report: EvalReport, baseline: EvalReport | None,
                   metrics: dict) -> None:
        """A W&B run gets the metrics against `PREFIX/step`, the per-task table and the curves, through
        `log` (the host's way of writing a row: see `WandbRows`)."""
        import wandb

        p = self.prefix
        if id(run) not in self._wandb_defined:
            run.define_metric(wandb_name(step_key(p)))
            run.config.update({p: {"cache": report.cache.get("path"), "cache_fingerprint": report.cache["fingerprint"],
                                   "target_fingerprint": report.cache.get("target"),
                                   "block_size": report.block_size, "drafter_block_size": report.drafter_block_size,
                                   "methods": report.methods, "scoring": report.scoring}}, allow_val_change=True)
            self._wandb_defined[id(run)] = {step_key(p)}  # the x axis itself: not plotted against itself
        defined = self._wandb_defined[id(run)]
        for key in [k for k in metrics if k not in defined]:  # each key the first time it is seen (the baseline's may come late)
            summary = "max" if key not in (seconds_key(p), errors_key(p)) else None
            run.define_metric(wandb_name(key), step_metric=wandb_name(step_key(p)), **({"summary": summary} if summary else {}))
            defined.add(key)
        columns, rows = comparison(report, baseline)
        extras = {table_key(p): wandb.Table(columns=columns, data=[[row[0], *(round(x, 4) for x in row[1:])]
                                                                        for row in rows])}
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
