"""What every rank knows of a run's reports: its history (a step, the run-level means and their
comparison with the baseline, per report) and the latest means the host shows (Lightning's
`callback_metrics`, the plain loop's `metrics`). Rank 0 fills them as reports are published; the
other ranks get them through the engine's news (`news.exchange`)."""

from __future__ import annotations

import math

from ..scoring.report import EvalReport
from .host import Host
from .metric_keys import is_mean_key, mean_keys, restored_means, step_key


def history_entry(report: EvalReport, versus: dict | None) -> dict:
    """What the history keeps of a report: its step, its run-level means and their intervals, and, with a
    baseline, their comparison with it (`publish.versus_record`: the stops judge on its intervals, also
    after a resume)."""
    entry = {"step": report.step, "mean": report.mean}
    if report.intervals is not None:
        entry["intervals"] = report.intervals["mean"]
    return {**entry, **({"versus": versus} if versus else {})}


class RunState:
    """The history and the latest means of one run, on every rank."""

    def __init__(self, name: str, methods: list[str], has_baseline: bool):
        self.name, self.methods, self.has_baseline = name, methods, has_baseline
        self.history: list[dict] = []
        self.metrics: dict[str, float] = {}  # the latest means, with <name>/step: the step they are of
        self.shown: dict[str, float] = {}  # what the host was last given (every rank sees the same)
        self.changed = False  # rank 0: metrics the other ranks have not received
        self.restored = False  # the metrics hold a resumed history's last means, nothing newer
        self.outgoing: list[dict] = []  # rank 0: history entries the other ranks have not received

    def add(self, entry: dict, outgoing: bool = False) -> None:
        self.history = sorted([h for h in self.history if h["step"] != entry["step"]] + [entry], key=lambda h: h["step"])
        if outgoing:
            self.outgoing.append(entry)

    def start(self, host: Host, baseline: EvalReport | None) -> None:
        """Every mean key, before any report: NaN, a placeholder (a monitor of ours is never missing, and
        ModelCheckpoint ranks NaN below any number); on a resume, the last report's means."""
        self.metrics = {key: math.nan for key in mean_keys(self.name, self.methods, self.has_baseline)}
        if self.history:
            self.restore(baseline, host, closing=False)
        self.show(host)

    def restore(self, baseline: EvalReport | None, host: Host, closing: bool) -> None:
        """A resume: the last report's means back (a loop starts them empty), with the baseline's, the deltas
        and the ratios once the baseline is known, and the intervals the history keeps of its comparison."""
        last = self.history[-1]
        means = restored_means(self.name, last, baseline)
        self.set(last["step"], means, host, closing)
        self.restored = True

    def set(self, step: int, means: dict[str, float], host: Host, closing: bool) -> None:
        """Rank 0: the means of `step`. With several ranks the host gets them at the next exchange, on every
        rank at once (a monitor read on one rank only would leave the others out of a collective)."""
        self.metrics.update({**means, step_key(self.name): float(step)})
        self.changed = True
        if host.world_size == 1 or closing:
            self.show(host)

    def show(self, host: Host) -> None:
        """The host gets the latest means (every rank at once, with several)."""
        self.shown = dict(self.metrics)
        host.set_metrics(dict(self.shown))

    def nan_means(self, step: int, host: Host, closing: bool) -> None:
        """The drafter's numbers are NaN (a non-finite report): so are its means."""
        self.set(step, {key: math.nan for key in self.metrics if is_mean_key(self.name, key)}, host, closing)
        self.restored = False
