"""Sending each report to every tracker, losing none when one fails.

`Delivery(trackers, warn)`: `send(step, metrics, table)` hands a report's keys (and its per-task table)
to every tracker; `send_image(name, path)` the run's plot, at the end; `finish()` tries what is still
held once more, closes every tracker and returns the lines of the summary.

A tracker that raises (a server down, a folder that can not be written, anything) costs a warning
and one error in `errors[name]`; what it missed is held, and sent to it again, oldest step first,
before anything newer, at the next `send` (so a tracker that comes back gets every report in step
order; a report a tracker refuses for good holds back those after it, and the summary names them
all). Metrics and the table of a step are held apart: a table that failed does not send the metrics
again. Nothing is dropped: whatever a tracker still lacks at `finish()` is named in its
summary line, by step; results.jsonl holds every report whatever happens here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .base import Tracker, checked_trackers


class Table(NamedTuple):
    """A report's per-task table: its name (a key), its columns and rows."""
    name: str
    columns: Sequence[str]
    rows: Sequence[Sequence[object]]


@dataclass
class Item:
    """One thing a tracker is to get: "metrics" or "table" of a step, or the "image" (no step)."""
    kind: str
    step: int | None
    payload: object

    def order(self) -> tuple:
        return (self.step is None, self.step or 0, self.kind != "metrics")

    def send(self, tracker: Tracker) -> None:
        if self.kind == "metrics":
            tracker.log_metrics(self.payload, self.step)
        elif self.kind == "table":
            tracker.log_table(self.payload.name, self.payload.columns, self.payload.rows, self.step)
        else:
            tracker.log_image(*self.payload)

    def what(self) -> str:
        return {"metrics": f"step {self.step}", "table": f"the table of step {self.step}"}.get(self.kind, "the plot")


@dataclass
class Destination:
    tracker: Tracker
    held: list[Item] = field(default_factory=list)  # what it missed, in step order
    closed: bool = False


def steps_text(steps: list[int]) -> str:
    """`2, 4, 6` or, for many, `2, 4, 6, ..., 98, 100`."""
    text = [str(s) for s in steps]
    return ", ".join(text if len(text) <= 8 else text[:3] + ["..."] + text[-2:])


class Delivery:
    """Every report to every tracker; `errors[name]`: that tracker's failures so far."""

    def __init__(self, trackers: Sequence[Tracker], warn: Callable[[str], None]):
        trackers = checked_trackers(trackers)
        self.destinations = [Destination(t) for t in trackers]
        self.warn = warn
        self.errors: dict[str, int] = {t.name: 0 for t in trackers}
        self.finished, self.lines = False, []  # lines: the summary, once finished

    def send(self, step: int, metrics: Mapping[str, float], table: Table | None = None) -> None:
        """One report (its keys at `step`, its table) to every tracker, after what each still holds."""
        self._refuse_after_finish()
        items = [Item("metrics", int(step), dict(metrics))]
        if table is not None:
            items.append(Item("table", int(step), Table(*table)))
        for destination in self.destinations:
            self._deliver(destination, items)

    def send_image(self, name: str, path: str | Path) -> None:
        """The run's plot (a PNG file: it must stay until `finish()`, which may send it again)."""
        self._refuse_after_finish()
        for destination in self.destinations:
            self._deliver(destination, [Item("image", None, (name, Path(path)))])

    def _refuse_after_finish(self) -> None:
        if self.finished:
            raise RuntimeError("this Delivery has finished: its trackers are closed")

    def _deliver(self, destination: Destination, items: list[Item]) -> None:
        missed = list(destination.held)
        destination.held = sorted(missed + items, key=Item.order)
        tracker = destination.tracker
        while destination.held:
            item = destination.held[0]
            try:
                item.send(tracker)
            except Exception as e:  # a tracker's failure is never the run's
                self.errors[tracker.name] += 1
                self.warn(f"{tracker.name}: {item.what()} not sent ({type(e).__name__}: {e}); "
                          f"{len(destination.held)} item(s) held for it, sent again before anything newer "
                          "(results.jsonl has them all)")
                return
            destination.held.pop(0)
        if missed:
            steps = sorted({i.step for i in missed if i.step is not None})
            self.warn(f"{tracker.name} is back: sent the {len(missed)} item(s) it had missed"
                      + (f" (steps {steps_text(steps)})" if steps else ""))

    def finish(self) -> list[str]:
        """What is held is tried once more, every tracker is closed; one line per tracker that failed at
        any point: its error count and what it still lacks (nothing: every report reached it in the end).
        Once: called again, the same lines."""
        if self.finished:
            return list(self.lines)
        self.finished, lines = True, []
        for destination in self.destinations:
            tracker = destination.tracker
            if destination.held:
                self._deliver(destination, [])
            if not destination.closed:
                destination.closed = True
                try:
                    tracker.close()
                except Exception as e:
                    self.errors[tracker.name] += 1
                    self.warn(f"{tracker.name}: closing it failed ({type(e).__name__}: {e})")
            if self.errors[tracker.name]:
                lines.append(f"{tracker.name}: {self.errors[tracker.name]} error(s); " + lacking(destination.held))
        self.lines = lines
        return list(lines)


def lacking(held: list[Item]) -> str:
    if not held:
        return "every report reached it in the end"
    parts = []
    for kind, label in (("metrics", "the reports of steps"), ("table", "the tables of steps")):
        steps = [i.step for i in held if i.kind == kind]
        if steps:
            parts.append(f"{label} {steps_text(steps)}")
    if any(i.kind == "image" for i in held):
        parts.append("the plot")
    return "it lacks " + " and ".join(parts) + " (results.jsonl has them)"
