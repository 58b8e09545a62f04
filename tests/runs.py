"""Reading back what a DrafterEvalCallback run wrote, and auditing it.

`audit(dirpath)` is the suite's count of reports lost, duplicated or mismatched: every
fault test passes its run folders through it, conftest.py adds the counts up and prints
them at the end of the session, and any non-zero count fails the session.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_callbacks.engine.run_folder import RunFolder, is_run_folder
from dflash_callbacks.scoring.report import EvalReport

AUDIT = {"runs": 0, "reports": 0, "lost": 0, "duplicated": 0, "mismatched": 0}


def run_dirs(dirpath: Path) -> list[Path]:
    """The run folders under a callback's dirpath, oldest first."""
    return sorted(p for p in Path(dirpath).iterdir() if p.is_dir() and is_run_folder(p))


def run_dir(dirpath: Path) -> Path:
    """The one run folder under `dirpath`."""
    runs = run_dirs(dirpath)
    assert len(runs) == 1, f"expected one run folder in {dirpath}, found {[r.name for r in runs]}"
    return runs[0]


def records(dirpath: Path) -> list[dict]:
    """Every line of the one run's results.jsonl, as parsed JSON."""
    path = run_dir(dirpath) / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def audit(folder: Path, scored_elsewhere: list[EvalReport] = ()) -> dict:
    """Check one run folder (or every run under a dirpath): at most one report per step
    and one line per (step, snapshot) in results.jsonl (an error line of a step may precede
    the report of a later snapshot of that step: a resume that reached it again); each report names the snapshot id that snapshot.json of its step
    records (when still on disk); each watcher report of a snapshot (its step and id) ended
    in results.jsonl as a report or an error, and each report in `scored_elsewhere`
    (e.g. cb.reports) is in results.jsonl. Adds to AUDIT; returns the
    counts of this folder."""
    folders = [Path(folder)] if is_run_folder(folder) else run_dirs(folder)
    counts = {"runs": len(folders), "reports": 0, "lost": 0, "duplicated": 0, "mismatched": 0}
    recorded_anywhere = set()
    for path in folders:
        run = RunFolder(path)
        results = run.read_results()
        counts["reports"] += len(results.reports)
        steps = [r.step for r in results.reports]
        lines = [(r.step, r.snapshot_id) for r in results.reports] + [(e["step"], e.get("snapshot_id"))
                                                                      for e in results.errors]
        counts["duplicated"] += len(steps) - len(set(steps)) + len(lines) - len(set(lines))
        recorded = {(r.step, r.snapshot_id) for r in results.reports}
        recorded_anywhere |= recorded
        ended = recorded | {(e["step"], e.get("snapshot_id")) for e in results.errors}
        for report in results.reports:
            on_disk = run.snapshot_path(report.step)
            if on_disk.is_dir() and run.snapshot_id(on_disk) != report.snapshot_id:
                counts["mismatched"] += 1
        for step, file in run.list_reports():
            found = run.read_report(file)
            finished = isinstance(found, EvalReport) and found.step == step and found.snapshot_id is not None
            if finished and (step, found.snapshot_id) not in ended:
                counts["lost"] += 1
    counts["lost"] += sum((r.step, r.snapshot_id) not in recorded_anywhere for r in scored_elsewhere)
    for key, value in counts.items():
        AUDIT[key] += value
    return counts


def assert_clean(folder: Path, scored_elsewhere: list[EvalReport] = ()) -> dict:
    counts = audit(folder, scored_elsewhere)
    assert counts["lost"] == counts["duplicated"] == counts["mismatched"] == 0, counts
    return counts
