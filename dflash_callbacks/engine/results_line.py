"""What a report is made into besides its logged keys: its comparison with the baseline (`versus_baseline`,
as results.jsonl keeps it: `versus_record`), with scoring.costs its run-level predicted speed-ups
(`speedup_of`) and the fastest configuration, its results.jsonl line (`results_record`; `prepare` makes them
on the runner's thread), the one-line summary of a report and the table a run ends with."""

from __future__ import annotations

from ..scoring.intervals import paired_comparison
from ..scoring.report import EvalReport
from ..scoring.table import comparison_table


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


def speedup_of(report: EvalReport, baseline: EvalReport | None, versus: dict | None,
               digits: int | None = 6) -> dict | None:
    """With scoring.costs, the run-level predicted speed-ups of every method, ours, the baseline's and the
    paired ratio (on `versus`, the comparison made already), as results.jsonl keeps them beside
    `versus_baseline` (`speed.speedup_record`; `digits` None: as computed, what the history holds); None
    without costs, or where the costs do not hold a method's round."""
    from ..scoring.speed import report_speedups

    return speedup_entry(report_speedups(report, baseline, versus), versus, digits)


def speedup_entry(values: dict | None, versus: dict | None, digits: int | None = 6) -> dict | None:
    """`speedup_of` of the speed-ups made already (`scoring.speed.report_speedups`; None: none), each with the
    verdict of `versus` on its monitor."""
    from ..scoring.speed import speedup_record

    if values is None:
        return None
    verdicts = {monitor: per_task["mean"].verdict for monitor, per_task in (versus or {}).items()}
    return speedup_record(values, verdicts, digits)


def results_record(report: EvalReport, score_seconds: float, versus: dict | None,
                   speedup: dict | None = None) -> tuple[dict, str | None]:
    """The report's results.jsonl line (with `versus`, its run-level comparison with the baseline; with
    `speedup`, its run-level predicted speed-ups: `speedup_of`) and, when the strict reader would refuse
    it, why (None: it reads back). Milliseconds of work: the runner makes it off the training thread."""
    record = {**report.to_dict(), "score_seconds": score_seconds,
              **({"versus_baseline": versus_record(versus)} if versus else {}),
              **({"speedup": speedup} if speedup else {})}
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
    the baseline the runner has (`versus_baseline`), its results.jsonl line (`results_record`) and, with
    scoring.costs, the fastest configuration's line (a bootstrap: `speed.report_fastest_line` keeps it for the
    summary line)."""
    from ..scoring.speed import report_fastest_line

    versus = versus_baseline(report, baseline)
    report_fastest_line(report)
    return versus, results_record(report, seconds, versus, speedup_of(report, baseline, versus))


def summary_line(prefix: str, report: EvalReport, baseline: EvalReport | None) -> str:
    """"PREFIX step N: live tau vanilla 3.10 (baseline 3.20, 97%), ..." and, with scoring.costs, a second line
    "PREFIX step N: fastest: ddtree@6:b8, 2.41× [2.30, 2.52] (...)" (`speed.fastest_line`)."""
    from ..scoring.speed import report_fastest_line

    parts = []
    for method in report.methods:
        ours = report.value(f"{method}/live")
        text = f"{method} {ours:.2f}"
        if baseline is not None and method in baseline.methods:
            base = baseline.value(f"{method}/live")
            text += f" (baseline {base:.2f}, {100 * ours / base:.0f}%)" if base else ""
        parts.append(text)
    line = f"{prefix} step {report.step}: live tau " + ", ".join(parts)
    fastest = report_fastest_line(report)
    return line if fastest is None else f"{line}\n{prefix} step {report.step}: {fastest}"


def final_table(reports: list[EvalReport], baseline: EvalReport | None) -> str | None:
    """What a run ends with (the demo, and every adapter with verbose=True): the last report's live tau
    per task against the baseline, each number with its 95% interval, and a verdict per method; with
    scoring.costs, then its predicted speed-up table and the fastest line (`speed.speedup_table`); None
    before any report."""
    if not reports:
        return None
    last = max(reports, key=lambda r: r.step)
    return f"\n{comparison_table(last, baseline)}\n{speedup_lines(last, baseline)}"


def speedup_lines(report: EvalReport, baseline: EvalReport | None) -> str:
    """The predicted speed-up table of a report with scoring.costs (and a line break), else nothing."""
    from ..scoring.costs import CostsError
    from ..scoring.speed import report_contexts, report_costs, speedup_table

    costs = report_costs(report)
    if costs is None:
        return ""
    try:
        return speedup_table(report, baseline, costs, "live", report_contexts(report)) + "\n"
    except (CostsError, ValueError) as e:  # ValueError: the baseline scored on other anchors
        return f"predicted speed-up: not predicted: {e}\n"
