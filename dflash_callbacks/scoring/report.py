"""EvalReport: the numbers of one scoring run, as JSON, and the comparison table."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..files import atomic_write

AGGREGATES = ("dense", "live")


@dataclass
class EvalReport:
    """Per task and method: {"dense", "live", "curve", "live_rounds", "anchors"}; tau units.

    JSON shape: {"step", "drafter", "cache": {"path", "fingerprint"}, "block_size",
    "tasks": {TASK: {METHOD: {...}}}, "mean": {METHOD: {"dense", "live"}}, ...}.
    """

    drafter: str
    cache: dict[str, str]
    block_size: int
    tasks: dict[str, dict[str, dict[str, Any]]]
    step: int | None = None
    drafter_block_size: int | None = None
    scoring: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    created: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def methods(self) -> list[str]:
        first = next(iter(self.tasks.values()), {})
        return list(first)

    @property
    def mean(self) -> dict[str, dict[str, float]]:
        """Run-level numbers: each task weighs the same."""
        out = {}
        for method in self.methods:
            out[method] = {
                agg: sum(t[method][agg] for t in self.tasks.values()) / len(self.tasks) for agg in AGGREGATES
            }
        return out

    def value(self, monitor: str, task: str = "mean") -> float:
        """`"ddtree@8/live"` -> the mean (or one task's) value."""
        method, _, aggregate = monitor.partition("/")
        aggregate = aggregate or "live"
        if method not in self.methods or aggregate not in AGGREGATES:
            raise KeyError(
                f"{monitor!r} is not in this report; methods: {self.methods}, aggregates: {list(AGGREGATES)}"
            )
        return self.mean[method][aggregate] if task == "mean" else self.tasks[task][method][aggregate]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean"] = self.mean
        return out

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text; with `path`, also written there atomically."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            atomic_write(path, (text + "\n").encode())
        return text

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "EvalReport":
        raw = dict(raw)
        raw.pop("mean", None)
        known = {f for f in cls.__dataclass_fields__}
        missing = {"drafter", "cache", "block_size", "tasks"} - set(raw)
        if missing:
            raise ValueError(f"not an EvalReport: missing {sorted(missing)}")
        extra = {k: raw.pop(k) for k in list(raw) if k not in known}
        report = cls(**raw)
        report.extra.update(extra)
        return report

    @classmethod
    def load(cls, path: str | Path) -> "EvalReport":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a JSON report: {e}") from e


def comparable(ours: EvalReport, baseline: EvalReport) -> list[str]:
    """Reasons the two reports can not be compared number for number (empty: they can)."""
    problems = []
    if ours.cache.get("fingerprint") != baseline.cache.get("fingerprint"):
        problems.append(f"different caches ({ours.cache.get('fingerprint')} vs {baseline.cache.get('fingerprint')})")
    if ours.block_size != baseline.block_size:
        problems.append(f"different block sizes ({ours.block_size} vs {baseline.block_size})")
    if set(ours.tasks) != set(baseline.tasks):
        problems.append(f"different tasks ({sorted(ours.tasks)} vs {sorted(baseline.tasks)})")
    return problems


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def comparison_table(ours: EvalReport, baseline: EvalReport | None = None, aggregate: str = "live") -> str:
    """Markdown table: rows are the tasks and the mean; per method, ours and (with a
    baseline) baseline, delta = ours - baseline, ratio = ours / baseline."""
    methods = [m for m in ours.methods if baseline is None or m in baseline.methods]
    header = ["task"]
    for m in methods:
        header += [f"{m} ours"] + ([f"{m} base", "delta", "ratio"] if baseline else [])
    rows = []
    for task in list(ours.tasks) + ["mean"]:
        row = [f"**{task}**" if task == "mean" else task]
        for m in methods:
            a = ours.value(f"{m}/{aggregate}", task)
            row.append(f"{a:.2f}")
            if baseline is not None:
                b = baseline.value(f"{m}/{aggregate}", task)
                row += [f"{b:.2f}", f"{a - b:+.2f}", f"{100 * ratio(a, b):.0f}%"]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    title = f"{aggregate} tau (tokens per target forward), block size {ours.block_size}"
    if ours.step is not None:
        title += f", step {ours.step}"
    return title + "\n" + "\n".join(lines)
