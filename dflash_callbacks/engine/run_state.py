"""`RunState`: everything one run knows, owned by the engine and the one thing its ranks exchange.

Its history (a step, the run-level means and their intervals, their comparison with the baseline, per
report), the latest means the host shows (Lightning's `callback_metrics`, the plain loop's `metrics`),
the counts of errors and skipped snapshots, each stop's state and the stop decided and not yet reached
every rank. Rank 0 changes it as reports are published; the other ranks receive its news (`news`,
`take_news`) in the engine's one collective. Every other part of the engine reads it or calls one of its
methods; none assigns its fields. `state_dict` / `load_state_dict`: primitives only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..scoring.report import EvalReport
from .host import Host
from .metric_keys import is_mean_key, mean_keys, restored_means, step_key
from .stop import StopState


def history_entry(report: EvalReport, versus: dict | None, speedup: dict | None = None) -> dict:
    """What the history keeps of a report: its step, its run-level means and their intervals, with a
    baseline their comparison with it (`results_line.versus_record`: the stops judge on its intervals, also
    after a resume), and with scoring.costs its run-level predicted speed-ups (`results_line.speedup_of`; None:
    the ones its results.jsonl line kept, a resume's)."""
    entry = {"step": report.step, "mean": report.mean}
    if report.intervals is not None:
        entry["intervals"] = report.intervals["mean"]
    speedup = speedup if speedup is not None else report.extra.get("speedup")
    return {**entry, **({"versus": versus} if versus else {}), **({"speedup": speedup} if speedup else {})}


@dataclass
class RunState:
    name: str
    methods: list[str]
    has_baseline: bool
    speedup: bool = False  # scoring.costs: the predicted speed-ups are means too
    run_id: str | None = None
    history: list[dict] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the latest means, with <name>/step: their step
    shown: dict[str, float] = field(default_factory=dict)  # what the host was last given (every rank the same)
    errors: int = 0
    skipped: int = 0
    stops: list[StopState] = field(default_factory=list)  # one per stop followed, in the engine's order
    decided: tuple[int, str] | None = None  # rank 0: a stop decided (its index, reason), not yet on every rank
    should_stop: bool = False  # a stop has reached this rank
    restored: bool = False  # the metrics hold a resumed history's last means, nothing newer
    changed: bool = False  # rank 0: metrics the other ranks have not received
    outgoing: list[dict] = field(default_factory=list)  # rank 0: history entries the other ranks lack

    def name_run(self, run_id: str | None) -> None:
        """The run folder's id (rank 0's, on every rank)."""
        self.run_id = run_id

    # ------------------------------------------------------------------ the history and the means
    def add(self, entry: dict, outgoing: bool = False) -> None:
        self.history = sorted([h for h in self.history if h["step"] != entry["step"]] + [entry],
                              key=lambda h: h["step"])
        if outgoing:
            self.outgoing.append(entry)

    def replace_history(self, history: list[dict]) -> None:
        """A resumed run's history, rebuilt from its results.jsonl."""
        self.history = list(history)

    def start(self, host: Host, baseline: EvalReport | None) -> None:
        """Every mean key, before any report: NaN, a placeholder (a monitor of ours is never missing, and
        ModelCheckpoint ranks NaN below any number); on a resume, the last report's means."""
        self.metrics = {key: math.nan for key in mean_keys(self.name, self.methods, self.has_baseline, self.speedup)}
        if self.history:
            self.restore(baseline, host, closing=False)
        self.show(host)

    def restore(self, baseline: EvalReport | None, host: Host, closing: bool) -> None:
        """A resume: the last report's means back (a loop starts them empty), with the baseline's, the deltas
        and the ratios once the baseline is known, and the intervals the history keeps of its comparison."""
        last = self.history[-1]
        self.set(last["step"], restored_means(self.name, last, baseline), host, closing)
        self.restored = True

    def set(self, step: int, means: dict[str, float], host: Host, closing: bool) -> None:
        """Rank 0: the means of `step`. With several ranks the host gets them at the next exchange, on every
        rank at once (a monitor read on one rank only would leave the others out of a collective)."""
        self.metrics.update({**means, step_key(self.name): float(step)})
        self.changed, self.restored = True, False
        if host.world_size == 1 or closing:
            self.show(host)

    def show(self, host: Host) -> None:
        """The host gets the latest means (every rank at once, with several)."""
        self.shown = dict(self.metrics)
        host.set_metrics(dict(self.shown))

    def nan_means(self, step: int, host: Host, closing: bool) -> None:
        """The drafter's numbers are NaN (a non-finite report): so are its means."""
        self.set(step, {key: math.nan for key in self.metrics if is_mean_key(self.name, key)}, host, closing)

    # ------------------------------------------------------------------ counts
    def count_error(self) -> int:
        self.errors += 1
        return self.errors

    def count_skipped(self) -> None:
        self.skipped += 1

    # ------------------------------------------------------------------ the stops
    @property
    def stop_reason(self) -> str | None:
        """Why a stop stopped training (or would have), None before."""
        return next((s.stop_reason for s in self.stops if s.stop_reason), None)

    def add_stop(self, state: StopState) -> None:
        self.stops.append(state)

    def remove_stop(self, index: int) -> None:
        del self.stops[index]
        if self.decided is not None and self.decided[0] >= index:
            self.decided = None if self.decided[0] == index else (self.decided[0] - 1, self.decided[1])

    def judged(self, index: int, state: StopState, reason: str | None) -> None:
        """Stop `index` judged a report (rank 0): its new state, and the first stop decided (`reason`)."""
        self.stops[index] = state
        if reason is not None and self.decided is None:
            self.decided = (index, reason)

    def take_decided(self) -> tuple[int, str] | None:
        """Rank 0, one process: the stop decided since, once."""
        decided, self.decided = self.decided, None
        return decided

    def reach(self, decided: tuple[int, str] | None, step: int) -> str | None:
        """On every rank: the stop decided reaches training at `step`; its reason, or None."""
        if decided is None:
            return None
        index, reason = decided
        self.stops[index] = self.stops[index].reached(reason, step)
        self.should_stop = True
        return reason

    # ------------------------------------------------------------------ between ranks
    def news(self) -> dict[str, Any]:
        """Rank 0: what the other ranks lack, taken once (the history and means since the last news, the
        counts, the stops' states and the stop decided)."""
        news = {"history": self.outgoing, "errors": self.errors, "skipped": self.skipped,
                "metrics": dict(self.metrics) if self.changed else None, "stops": list(self.stops),
                "decided": self.decided}
        self.outgoing, self.changed, self.decided = [], False, None
        return news

    def take_news(self, news: dict[str, Any], rank: int) -> None:
        """Rank 0's news on every rank (rank 0 has it already)."""
        if rank != 0:
            for entry in news["history"]:
                self.add(entry)
            self.errors, self.skipped, self.stops = news["errors"], news["skipped"], list(news["stops"])
        if news["metrics"] is not None:
            self.metrics = news["metrics"]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, basis: dict | None) -> dict[str, Any]:
        """Primitives only, the same on every rank: the run, its history and counts, and the stops'."""
        return {"run_id": self.run_id, "basis": basis if self.run_id else None,
                "history": [dict(h) for h in self.history], "errors": self.errors, "skipped": self.skipped,
                "stops": [s.state_dict() for s in self.stops]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume's counts and history (a run folder reopened replaces the history with its own)."""
        for entry in state_dict.get("history", []):
            self.add(entry)
        self.errors, self.skipped = state_dict.get("errors", 0), state_dict.get("skipped", 0)
