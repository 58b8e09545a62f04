"""The publisher: each outcome the runner hands back, on rank 0 on the training thread, becomes, in this
order, a line of results.jsonl (before anything else: a crash loses no finished report), the numbers for
the loggers and W&B (`metric_keys`, `trackers/wandb.py`), the host's metrics and an entry of the run's
history (`RunState`), a verdict of each stop and a call of every subscriber.

A step that fails (a full disk, a broken logger, a subscriber that raises) is a warning and an error
count (`fail`), or a raise with on_error="raise", and the other steps still run; a line that could not
be appended is kept and appended again before the next one. A report the strict reader refuses
(`EvalReport.from_dict`: a NaN, a tau out of range, ...) is an error for its step: an error line takes its
place in results.jsonl and none of its numbers is logged. A line that can not be JSON at all is dropped
and counted, never retried. The baseline's report comes before everything else, and the reports a
killed run's watcher left (`recovered`) after it, before any new one: their deltas and ratios need it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..scoring.intervals import resolution_warning
from ..scoring.report import EvalReport
from ..settings import EvalSettings
from .host import Host
from .metric_keys import (
    MADE_HERE, errors_key, held_means, live_table, report_metrics, run_counts, speedup_values, table_key,
)
from .run_folder import ResultsRecordError, ResultsWriteError, RunFolder
from .run_state import RunState, history_entry
from .results_line import results_record, speedup_entry, summary_line, versus_baseline, versus_record
from .runners.background import BackgroundRunner
from .runners.jobs import BaselineOutcome, SnapshotOutcome, is_non_finite
from .stop import Moment, StopPolicy
from .trackers.delivery import Delivery, Table
from .trackers.wandb import WandbTracker

Subscriber = Callable[[EvalReport, "EvalReport | None"], object]


class Publisher:
    def __init__(self, settings: EvalSettings, host: Host, state: RunState, policies: list[StopPolicy],
                 subscribers: list[Subscriber], step: Callable[[], int | None]):
        """`state`: the engine's, changed through its methods; `policies`: the stops it follows (read); the
        host's loggers and W&B runs are looked up at each report (one added after the start still counts)."""
        self.settings, self.host, self.state, self.policies = settings, host, state, policies
        self.subscribers, self.step, self.prefix = subscribers, step, settings.name
        self.run: RunFolder | None = None
        self.unsaved: list[dict] = []  # records whose append failed, retried first
        self.trackers: dict[int, WandbTracker] = {}  # per W&B run
        self.delivery: Delivery | None = None  # the host's other trackers (TensorBoard, MLflow, ...), at the first report
        self.reports: list[EvalReport] = []  # published by this process, in arrival order
        self.baseline: EvalReport | None = None
        self.baseline_settled = settings.baseline is None
        self.recovered: list[EvalReport] = []  # watcher reports a killed run never picked up
        self.closing = False
        self.stopped_by: tuple[int, int, str] | None = None  # (which stop, the report it stopped at, why): the plot's

    def start(self, run: RunFolder, recovered: list[EvalReport]) -> None:
        self.run, self.recovered = run, list(recovered)

    def close(self) -> None:
        """The run is closing: a stop decided now finds training ending anyway."""
        self.closing = True

    def settle_baseline(self) -> None:
        """No baseline comes after this."""
        self.baseline_settled = True

    # ------------------------------------------------------------------ outcomes
    def drain(self, runner: BackgroundRunner | None) -> None:
        """Publish every outcome the runner has finished; with on_error="raise", what was polled and not
        handled still reaches the disk before the first failure is raised."""
        if runner is None:
            return
        outcomes, handled = runner.poll(), 0
        try:
            self.publish_recovered()
            for outcome in outcomes:
                handled += 1
                self.handle(outcome)
        except Exception:
            for rest in outcomes[handled:]:
                try:
                    self.keep(rest)
                except Exception:
                    pass  # the first failure is the one raised; the next outcomes are still kept
            raise

    def handle(self, outcome) -> None:
        if isinstance(outcome, BaselineOutcome):
            self.baseline_settled = True
            if outcome.error is None:
                self.baseline = outcome.report
                for line in outcome.notes:  # the stops' setup warnings, made on the runner's thread
                    self.host.warn(line)
                if self.state.restored:  # a resume, nothing newer yet: now with the baseline's keys
                    self.state.restore(self.baseline, self.host, self.closing)
            self.publish_recovered()  # older than anything polled after the baseline
            if outcome.error is not None:
                self.fail(f"scoring the baseline failed: {outcome.error}")
            return
        if outcome.error is not None:
            self.record_outcome(outcome)
            if is_non_finite(outcome.error):
                self.state.nan_means(outcome.step, self.host, self.closing)
            self.fail(f"step {outcome.step} failed: {outcome.error}")
        else:
            self.publish(outcome.report, outcome.seconds, outcome.versus, outcome.record)

    def keep(self, outcome) -> None:
        """An outcome on disk without logging it (training is failing)."""
        if isinstance(outcome, BaselineOutcome):
            self.baseline = outcome.report or self.baseline
        elif outcome.report is not None:
            self.record_report(outcome.report, outcome.seconds, outcome.versus, outcome.record)
        else:
            self.record_outcome(outcome)

    def publish_recovered(self) -> None:
        """The watcher reports a killed run never picked up: older than any job, so first, once the
        baseline is settled."""
        while self.recovered and self.baseline_settled:
            self.publish(self.recovered.pop(0), None)

    def record_outcome(self, outcome: SnapshotOutcome) -> None:
        self.record({"step": outcome.step, "snapshot_id": outcome.snapshot_id, "error": outcome.error,
                     "seconds": outcome.seconds})

    def unresolvable(self, baseline: EvalReport) -> list[str]:
        """Once the baseline's report is in hand (the runner's `notes`, off the training thread): a line for
        each stop whose threshold this cache is too small to ever resolve (the baseline's own interval
        wider than the margin). It still runs."""
        if baseline.intervals is None:
            return []
        lines = []
        for policy in list(self.policies):
            if policy.confidence is not None and policy.min_ratio is not None:
                line = resolution_warning(baseline, policy.tau_monitor, policy.min_ratio)
                if line is not None:
                    lines.append(f"{policy.shown_name}: {line}")
        return lines

    # ------------------------------------------------------------------ a report
    def publish(self, report: EvalReport, seconds: float | None, versus: dict | None = None,
                record: tuple[dict, str | None] | None = None) -> None:
        """results.jsonl, the loggers, the metrics, the history, then the stops and the subscribers.
        `versus` (the report against the baseline) and `record` (its results.jsonl line): the runner's,
        made off the training thread; made here for a recovered report."""
        seconds = report.seconds if seconds is None else seconds
        if versus is None:  # the runner had no baseline yet: the comparison, and a line with it, made here
            versus = versus_baseline(report, self.baseline)
            record = record if versus is None else None
        speedups = speedup_values(report, self.baseline, versus)  # once: the keys, the history (and a line made here)
        metrics = self.write(report, self.baseline, seconds, versus, record, speedups)
        if metrics is None:
            return  # refused: an error line, nothing logged
        self.state.set(report.step, held_means(metrics), self.host, self.closing)
        self.state.add(history_entry(report, versus_record(versus, digits=None) if versus else None,
                                     speedup_entry(speedups, versus, digits=None)), outgoing=True)
        self.reports.append(report)
        if self.settings.verbose:
            self.host.info(summary_line(self.settings.name, report, self.baseline))
        self.notify(report)

    def notify(self, report: EvalReport) -> None:
        """The stops judge the run with the report, then every subscriber gets it; one that raises is a failure."""
        ending = self.host.ending() or ("the run is closing" if self.closing else None)
        step = self.step()
        now = Moment(step=step if step is not None else int(report.step), horizon=self.host.horizon(), ending=ending)
        listeners = [(policy, lambda r, b, p=policy: self.judge(p, r, b, now)) for policy in self.policies]
        listeners += [(fn, fn) for fn in list(self.subscribers)]
        for who, call in listeners:
            try:
                call(report, self.baseline)
            except Exception as e:
                self.fail(f"subscriber {getattr(who, '__qualname__', type(who).__qualname__)!s} raised on step "
                          f"{report.step}: {type(e).__name__}: {e}")

    def judge(self, policy: StopPolicy, report: EvalReport, baseline: EvalReport | None, now: Moment) -> None:
        """`policy` judges the run with this report (rank 0); the run's state takes its verdict."""
        index = self.policies.index(policy)
        verdict = policy.evaluate(self.state.history, baseline, now, self.state.stops[index], self.settings.name,
                                  step=report.step)
        self.state.judged(index, verdict.state, verdict.reason if verdict.should_stop else None)
        if verdict.should_stop and self.stopped_by is None:
            self.stopped_by = (index, int(report.step), verdict.reason)
        for level, line in verdict.said:
            (self.host.info if level == "info" else self.host.warn)(line)

    def fail(self, message: str) -> None:
        errors = self.state.count_error()
        if self.settings.on_error == "raise":
            raise RuntimeError(f"{self.settings.name}: {message}")
        self.host.warn(f"{self.settings.name}: {message} (training goes on; errors so far: {errors})")
        for _, log in self.host.loggers() if self.run is not None else []:
            try:
                log({errors_key(self.prefix): float(errors)}, self.step() or 0)
            except Exception:
                pass  # the warning already says it; a broken logger can not take the count

    # ------------------------------------------------------------------ results.jsonl and the loggers
    def record(self, record: dict | None) -> bool:
        """Append a results.jsonl line (earlier failed ones first; None: only retry those); False if
        something could not be written. A record that is not JSON is dropped."""
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
                      prepared: tuple[dict, str | None] | None = None, speedups: object = MADE_HERE) -> bool:
        """Append the report's results.jsonl line (`prepared`: made already, by the runner; else made here, on
        `speedups`, `metric_keys.speedup_values`). A report the reader would refuse is an error line instead
        (and a failure): False, and none of its numbers may be logged."""
        record, refused = prepared or results_record(report, score_seconds, versus, speedup_entry(
            speedup_values(report, self.baseline, versus, speedups), versus))
        if refused is not None:
            error = f"step {report.step}: the report is refused, none of its numbers is logged: {refused}"
            self.record({"step": report.step, "snapshot_id": report.snapshot_id, "error": error})
            self.fail(error)
            return False
        self.record(record)
        return True

    def write(self, report: EvalReport, baseline: EvalReport | None, score_seconds: float,
              versus: dict | None = None, prepared: tuple[dict, str | None] | None = None,
              speedups: object = MADE_HERE) -> dict[str, float] | None:
        """Record, then log to every logger and W&B run at the report's step (`versus`: the paired comparison
        with the baseline, for the intervals of the deltas and ratios; `speedups`: the report's predicted
        speed-ups, `metric_keys.speedup_values`, made here where not given); returns what was logged (None, and
        nothing logged, for a refused report)."""
        speedups = speedup_values(report, baseline, versus, speedups)
        if not self.record_report(report, score_seconds, versus, prepared, speedups):
            return None
        metrics = report_metrics(self.prefix, report, baseline, versus, speedups)
        metrics.update(run_counts(self.prefix, report.step, score_seconds, self.state.errors))
        for name, log in self.host.loggers():
            self._guarded(name, report.step, lambda: log(metrics, report.step))
        for name, run, log in self.host.wandb_runs():
            tracker = self.trackers.setdefault(id(run), WandbTracker(name, run, log, self.prefix))
            self._guarded(name, report.step, lambda: tracker.log_report(report, baseline, metrics, log))
        if self.delivery is None:
            self.delivery = Delivery(self.host.trackers(), self.host.warn)
        if self.delivery.destinations:  # a tracker's failure is its own warning and count (`Delivery.errors`)
            self.delivery.send(report.step, metrics, Table(table_key(self.prefix), *live_table(report, baseline)))
        return metrics

    def finish_trackers(self, plot: bool) -> None:
        """The end of the run: with `plot`, the run's live-tau plot (live_tau.png in the run folder) to every
        tracker; then what each still holds is tried once more and each is closed. A line for each tracker
        that failed on the way (what it lacks; results.jsonl has everything)."""
        delivery = self.delivery
        if delivery is None or not delivery.destinations or delivery.finished:
            return
        if plot and self.reports and self.run is not None:
            try:
                delivery.send_image(f"{self.prefix}/plot", self.plot(self.run.path / "live_tau.png"))
            except Exception as e:  # the plot is a picture of results.jsonl: never worth the run
                self.host.warn(f"{self.settings.name}: the live-tau plot could not be drawn ({type(e).__name__}: {e})")
        for line in delivery.finish():
            self.host.warn(f"{self.settings.name}: {line}")

    def plot(self, path) -> object:
        from .live_tau_plot import plot_live_tau

        policy = self.policies[self.stopped_by[0]] if self.stopped_by else self.policies[0] if self.policies else None
        stopped, reason = (self.stopped_by[1], self.stopped_by[2]) if self.stopped_by else (None, None)
        title = f"{self.settings.name}: live tau of ours against the baseline ({len(self.reports)} reports)"
        return plot_live_tau(sorted(self.reports, key=lambda r: r.step), self.baseline, path, title=title,
                             stop=policy if self.baseline is not None else None, stop_step=stopped, stop_reason=reason,
                             horizon=self.host.horizon())

    def _guarded(self, name: str, step: int, log: Callable[[], object]) -> None:
        try:
            log()
        except Exception as e:  # one broken logger must not cost the others their numbers
            self.fail(f"logging step {step} to {name} failed: {type(e).__name__}: {e}")
