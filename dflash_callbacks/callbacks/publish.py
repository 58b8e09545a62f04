"""Publishing a report, on the training thread, in this order:

1. append it to results.jsonl (before anything else: a crash loses no finished report);
2. log it at the snapshot's step to every logger (W&B gets extras, below);
3. put the run-level means in `trainer.callback_metrics` (for EarlyStopping, ModelCheckpoint);
4. hand it to the subscribers (`DrafterEvalCallback.subscribe`).

A step that fails (a full disk, a broken logger, a subscriber that raises) is reported
through `fail` and the other steps still run; a report that could not be appended is
kept and appended again before the next one. A report the strict reader refuses
(`EvalReport.from_dict`: a NaN, a tau out of range, ...) is an error for its step: an
error line takes its place in results.jsonl and none of its numbers is logged. A line that
can not be JSON at all is dropped and counted, never retried.

Metric keys (PREFIX is the callback's `name`, "dflash" by default; AGG live or dense;
TASK a task name or `mean`):
    PREFIX/{method}/{AGG}/{TASK}          ours
    PREFIX/delta/{method}/{AGG}/{TASK}    ours - baseline
    PREFIX/ratio/{method}/{AGG}/{TASK}    ours / baseline
    PREFIX/baseline/{method}/{AGG}/{TASK} the baseline (logged with every report)
    PREFIX/step                           the snapshot's step (the x axis in W&B)
    PREFIX/score_seconds                  time from the snapshot to its report
    PREFIX/errors                         failed evaluations so far
W&B also gets, per report, a table of the live aggregate per task (PREFIX/live_table),
one acceptance-curve plot per method (ours and the baseline: the share of anchors whose
streak reaches each depth, mean over tasks), and, once, the cache fingerprint and block
sizes in the run config.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from ..scoring.methods import AGGREGATES
from ..scoring.report import EvalReport, comparison, ratio
from .run_folder import ResultsRecordError, ResultsWriteError, RunFolder

Subscriber = Callable[[EvalReport, "EvalReport | None"], object]


class ReportSource(Callback):
    """A callback that publishes reports: what TrailingBaselineStop links to at setup.
    DrafterEvalCallback is the one this package ships."""

    name: str
    baseline_report: EvalReport | None = None

    def scored_methods(self) -> list[str]:
        """The method names every report of this source holds."""
        raise NotImplementedError

    def has_baseline(self) -> bool:
        """Whether reports come with a baseline to judge them against (a source without one says so)."""
        return True

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(report, baseline)` on the training thread for every new report; returns an unsubscribe."""
        raise NotImplementedError

    def run_history(self, trainer, pl_module) -> list[dict]:
        """This run's reports so far, by step: [{"step", "mean": {method: {aggregate: value}}}]."""
        raise NotImplementedError


def report_sources(callbacks) -> list[ReportSource]:
    """The report sources among `callbacks`; two of one name are refused (their numbers would be
    logged under the same keys and the stop could not tell them apart)."""
    sources = [cb for cb in callbacks if isinstance(cb, ReportSource)]
    names = [cb.name for cb in sources]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"trainer.callbacks holds several DrafterEvalCallbacks named {twice[0]!r} (names: {names}): "
                         f"their numbers would be logged under the same keys ({twice[0]}/...); give each its own name=")
    return sources


def metric_keys(prefix: str, method: str, agg: str, task: str, ours: float, base: float | None) -> dict[str, float]:
    """The logged keys of one number of ours and, with the baseline's, its comparison."""
    out = {f"{prefix}/{method}/{agg}/{task}": ours}
    if base is not None:
        out.update({f"{prefix}/baseline/{method}/{agg}/{task}": base, f"{prefix}/delta/{method}/{agg}/{task}": ours - base,
                    f"{prefix}/ratio/{method}/{agg}/{task}": ratio(ours, base)})
    return out


