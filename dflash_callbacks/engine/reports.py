"""A run's reports on rank 0, on the training thread: each outcome the runner hands back becomes a
line of results.jsonl first, then numbers for the loggers and the host's metrics, an entry of the
history, a decision of the stops and a call of every subscriber (`publish.py` has the order and
the keys). A failure anywhere is a warning and an error count, or a raise with on_error="raise".

The baseline's report comes before everything else, and the reports a killed run's watcher left
(`recovered`) after it, before any new one: their deltas and ratios need the baseline.
"""

from __future__ import annotations

from collections.abc import Callable

from ..scoring.intervals import resolution_warning
from ..scoring.report import EvalReport
from ..scoring.table import comparison_table
from ..settings import EvalSettings
from .host import Host
from .metric_keys import held_means
from .run_state import RunState, history_entry
from .publish import Publisher, Subscriber, summary_line, versus_baseline, versus_record
from .runners.background import BackgroundRunner
from .runners.jobs import BaselineOutcome, SnapshotOutcome, is_non_finite
from .stop import Moment, StopPolicy


def final_table(reports: list[EvalReport], baseline: EvalReport | None) -> str | None:
    """What a run ends with (the demo, and every adapter with verbose=True): the last report's live tau
    per task against the baseline, each number with its 95% interval, and a verdict per method; None
    before any report."""
    if not reports:
        return None
    last = max(reports, key=lambda r: r.step)
    return f"\n{comparison_table(last, baseline)}\n"


class Reports:
    def __init__(self, settings: EvalSettings, host: Host, state: RunState, policies: list[StopPolicy],
                 subscribers: list[Subscriber], step: Callable[[], int | None]):
        """`state`: the engine's, changed through its methods; `policies`: the stops it follows (read)."""
        self.settings, self.host, self.state, self.policies = settings, host, state, policies
        self.subscribers, self.step = subscribers, step
        self.publisher: Publisher | None = None
        self.reports: list[EvalReport] = []  # published by this process, in arrival order
        self.baseline: EvalReport | None = None
        self.baseline_settled = settings.baseline is None
        self.recovered: list[EvalReport] = []  # watcher reports a killed run never picked up
        self.closing = False

    def start(self, publisher: Publisher, recovered: list[EvalReport]) -> None:
        self.publisher, self.recovered = publisher, list(recovered)

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
            self.publisher.record_report(outcome.report, outcome.seconds, outcome.versus, outcome.record)
        else:
            self.record_outcome(outcome)

    def publish_recovered(self) -> None:
        """The watcher reports a killed run never picked up: older than any job, so first, once the
        baseline is settled."""
        while self.recovered and self.baseline_settled:
            self.publish(self.recovered.pop(0), None)

    def record_outcome(self, outcome: SnapshotOutcome) -> None:
        self.publisher.record({"step": outcome.step, "snapshot_id": outcome.snapshot_id, "error": outcome.error,
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
                line = resolution_warning(baseline, policy.monitor, policy.min_ratio)
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
        metrics = self.publisher.publish(report, self.baseline, seconds, self.state.errors, versus, record)
        if metrics is None:
            return  # refused: an error line, nothing logged
        self.state.set(report.step, held_means(metrics), self.host,
                       self.closing)
        self.state.add(history_entry(report, versus_record(versus, digits=None) if versus else None), outgoing=True)
        self.reports.append(report)
        if self.settings.verbose:
            self.host.info(summary_line(self.settings.name, report, self.baseline))
        self.notify(report, versus)

    def notify(self, report: EvalReport, versus: dict | None) -> None:
        """The stops decide (with the paired comparison of their monitor), then every subscriber gets the
        report; one that raises is a failure."""
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
        for level, line in verdict.said:
            (self.host.info if level == "info" else self.host.warn)(line)

    def fail(self, message: str) -> None:
        errors = self.state.count_error()
        if self.settings.on_error == "raise":
            raise RuntimeError(f"{self.settings.name}: {message}")
        self.host.warn(f"{self.settings.name}: {message} (training goes on; errors so far: {errors})")
        if self.publisher is not None:
            self.publisher.log_error_count(errors, self.step() or 0)
