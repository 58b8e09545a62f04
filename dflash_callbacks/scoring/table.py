"""Two reports side by side: `comparison` (a row per task and the mean, per method ours, the
baseline's, delta and ratio) and `comparison_table`, the markdown table `compare`, the demo and
the end of a run print, each number with its interval and a verdict per method."""

from __future__ import annotations

import math

from .intervals import MIN_TASKS, Estimate, paired_comparison
from .report import EvalReport, family_title


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def comparison(ours: EvalReport, baseline: EvalReport | None = None, aggregate: str = "live") -> tuple[list[str], list[list]]:
    """Columns and rows comparing two reports: a row per task and one for the mean; per
    method (those both reports score) ours and, with a baseline, the baseline's value,
    delta = ours - baseline and ratio = ours / baseline (floats; names in the first column)."""
    methods = [m for m in ours.methods if baseline is None or m in baseline.methods]
    columns = ["task"]
    for m in methods:
        columns += [f"{m} {aggregate} {part}" for part in (("ours", "baseline", "delta", "ratio") if baseline else ("ours",))]
    rows = []
    for task in list(ours.tasks) + ["mean"]:
        row: list = [task]
        for m in methods:
            a = ours.value(f"{m}/{aggregate}", task)
            row.append(a)
            if baseline is not None:
                b = baseline.value(f"{m}/{aggregate}", task)
                row += [b, a - b, ratio(a, b)]
        rows.append(row)
    return columns, rows


def comparison_table(ours: EvalReport, baseline: EvalReport | None = None, aggregate: str = "live",
                     other: str = "the baseline") -> str:
    """`comparison` as a markdown table (ratios in percent, the mean row in bold), each number
    with its 95% interval, `mean [lo, hi]`, where the reports carry them (delta and ratio paired:
    `intervals.paired_comparison`), then a line per method with the run-level ratio and the
    verdict against `other` (how the verdict names the other report). Over fewer than
    MIN_TASKS tasks the title names the mean's interval the within-task one, and each line says
    why it gives no verdict."""
    columns, rows = comparison(ours, baseline, aggregate)
    kept = ours.intervals is not None and (baseline is None or baseline.intervals is not None)
    paired, unpaired = {}, []
    if kept and baseline is not None:
        try:
            paired = paired_comparison(ours, baseline)
        except ValueError as e:  # compared with --force across caches: the numbers, without paired intervals
            unpaired.append(f"(delta and ratio without intervals: {e})")

    def cell(column: str, task: str, x) -> str:
        method, _, part = column.rsplit(" ", 2)
        monitor = f"{method}/{aggregate}"
        percent, sign = part == "ratio", part == "delta"
        if kept and part in ("ours", "baseline"):
            return Estimate(x, *(ours if part == "ours" else baseline).interval(monitor, task)).show()
        if kept and monitor in paired:
            return getattr(paired[monitor][task], part).show(percent=percent, sign=sign)
        return f"{100 * x:.0f}%" if percent else f"{x:+.2f}" if sign else f"{x:.2f}"

    header = [c.replace(f" {aggregate} ", " ") for c in columns]  # the title names the aggregate
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        name = f"**{row[0]}**" if row[0] == "mean" else row[0]
        lines.append("| " + " | ".join([name] + [cell(c, row[0], x) for c, x in zip(columns[1:], row[1:])]) + " |")
    title = f"{aggregate} tau (tokens per target forward, 1 to {max(map(ours.max_tau, ours.methods))}; higher is better)"
    title += f", block size {ours.block_size}" + (f", step {ours.step}" if ours.step is not None else "")
    if baseline is not None and family_title(ours) != family_title(baseline):
        title += f"; ours a {family_title(ours)} drafter, {other} a {family_title(baseline)} one"
    if kept and len(ours.tasks) < MIN_TASKS:
        title += (f"; [95% within-task interval]: {len(ours.tasks)} task{'s' if len(ours.tasks) > 1 else ''}, too few "
                  f"for a run-level one (at least {MIN_TASKS}), so the mean's is the text's noise alone")
    elif kept:
        title += f"; [95% interval] over {len(ours.tasks)} tasks"
    verdicts = [f"{monitor.split('/')[0]} {aggregate}: {found['mean'].ratio.show(percent=True)} of {other}, "
                f"{found['mean'].says('it')}" for monitor, found in paired.items() if monitor.endswith(f"/{aggregate}")]
    return "\n".join([title, *lines, *verdicts, *unpaired])