def report_metrics(prefix: str, report: EvalReport, baseline: EvalReport | None) -> dict[str, float]:
    """Every number of a report (and its comparison with the baseline), flat."""
    out: dict[str, float] = {}
    for task in list(report.tasks) + ["mean"]:
        for method in report.methods:
            compared = baseline is not None and method in baseline.methods and (task == "mean" or task in baseline.tasks)
            for agg in AGGREGATES:
                base = baseline.value(f"{method}/{agg}", task) if compared else None
                out.update(metric_keys(prefix, method, agg, task, report.value(f"{method}/{agg}", task), base))
    return {k: v for k, v in out.items() if not math.isnan(v)}


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
    def __init__(self, prefix: str, run: RunFolder, fail: Callable[[object, str], None], verbose: bool,
                 subscribers: list[Subscriber]):
        self.prefix, self.run, self.fail, self.verbose = prefix, run, fail, verbose
        self.subscribers = subscribers  # the eval callback's list: subscribing later still counts
        self.unsaved: list[dict] = []  # records whose append failed, retried first
        self._wandb_defined: dict[int, set[str]] = {}  # per W&B run: the keys define_metric has seen

    def record(self, trainer, record: dict | None) -> bool:
        """Append a results.jsonl line (earlier failed ones first; None: only retry those);
        False if something could not be written. A record that is not JSON is dropped."""
        if record is not None:
            self.unsaved.append(record)
        written = True
        while self.unsaved:
            try:
                self.run.append(self.unsaved[0])
            except ResultsWriteError as e:
                self.fail(trainer, f"{e} ({len(self.unsaved)} line(s) held in memory, retried with the next report)")
                return False
            except ResultsRecordError as e:
                self.unsaved.pop(0)
                self.fail(trainer, str(e))
                written = False
                continue
            self.unsaved.pop(0)
        return written

    def record_report(self, trainer, report: EvalReport, score_seconds: float) -> bool:
        """Append the report's results.jsonl line. A report the reader would refuse is an
        error line instead (and a failure): False, and none of its numbers may be logged."""
        record = {**report.to_dict(), "score_seconds": score_seconds}
        try:
            EvalReport.from_dict(record)  # what the reader would refuse is never logged
        except ValueError as e:
            error = f"step {report.step}: the report is refused, none of its numbers is logged: {e}"
            self.record(trainer, {"step": report.step, "snapshot_id": report.snapshot_id, "error": error})
            self.fail(trainer, error)
            return False
        self.record(trainer, record)
        return True

    def publish(self, trainer, report: EvalReport, baseline: EvalReport | None, score_seconds: float,
                errors: int) -> bool:
        """Record, log, fill callback_metrics and notify; False (nothing logged) for a refused report."""
        if not self.record_report(trainer, report, score_seconds):
            return False
        metrics = report_metrics(self.prefix, report, baseline)
        metrics.update({f"{self.prefix}/step": float(report.step), f"{self.prefix}/score_seconds": score_seconds,
                        f"{self.prefix}/errors": float(errors)})
        for logger in trainer.loggers:
            try:
                if isinstance(logger, WandbLogger):
                    self._log_wandb(logger, report, baseline, metrics)
                else:
                    logger.log_metrics(metrics, step=report.step)
            except Exception as e:  # one broken logger must not cost the others their numbers
                self.fail(trainer, f"logging step {report.step} to {type(logger).__name__} failed: "
                                   f"{type(e).__name__}: {e}")
        self.set_callback_metrics(trainer, report.step, {k: v for k, v in metrics.items() if k.endswith("/mean")})
        if self.verbose:
            rank_zero_info(summary_line(self.prefix, report, baseline))
        self.notify(trainer, report, baseline)
        return True

    def set_callback_metrics(self, trainer, step: int, means: dict[str, float]) -> None:
        """The means, for EarlyStopping and ModelCheckpoint, with `<prefix>/step`: the step they are of."""
        for key, value in {**means, f"{self.prefix}/step": float(step)}.items():
            trainer.callback_metrics[key] = torch.tensor(value)

    def notify(self, trainer, report: EvalReport, baseline: EvalReport | None) -> None:
        for fn in list(self.subscribers):
            try:
                fn(report, baseline)
            except Exception as e:
                self.fail(trainer, f"subscriber {getattr(fn, '__qualname__', fn)!s} raised on step {report.step}: "
                                   f"{type(e).__name__}: {e}")

    def log_error_count(self, trainer, errors: int) -> None:
        for logger in trainer.loggers:
            try:
                logger.log_metrics({f"{self.prefix}/errors": float(errors)}, step=trainer.global_step)
            except Exception:
                pass  # the warning already says it; a broken logger can not take the count

    def _log_wandb(self, logger: WandbLogger, report: EvalReport, baseline: EvalReport | None, metrics: dict) -> None:
        import wandb

        run = logger.experiment
        p = self.prefix
        if id(run) not in self._wandb_defined:
            run.define_metric(wandb_name(f"{p}/step"))
            run.config.update({p: {"cache": report.cache.get("path"), "cache_fingerprint": report.cache["fingerprint"],
                                   "target_fingerprint": report.cache.get("target"),
                                   "block_size": report.block_size, "drafter_block_size": report.drafter_block_size,
                                   "methods": report.methods, "scoring": report.scoring}}, allow_val_change=True)
            self._wandb_defined[id(run)] = {f"{p}/step"}  # the x axis itself: not plotted against itself
        defined = self._wandb_defined[id(run)]
        for key in [k for k in metrics if k not in defined]:  # each key the first time it is seen (the baseline's may come late)
            summary = "max" if key not in (f"{p}/score_seconds", f"{p}/errors") else None
            run.define_metric(wandb_name(key), step_metric=wandb_name(f"{p}/step"), **({"summary": summary} if summary else {}))
            defined.add(key)
        columns, rows = comparison(report, baseline)
        extras = {f"{p}/live_table": wandb.Table(columns=columns, data=[[row[0], *(round(x, 4) for x in row[1:])]
                                                                        for row in rows])}
        for method in report.methods:
            ys, keys = [mean_curve(report, method)], ["ours"]
            if baseline is not None and method in baseline.methods:
                ys.append(mean_curve(baseline, method))
                keys.append("baseline")
            depths = list(range(1, len(ys[0]) + 1))
            extras[f"{p}/curve/{method}"] = wandb.plot.line_series(
                xs=depths, ys=ys, keys=keys, xname="depth (draft tokens)",
                title=f"{method}: share of anchors accepting at least d tokens, step {report.step}")
        run.log({**metrics, **extras, "trainer/global_step": report.step})
