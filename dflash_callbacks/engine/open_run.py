"""A run's folder, on rank 0: opened fresh, or reopened by a resume of the same run, with what a
killed run left behind recovered (its results.jsonl history, the watcher reports it never picked
up, its snapshots never scored). A resume on another basis (another cache, target head, block size,
tasks or scoring field) goes on in a fresh folder: its numbers could not stand beside the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..scoring.basis import Basis
from ..scoring.report import EvalReport
from ..scoring.service import default_baseline_cache_dir
from ..settings import EvalSettings
from .host import Host
from .run_state import history_entry
from .run_folder import RunFolder, new_run_id
from .runners.jobs import Job, SnapshotOutcome


def basis_changes(basis: Basis, run: RunFolder, recorded: dict | None = None) -> list[str]:
    """How `basis` differs from what the reports of `run` stand on: `recorded` (a resume's checkpoint's,
    its history's; the folder may be gone and recreated), run.json's, else, with neither recorded, its
    first report's. Empty: the same basis (or nothing to compare with)."""
    bases = []
    for raw in (recorded, run.about().get("basis")):
        try:
            bases.append(Basis.from_dict(raw))
        except (TypeError, ValueError, AttributeError):  # none recorded (an older run), or damaged
            pass
    if not bases:
        reports = run.read_results().reports
        bases = [Basis.of_report(reports[0])] if reports else []
    return next((changed for other in bases if (changed := basis.differences(other))), [])


@dataclass
class Opened:
    """What opening a run found: the folder, the history to go on from (None: a fresh run's), the watcher
    reports a killed run never picked up (to publish once the baseline is settled), those on another basis
    (errors), and the unscored snapshots to score."""

    run: RunFolder
    history: list[dict] | None = None
    recovered: list[EvalReport] = field(default_factory=list)
    rejected: list[SnapshotOutcome] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    resumed: bool = False


def open_run(settings: EvalSettings, basis: Basis, host: Host, restored: dict | None,
             fresh_id: str | None, stops: list[dict] | None = None) -> Opened:
    """Rank 0: the run folder of this run, locked. A resume (`restored` names its run) reopens its folder,
    unless its basis changed; else a fresh folder named `fresh_id` (or a new sortable id). `stops`: the
    settings of the stops following it (`StopSettings.to_dict`), recorded for `plot` to replay."""
    root = settings.dirpath or host.default_dirpath(settings.name)
    baseline = settings.baseline
    about = {"runner": settings.runner, "basis": basis.to_dict(),
             "baseline": str(baseline.resolve()) if baseline is not None and baseline.is_dir() else None,
             "scoring": settings.scoring.to_dict(),  # what a watcher started elsewhere reads
             # what `plot` reads: where the baseline's report is cached, the stops and their horizon
             "baseline_cache_dir": str(Path(settings.baseline_cache_dir or default_baseline_cache_dir()).resolve()),
             "stops": list(stops or []), "max_steps": _as_int(host.horizon())}
    if restored is not None and restored.get("run_id"):
        run = RunFolder.reopen(root, restored["run_id"], about)
        changed = basis_changes(basis, run, restored.get("basis"))
        if not changed:
            run.update_about(about)  # a watcher reads the runner and baseline of the resume, not the killed run's
            return recover(run, basis, host, settings)
        run.unlock()
        host.warn(f"{settings.name}: run {restored['run_id']} was scored with {'; '.join(changed)}; its numbers can "
                  "not stand beside this resume's, so the resume goes on in a new run folder")
    run_id = fresh_id or new_run_id()
    run = RunFolder.create(root, run_id, about)
    host.info(f"{settings.name}: new run {run_id}, writing to {run.path}")
    return Opened(run)


def recover(run: RunFolder, basis: Basis, host: Host, settings: EvalSettings) -> Opened:
    """A resume: the history from results.jsonl, the watcher reports a killed run never picked up, its
    unscored snapshots as jobs; scored snapshots beyond keep_last are removed."""
    name = settings.name
    found = run.recover()
    if found.torn_bytes:
        host.warn(f"{name}: {run.results_path} ended in a torn line (a crash while appending); dropped its "
                  f"{found.torn_bytes} bytes")
    for line in found.results.skipped:
        host.warn(f"{name}: {run.results_path} {line}; skipped")
    opened = Opened(run, resumed=True)
    if found.results.reports:
        opened.history = sorted({r.step: history_entry(r, r.extra.get("versus_baseline"))
                                 for r in found.results.reports}.values(), key=lambda h: h["step"])
    for report in found.unread_reports:  # a watcher's: it may have scored on another basis
        problems = basis.mismatches(report, f"the watcher's report of step {report.step}")
        if problems:
            opened.rejected.append(SnapshotOutcome(step=report.step, snapshot_id=report.snapshot_id,
                                                   error="; ".join(problems) + "; not recorded"))
        else:
            opened.recovered.append(report)
    opened.jobs = [Job(step, snapshot_id, folder=folder) for step, snapshot_id, folder in found.unscored_snapshots]
    run.prune(settings.keep_last, unscored=[job.folder for job in opened.jobs])
    history = opened.history or []
    host.info(f"{name}: resuming run {run.path.name} in {run.path}: {len(history)} reports, {len(opened.recovered)} "
              f"recovered from the watcher, {len(opened.jobs)} unscored snapshot(s) queued")
    return opened


def taken_steps(history: list[dict], opened: Opened | None = None) -> set[int]:
    """The steps a run has already snapshotted (never taken again)."""
    steps = {h["step"] for h in history}
    if opened is not None:
        steps |= {r.step for r in opened.recovered} | {j.step for j in opened.jobs}
    return steps


__all__ = ["Opened", "basis_changes", "open_run", "recover", "taken_steps", "Path"]


def _as_int(value) -> int | None:
    """A horizon as JSON takes it: a numpy integer (a Trainer's max_steps may be one) as a plain int."""
    return None if value is None else int(value)
