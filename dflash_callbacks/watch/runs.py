"""`dflash-callbacks watch`: score the snapshots training runs write, from another process or host.

Pair it with `DrafterEvalCallback(runner="external", dirpath=DIR)`. `--dir` is that
`dirpath` (one subfolder per run; new runs are picked up as they appear) or one run
folder; a --dir holding no run folder, or not there yet, is an error with --once
(naming the folder meant, when one is near), else a notice and a wait. Run folders whose run.json names another runner
(thread, process) are skipped, and said so once. Every poll, for every run folder, the watcher
- scores the baseline once into reports/baseline.json (a failure is written there as
  `{"error": ...}`, so the run goes on without one, and retried on the next poll; the
  run takes the report when it appears); without --baseline, writes that error for a
  run whose run.json expects one, so the run does not wait for it;
- scores every snapshot whose report is missing or names another snapshot id into
  reports/step-XXXXXXXX.json (`{"error", "step", "snapshot_id"}` when scoring fails);
and writes a heartbeat (DIR/watcher.json), so a run that waits for it knows it is there.
Each file is written atomically; each snapshot scored is logged on one line.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from ..files import file_version
from ..scoring.report import EvalReport
from ..scoring.service import ScoringService, ServiceSpec, preflight, recorded_weights, weights_fingerprint
from ..engine.run_folder import RUN_FILE, RunFolder, is_run_folder, write_heartbeat
from ..engine.runners import describe


def run_folders(root: Path) -> list[RunFolder]:
    """`root` itself when it is a run folder, else every run folder directly under it."""
    if is_run_folder(root):
        return [RunFolder(root)]
    return [RunFolder(p) for p in sorted(root.iterdir()) if p.is_dir() and is_run_folder(p)]


def runs_hint(root: Path) -> str:
    """For a --dir that holds no run folder: the folder nearby that does, if there is one
    (the run folder above a run's snapshots/, or a subfolder holding run folders)."""
    if is_run_folder(root.parent):
        return f"; did you mean --dir {root.parent}?"
    holders = sorted({f.parent.parent for depth in (2, 3) for f in root.glob("*/" * depth + RUN_FILE)})
    if holders:
        return f"; did you mean --dir {holders[0]}?"
    return f" (a run folder holds {RUN_FILE}); give the callback's dirpath, e.g. runs/demo/dflash"


class Watcher:
    def __init__(self, service: ScoringService, root: Path, log=print):
        self.service, self.root, self.log = service, root, log
        self._baseline: EvalReport | str | None = None  # the report, or the last error
        self._read: dict[Path, tuple[tuple, bool, str | None]] = {}  # report path -> (its stat, read back)
        self._own: dict[Path, tuple] = {}  # baseline report path -> its stat when it held this watcher's weights
        self._weights: dict[str, str | None] = {}  # baseline folder a run expects -> its weights' fingerprint
        self._skipped: set[Path] = set()  # run folders of another runner, logged once
        self._unwritten: dict[Path, dict] = {}  # report path -> the payload whose write failed
        self._failing: dict[Path, str] = {}  # run folder or report path -> its failure, logged once while it lasts

    def reported(self, run: RunFolder, path: Path) -> tuple[bool, str | None] | None:
        """(is it a report rather than an error, the snapshot id it names) of a report file,
        None when there is none; a file is read again only when it was replaced."""
        key = file_version(path)
        if key is None:
            return None
        if self._read.get(path, (None,))[0] != key:
            found = run.read_report(path)
            self._read[path] = (key, isinstance(found, EvalReport), found.snapshot_id)
        return self._read[path][1:]

    def replaces_baseline(self, run: RunFolder, expected) -> bool:
        """Whether the run's baseline report should give way to this watcher's: the run expects
        (`expected`, its run.json's baseline) this watcher's baseline, the same weights, and the
        report there is of other weights (another watcher's). Any other run's is left alone."""
        ours = recorded_weights(self.baseline())
        if ours is None or not isinstance(expected, str) or not expected or self._weights_of(expected) != ours:
            return False
        path = run.report_path(None)
        version = file_version(path)
        if version is None or self._own.get(path) == version:
            return False
        theirs = recorded_weights(run.read_report(path))
        if theirs == ours:
            self._own[path] = version
        return theirs != ours

    def _weights_of(self, folder: str) -> str | None:
        """weights_fingerprint of a baseline folder a run expects (None where it can not be read here)."""
        if folder not in self._weights:
            try:
                self._weights[folder] = weights_fingerprint(folder)
            except (OSError, ValueError):
                self._weights[folder] = None
        return self._weights[folder]

    def baseline(self) -> EvalReport | str | None:
        """The baseline's report, scored once; after a failure, tried again on each call."""
        if self.service.spec.baseline is None or isinstance(self._baseline, EvalReport):
            return self._baseline
        try:
            self._baseline = self.service.baseline()
            self.log(f"watch: baseline {self.service.spec.baseline} scored")
        except Exception as e:
            self._baseline = describe(e)
            self.log(f"watch: scoring the baseline failed (retried next poll): {self._baseline}")
        return self._baseline

    def scan_once(self) -> int:
        """Score every snapshot without its report; returns how many were scored. A run folder
        that can not be read or written (a full disk, a folder where a file goes, a run removed
        meanwhile) is logged and tried again on the next poll; the other runs go on."""
        if not self.root.is_dir():  # not created yet by the training run: nothing to score, no heartbeat
            return 0
        done = 0
        try:
            write_heartbeat(self.root)
        except OSError as e:
            self.log(f"watch: writing the heartbeat in {self.root} failed (retried next poll): {e}")
        for run in run_folders(self.root):
            try:
                done += self.scan_run(run)
                self._failing.pop(run.path, None)
            except OSError as e:
                self.failing(run.path, f"watch: {run.path.name}: {e} (retried next poll)")
        return done

    def failing(self, key: Path, message: str) -> None:
        """Log a failure, once while it lasts (the same message again is not logged)."""
        if self._failing.get(key) != message:
            self._failing[key] = message
            self.log(message)

    def scan_run(self, run: RunFolder) -> int:
        about = run.about()
        runner = about.get("runner", "external")  # older runs do not record it
        if runner != "external":
            if run.path not in self._skipped:
                self._skipped.add(run.path)
                self.log(f"watch: skipping {run.path.name}: its runner is {runner!r}, not 'external' "
                         "(it scores its own snapshots)")
            return 0
        baseline, expected = self.reported(run, run.report_path(None)), about.get("baseline")
        if self.service.spec.baseline is not None and (baseline is None or not baseline[0]):
            baseline = self.baseline()
            self.write(run, None, baseline.to_dict() if isinstance(baseline, EvalReport) else {"error": baseline})
        elif self.service.spec.baseline is not None and self.replaces_baseline(run, expected):
            if self.write(run, None, self._baseline.to_dict()):  # another watcher's (which the run may refuse)
                self.log(f"watch: {run.path.name}: replaced another watcher's baseline report with this one's")
        elif self.service.spec.baseline is None and expected and baseline is None:  # the run would wait on it
            if self.write(run, None, {"error": f"the watcher runs without --baseline, but this run expects the "
                                               f"baseline {expected}: restart `dflash-callbacks watch` with "
                                               f"--baseline {expected}"}):
                self.log(f"watch: {run.path.name} expects the baseline {expected}, and this watcher has none")
        done = 0
        for step, folder in run.list_snapshots():
            snapshot_id = run.snapshot_id(folder)
            path = run.report_path(step)
            report = self.reported(run, path)
            if report is not None and report[1] == snapshot_id:
                continue
            payload = self._unwritten.get(path, {})
            if snapshot_id is None or payload.get("snapshot_id") != snapshot_id:  # not scored yet
                started = time.monotonic()
                try:
                    payload = self.service.score_folder(folder).to_dict()
                    summary = ", ".join(f"{m} {v['live']:.2f}" for m, v in payload["mean"].items())
                    self.log(f"watch: {run.path.name} step {step}: live tau {summary} ({time.monotonic() - started:.1f} s)")
                except FileNotFoundError:
                    continue  # pruned by the training run before we got to it
                except Exception as e:
                    payload = {"error": describe(e), "step": step, "snapshot_id": snapshot_id}
                    self.log(f"watch: {run.path.name} step {step} failed: {payload['error']}")
            done += self.write(run, step, payload)
        return done

    def write(self, run: RunFolder, step: int | None, payload: dict) -> bool:
        """Write a report file; when that fails, the failure is logged (once while it lasts) and
        a snapshot's payload is kept, so the next poll writes it without scoring it again."""
        path = run.report_path(step)
        try:
            run.write_report(step, payload)
        except OSError as e:
            self._unwritten[path] = payload
            self.failing(path, f"watch: {run.path.name}: writing {path} failed (retried next poll): {e}")
            return False
        self._unwritten.pop(path, None)
        self._failing.pop(path, None)
        return True


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    from ..scoring.cli import BASELINE_CACHE_HELP, add_scoring_arguments

    p.add_argument("--dir", type=Path, default=None,
                   help="the callback's dirpath (one subfolder per run) or one run folder; waited for if it does not "
                        "exist yet (with --once it must exist)")
    p.add_argument("--cache", required=True, type=Path, help="hidden-state cache folder")
    p.add_argument("--target", required=True, type=Path, help="target folder (only embed_tokens and lm_head are read)")
    p.add_argument("--baseline", type=Path, default=None, help="the runs' baseline drafter folder or saved report JSON")
    p.add_argument("--baseline-cache-dir", type=Path, default=None, help=BASELINE_CACHE_HELP)
    p.add_argument("--poll-seconds", type=float, default=5.0, help="seconds between scans (>= 0)")
    p.add_argument("--idle-exit", type=float, default=None, help="exit after this many seconds without a new snapshot")
    p.add_argument("--once", action="store_true", help="score what is there now and exit")
    add_scoring_arguments(p)


def run_watch(args: argparse.Namespace) -> int:
    from ..scoring.cli import UsageError, scoring_config

    if args.dir.exists() and not args.dir.is_dir() or args.once and not args.dir.is_dir():
        raise UsageError(f"--dir {args.dir} is not a folder: give the callback's dirpath (or a run folder in it)")
    if not all(math.isfinite(x) and x >= 0 for x in (args.poll_seconds, args.idle_exit) if x is not None):
        raise UsageError(f"--poll-seconds and --idle-exit must be finite numbers >= 0; got {args.poll_seconds:g} "
                         f"and {'none' if args.idle_exit is None else format(args.idle_exit, 'g')}")
    spec = ServiceSpec(
        cache=str(args.cache), target=str(args.target),
        baseline=None if args.baseline is None else str(args.baseline),
        scoring=scoring_config(args).to_dict(),
        baseline_cache_dir=None if args.baseline_cache_dir is None else str(args.baseline_cache_dir),
    )
    no_runs = not args.dir.is_dir() or not run_folders(args.dir)
    if no_runs and args.once:
        raise UsageError(f"--dir {args.dir} holds no run folder{runs_hint(args.dir)}")
    preflight(spec, None)
    watcher = Watcher(ScoringService(spec), args.dir, log=lambda line: print(line, flush=True))
    print(f"watch: scoring the snapshots of the runs in {args.dir} (every {args.poll_seconds:g} s; Ctrl-C stops)",
          flush=True)
    if not args.dir.is_dir():  # a watcher started before the training run that makes it
        print(f"watch: {args.dir} does not exist yet, waiting for a training run to create it (the callback's "
              "dirpath; if none will, check the path)", flush=True)
    elif no_runs:
        print(f"watch: {args.dir} holds no run folder yet, waiting for one{runs_hint(args.dir)}", flush=True)
    last_work = time.time()
    while True:
        if watcher.scan_once():
            last_work = time.time()
        if args.once or (args.idle_exit is not None and time.time() - last_work > args.idle_exit):
            return 0
        time.sleep(args.poll_seconds)
