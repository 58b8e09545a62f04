"""`dflash-callbacks watch`: score the snapshots training runs write, from another process or host.

Pair it with `DrafterEvalCallback(runner="external", dirpath=DIR)`. `--dir` is that
`dirpath` (one subfolder per run; new runs are picked up as they appear) or one run
folder; a --dir holding no run folder, or not there yet, is an error with --once
(naming the folder meant, when one is near), else a notice and a wait. Run folders whose run.json names another runner
(thread, process) are skipped, and said so once.

Each run is scored with its own settings: what changes the numbers (methods, budgets,
window, block size, max rounds, tasks, dtype: `ScoringConfig.fingerprint_fields`) comes
from its run.json's `scoring`; where and how fast (device, backend, anchors per forward,
vocabulary tile, memory) from the watcher's flags (or --config), since they describe the
machine it runs on. One ScoringService (one target head in memory) per distinct setting,
made when a run first needs it and shared by the runs that have it, each with its own
baseline report. A run that records no settings (an older run) is scored with the flags.
A run is refused, in one log line (once while it lasts) naming the setting and the fix,
and nothing at all is written into its folder, when a number-changing flag given on the
watcher's command line differs from the run's setting (--config, like the defaults, only
stands in for what a run does not record), or when its reports would stand on another basis
than run.json's (another cache or target head, another library version): so of two watchers
on one folder the one meant for the run scores it, and a run that only a refusing watcher
sees gets no heartbeat: it warns that no watcher scores it, as with none at all.

Every poll, for every run folder it scores, the watcher
- writes a heartbeat (RUN/watcher.json), so the run that waits for it knows it is there;
- scores the baseline once into reports/baseline.json (a failure is written there as
  `{"error": ...}`, so the run goes on without one, and retried on the next poll; the
  run takes the report when it appears); without --baseline, writes that error for a
  run whose run.json expects one, so the run does not wait for it;
- scores every snapshot whose report is missing or names another snapshot id into
  reports/step-XXXXXXXX.json (`{"error", "step", "snapshot_id"}` when scoring fails).
Each file is written atomically; each snapshot scored is logged on one line.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from ..files import file_version
from ..scoring.basis import Basis
from ..scoring.config import ScoringConfig
from ..scoring.report import EvalReport
from ..scoring.speed import report_fastest_line
from ..scoring.service import ScoringService, ServiceSpec, preflight, recorded_weights, weights_fingerprint
from ..engine.run_folder import HEARTBEAT_FILE, RunFolder, is_run_folder, write_heartbeat
from ..engine.runners.jobs import describe
from .nearby import runs_hint


def run_folders(root: Path) -> list[RunFolder]:
    """`root` itself when it is a run folder, else every run folder directly under it."""
    if is_run_folder(root):
        return [RunFolder(root)]
    return [RunFolder(p) for p in sorted(root.iterdir()) if p.is_dir() and is_run_folder(p)]


NUMBERS = tuple(ScoringConfig().fingerprint_fields())
"""The scoring settings that change the numbers: a run's own (its run.json), never the watcher's."""


class Watcher:
    def __init__(self, service: ScoringService, root: Path, log=print, given: dict[str, str] | None = None):
        """`service`: the watcher's own (its flags), which scores the runs that record no
        settings and lends every other its machine settings, cache, target and baseline;
        `given`: the number-changing settings its command line set, each with where it was
        set (`{"window": "--window"}`): a run that scores another value is refused."""
        self.service, self.root, self.log, self.given = service, root, log, dict(given or {})
        self._services = {self._key(service.config): service}  # scoring config -> its service
        self._baselines: dict[ScoringService, EvalReport | str] = {}  # a service's baseline report, or its last error
        self._read: dict[Path, tuple[tuple, bool, str | None]] = {}  # report path -> (its stat, read back)
        self._own: dict[Path, tuple] = {}  # baseline report path -> its stat when it held this watcher's weights
        self._weights: dict[str, str | None] = {}  # a baseline (folder or saved report) -> its weights' fingerprint
        self._skipped: set[Path] = set()  # run folders of another runner, logged once
        self._refused: dict[Path, str] = {}  # run folder -> why it is refused, logged once while it lasts
        self._unwritten: dict[Path, dict] = {}  # report path -> the payload whose write failed
        self._failing: dict[Path, str] = {}  # run folder or report path -> its failure, logged once while it lasts
        self.scored, self.failed = 0, 0  # snapshots scored, and failed, by this watcher
        self.last: str | None = None  # the last report it wrote: "RUN step N: live tau ..."

    @staticmethod
    def _key(config: ScoringConfig) -> str:
        return json.dumps(config.to_dict(), sort_keys=True)

    def settings_for(self, run: RunFolder, about: dict) -> ScoringConfig | None:
        """The config `run` is scored with (`run_config`); None (the refusal logged once while it
        lasts) when its settings conflict with the flags given, or its reports would stand on
        another basis than the one its run.json records."""
        try:
            config = self.run_config(about)
        except ValueError as e:
            return self.refuse(run, f"{e}: run the dflash_callbacks version the training run runs")
        try:
            basis = Basis.from_dict(about["basis"])
        except (KeyError, TypeError, ValueError, AttributeError):  # none recorded (an older run), or damaged
            basis = None
        conflicts = self.conflicts(config, basis)
        if conflicts:
            flags = sorted({self.given[name] for name, _ in conflicts})
            return self.refuse(run, f"{'; '.join(text for _, text in conflicts)}; drop {' and '.join(flags)} (a "
                                    "watcher takes each run's scoring settings from its run.json), or leave the run "
                                    "to a watcher without it")
        # the basis its service would have (ScoringService.basis), before a service, and a head, is made for it
        differences = [] if basis is None else basis.differences(Basis.of_run(
            config, self.service.cache, config.block_size or basis.block_size, self.service.head.fingerprint,
            self.service.head.model_window))
        if differences:
            settings = "" if "scoring" in about else ", scoring flags"  # an older run's come from the flags
            return self.refuse(run, f"this watcher would score it with {'; '.join(differences)}: start a watcher with "
                                    f"the run's --cache, --target{settings} and dflash_callbacks version")
        if self._refused.pop(run.path, None) is not None:
            self.log(f"watch: {run.path.name}: no longer refused, scoring it")
        return config

    def service_with(self, config: ScoringConfig, run: RunFolder) -> ScoringService:
        """The service of `config`, made when a run first needs it (each holds a target head)."""
        key = self._key(config)
        if key not in self._services:
            self._services[key] = ScoringService(replace(self.service.spec, scoring=config.to_dict()),
                                                 owns_process=self.service.owns_process)
            shown = ", ".join(f"{name} {value}" for name, value in config.fingerprint_fields().items())
            self.log(f"watch: {run.path.name}: scoring with its run.json's settings ({shown}); "
                     f"{len(self._services)} scoring services")
        return self._services[key]

    def run_config(self, about: dict) -> ScoringConfig:
        """The config a run is scored with: this watcher's, with run.json's number-changing
        settings and its costs when it records them (an older run does not)."""
        recorded = about.get("scoring")
        if recorded is None:
            return self.service.config
        if not isinstance(recorded, dict):
            raise ValueError(f"its run.json's scoring is not an object but {recorded!r}")
        unknown = sorted(set(recorded) - set(ScoringConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"its run.json's scoring has settings this watcher does not know ({', '.join(unknown)})")
        try:
            theirs = ScoringConfig(**recorded)
        except ValueError as e:
            raise ValueError(f"its run.json's scoring is not a ScoringConfig ({e})") from None
        # and the run's costs: its reports' speed-ups are predicted by the run, on its costs (`scoring.speed`)
        return replace(self.service.config, **theirs.fingerprint_fields(), costs=theirs.costs,
                       force_costs=theirs.force_costs)

    def conflicts(self, config: ScoringConfig, basis: Basis | None) -> list[tuple[str, str]]:
        """(setting, "window 2 from --window, but the run scores window None") for each setting
        given on the command line that the run (`config`, scored at basis's block size) scores
        otherwise; the order of a list does not count, and a block size given as the drafter's
        agrees with a run that scores the drafter's (None)."""
        def same(name, ours, theirs):
            if name == "block_size" and theirs is None and basis is not None:
                theirs = basis.block_size
            if isinstance(ours, list) and isinstance(theirs, list):
                return sorted(ours) == sorted(theirs)
            return ours == theirs

        out = []
        for name, source in self.given.items():
            ours, theirs = getattr(self.service.config, name), getattr(config, name)
            if not same(name, ours, theirs):
                out.append((name, f"{name} {ours} from {source}, but the run scores {name} {theirs}"))
        return out

    def refuse(self, run: RunFolder, why: str) -> None:
        message = f"watch: {run.path.name}: refused, nothing is written there: {why}"
        if self._refused.get(run.path) != message:
            self._refused[run.path] = message
            self.log(message)
        return None

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
        ours = self._weights_of(self.service.spec.baseline)
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

    def _weights_of(self, baseline: str) -> str | None:
        """The weights' fingerprint of a baseline: a folder's (weights_fingerprint), a saved report's
        recorded one (None where it can not be read here, or records none)."""
        if baseline not in self._weights:
            try:
                self._weights[baseline] = (recorded_weights(EvalReport.load(baseline)) if Path(baseline).is_file()
                                           else weights_fingerprint(baseline))
            except (OSError, ValueError):
                self._weights[baseline] = None
        return self._weights[baseline]

    def baseline(self, service: ScoringService) -> EvalReport | str | None:
        """The baseline's report with `service`'s settings, scored once; after a failure, tried
        again on each call."""
        found = self._baselines.get(service)
        if service.spec.baseline is None or isinstance(found, EvalReport):
            return found
        try:
            found = self._baselines[service] = service.baseline()
            self.log(f"watch: baseline {service.spec.baseline} scored ({', '.join(service.config.methods)})")
        except Exception as e:
            found = self._baselines[service] = describe(e)
            self.log(f"watch: scoring the baseline failed (retried next poll): {found}")
        return found

    def scan_once(self) -> int:
        """Score every snapshot without its report; returns how many were scored. A run folder
        that can not be read or written (a full disk, a folder where a file goes, a run removed
        meanwhile) is logged and tried again on the next poll; the other runs go on."""
        if not self.root.is_dir():  # not created yet by the training run: nothing to score
            return 0
        done = 0
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
        config = self.settings_for(run, about)
        if config is None:  # refused: not even a heartbeat, so a run no other watcher scores says it has none
            return 0
        self.beat(run)
        baseline, expected = self.reported(run, run.report_path(None)), about.get("baseline")
        if self.service.spec.baseline is not None and (baseline is None or not baseline[0]):
            baseline = self.baseline(self.service_with(config, run))
            self.write(run, None, baseline.to_dict() if isinstance(baseline, EvalReport) else {"error": baseline})
        elif self.service.spec.baseline is not None and self.replaces_baseline(run, expected):
            baseline = self.baseline(self.service_with(config, run))  # another watcher's (the run may refuse it)
            if isinstance(baseline, EvalReport) and self.write(run, None, baseline.to_dict()):
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
                self.log(f"watch: {run.path.name} step {step}: scoring {folder}")
                try:
                    report = self.service_with(config, run).score_folder(folder)
                    payload = report.to_dict()
                    summary = ", ".join(f"{m} {v['live']:.2f}" for m, v in payload["mean"].items())
                    self.log(f"watch: {run.path.name} step {step}: live tau {summary} ({time.monotonic() - started:.1f} s)")
                    fastest = report_fastest_line(report)  # with the run's scoring.costs
                    if fastest is not None:
                        self.log(f"watch: {run.path.name} step {step}: {fastest}")
                    self.scored, self.last = self.scored + 1, f"{run.path.name} step {step}: live tau {summary}"
                except FileNotFoundError:
                    continue  # pruned by the training run before we got to it
                except Exception as e:
                    payload = {"error": describe(e), "step": step, "snapshot_id": snapshot_id}
                    self.log(f"watch: {run.path.name} step {step} failed: {payload['error']}")
                    self.failed += 1
                self.beat(run)  # a report may take minutes: the run hears from its watcher after each
            done += self.write(run, step, payload)
        return done

    def summary(self) -> str:
        """What it did, said at exit: snapshots scored and failed, and the last report."""
        last = f"; the last report: {self.last}" if self.last else ""
        return f"watch: exiting: {self.scored} snapshot(s) scored, {self.failed} failed{last}"

    def beat(self, run: RunFolder) -> None:
        """The heartbeat in a run folder this watcher scores (a failure is logged once while it lasts)."""
        try:
            write_heartbeat(run.path)
            self._failing.pop(run.path / HEARTBEAT_FILE, None)
        except OSError as e:
            self.failing(run.path / HEARTBEAT_FILE, f"watch: {run.path.name}: writing the heartbeat failed "
                                                    f"(retried next poll): {e}")

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


def open_watcher(args: argparse.Namespace, config: ScoringConfig, given: dict[str, str], log=print) -> Watcher:
    """The watcher `watch --dir` runs: its own ScoringService from the flags (`config`), checked before any
    work (preflight), and the number-changing settings its flags give (`given`: setting -> flag)."""
    spec = ServiceSpec(str(args.cache), str(args.target), None if args.baseline is None else str(args.baseline),
                       config, None if args.baseline_cache_dir is None else str(args.baseline_cache_dir))
    preflight(spec, None)
    return Watcher(ScoringService(spec, owns_process=True), args.dir, log, given)


def run_watch(args: argparse.Namespace, config: ScoringConfig, given: dict[str, str]) -> int:
    """`watch --dir` with its flags (`cli.watch`: checked there, a --dir holding no run with --once included),
    scoring config and number-changing flags given."""
    no_runs = not args.dir.is_dir() or not run_folders(args.dir)
    watcher = open_watcher(args, config, given, log=lambda line: print(line, flush=True))
    every = "once" if args.once else f"every {args.poll_seconds:g} s; Ctrl-C stops"
    print(f"watch: scoring the snapshots of the runs in {args.dir} ({every})", flush=True)
    if not args.dir.is_dir():  # a watcher started before the training run that makes it
        print(f"watch: {args.dir} does not exist yet, waiting for a training run to create it (the callback's "
              "dirpath; if none will, check the path)", flush=True)
    elif no_runs:
        print(f"watch: {args.dir} holds no run folder yet, waiting for one{runs_hint(args.dir)}", flush=True)
    last_work = time.time()
    try:
        while True:
            if watcher.scan_once():
                last_work = time.time()
            if args.once or (args.idle_exit is not None and time.time() - last_work > args.idle_exit):
                return 0
            time.sleep(args.poll_seconds)
    finally:  # also on Ctrl-C
        print(watcher.summary(), flush=True)
