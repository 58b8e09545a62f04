"""`dflash-callbacks plot RUN [--out PNG]`: the demo's picture for any run folder: live tau of ours per
report with its 95% interval, against the baseline's level and interval, one panel per method; with
the run's stop (run.json records its settings), the stop's flags, or a watcher's STOP.json, the
monitored panel carries its threshold, grace period and projection, and the step the stop would have
stopped at (its decisions replayed on the reports, as it took them while training), drawn out to the
run's last step (run.json's, or --max-steps).

The reports are the run's results.jsonl; the baseline's report is --baseline (a saved report JSON, or a
drafter folder) or the baseline drafter run.json names, read from the baseline cache where training
left it (run.json records where; scored with the run's cache, target head and scoring settings: those
of run.json, or of the last report for a folder without one).

Every argument is checked before torch loads (only a baseline drafter folder's report needs it), every
problem one line."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from ..settings import StopSettings, add_arguments, given_arguments
from .score import BASELINE_CACHE_HELP
from .usage import UsageError

STOP_FLAGS = ("verbose", "action")  # StopSettings fields that draw nothing
RESULTS_FILE, RUN_FILE, STOP_FILE = "results.jsonl", "run.json", "STOP.json"


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="RUN", type=Path, help="a run folder (results.jsonl, run.json), or a folder of runs (the newest "
                                          "is drawn)")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default RUN/live_tau.png)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="the baseline's saved report JSON, or its drafter folder (default: the one run.json names)")
    p.add_argument("--baseline-cache-dir", type=Path, default=None,
                   help=f"{BASELINE_CACHE_HELP}; a run's run.json records its own, the default here")
    p.add_argument("--max-steps", type=int, default=None,
                   help="the training's last step: the stop's projection horizon, and how far it is drawn (default: "
                        "the run's, as run.json records it)")
    stop = p.add_argument_group("the stop drawn on its monitored panel (TrailingBaselineStop's settings; default: the "
                                "run's own stop, as run.json records it, a flag given here replacing its setting; "
                                "else a watcher's STOP.json's monitor; else no stop)")
    add_arguments(stop, StopSettings, exclude=STOP_FLAGS)


def run_folder(path: Path) -> Path:
    """`path` itself when it is a run folder, else the newest run folder in it (run ids sort by time)."""
    from ..watch.nearby import runs_hint

    if (path / RESULTS_FILE).is_file() or (path / RUN_FILE).is_file():
        return path
    runs = sorted(p for p in path.iterdir() if (p / RUN_FILE).is_file()) if path.is_dir() else []
    if not runs:
        raise UsageError(f"{path} is not a run folder and holds none" + (runs_hint(path, "") if path.is_dir() else
                                                                           ": it does not exist"))
    if len(runs) > 1:
        print(f"plot: {len(runs)} runs in {path}; drawing the newest, {runs[-1].name}", flush=True)
    return runs[-1]


def read_about(folder: Path) -> dict:
    """run.json ({} when there is none, or it does not read: a folder copied back without it)."""
    try:
        about = json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return about if isinstance(about, dict) else {}


def stop_settings(args: argparse.Namespace, about: dict, folder: Path) -> StopSettings | None:
    """The stop to replay: the run's own (the one of run.json's `stops` following --monitor, or the first), each
    flag given replacing its setting (--min-ratio and --min-delta replace both); a watcher's STOP.json names
    the monitor of a run that records none. None: no stop. ValueError listing each bad setting."""
    flags = given_arguments(args, StopSettings)
    fields = set(StopSettings.__dataclass_fields__)
    recorded = [s for s in about.get("stops") or [] if isinstance(s, dict)]
    if "monitor" in flags:
        monitor = str(StopSettings(monitor=flags["monitor"]).monitor)
        recorded = [s for s in recorded if s.get("monitor") == monitor]
    own = {k: v for k, v in (recorded[0] if recorded else {}).items() if k in fields}
    if not own and not flags and (folder / STOP_FILE).is_file():
        own = {"monitor": json.loads((folder / STOP_FILE).read_text()).get("monitor", StopSettings().monitor)}
    if {"min_ratio", "min_delta"} & set(flags):
        own = {k: v for k, v in own.items() if k not in ("min_ratio", "min_delta")}
    settings = {**own, **flags}
    return StopSettings(**settings) if settings else None


def run_plot(args: argparse.Namespace) -> int:
    from ..scoring.methods import unscored_monitor
    from ..settings import split_monitor
    from ..scoring.report import read_results

    problems = []
    if args.max_steps is not None and args.max_steps < 1:
        problems.append(f"--max-steps must be an integer >= 1; got {args.max_steps}")
    if args.baseline is not None and not args.baseline.exists():
        problems.append(f"--baseline {args.baseline} does not exist: give a saved report JSON or a drafter folder")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        problems.append(f"--out {args.out}: give the path of a PNG in a folder that exists")
    try:
        folder = run_folder(args.folder)
    except UsageError as e:
        raise UsageError("\n".join([*problems, str(e)])) from None
    about = read_about(folder)
    reports = sorted(read_results(folder / RESULTS_FILE).reports, key=lambda r: r.step)
    if not reports:
        problems.append(f"{folder / RESULTS_FILE} holds no report yet: nothing to draw")
    settings = None
    try:
        settings = stop_settings(args, about, folder)
    except ValueError as e:
        problems += [line.replace("`", "") for line in str(e).splitlines()]
    if settings is not None and reports:
        unscored = unscored_monitor(split_monitor(settings.monitor)[1], reports[-1].methods, "--monitor", None)
        problems += [unscored] if unscored else []
    if problems:
        raise UsageError("\n".join(problems))
    out = args.out or folder / "live_tau.png"
    horizon = args.max_steps if args.max_steps is not None else about.get("max_steps")

    from ..engine.stop import StopPolicy
    from ..engine.live_tau_plot import plot_live_tau, replay_stop

    baseline, said = baseline_report(about, reports[-1], args.baseline, args.baseline_cache_dir)
    if said:
        print(f"warning: plot: {said}", file=sys.stderr, flush=True)
    with warnings.catch_warnings():  # the run said its stop's setup warnings when it trained: a replay does not
        warnings.simplefilter("ignore")
        stop = None if settings is None else StopPolicy(settings)
    stop_step, reason = (None, None) if stop is None or baseline is None else \
        replay_stop(reports, baseline, stop, horizon)
    title = f"run {folder.name}: live tau of ours against the baseline ({len(reports)} reports)"
    why = f"stopped at step {stop_step}: {reason}" if stop_step is not None else None
    plot_live_tau(reports, baseline, out, title=title, stop=stop, stop_step=stop_step, stop_reason=why,
                  horizon=horizon)
    print(f"plot: {len(reports)} reports of {folder}" + (f", the stop at step {stop_step}" if stop_step else "")
          + f": {out}", flush=True)
    return 0


def baseline_report(about: dict, last, given: Path | None, cache_dir: Path | None):
    """(the baseline's report or None, a line saying why there is none): from `given` (a report JSON, or a
    drafter folder) or run.json's baseline folder, whose report is read from the baseline cache (`cache_dir`,
    else run.json's, else the default), keyed by run.json's basis and scoring (a folder without run.json:
    the last report's). A report of another cache, target head, block size or tasks than the run's is
    refused."""
    from ..scoring.basis import Basis
    from ..scoring.config import ScoringConfig
    from ..scoring.report import EvalReport

    source = given if given is not None else Path(about["baseline"]) if about.get("baseline") else None
    if source is None:
        return None, "run.json names no baseline drafter: drawn without the baseline (give --baseline REPORT.json)"
    if source.is_file():
        report = EvalReport.load(source)
    elif not (source / "config.json").is_file():
        return None, f"the baseline {source} is gone: drawn without it (give --baseline REPORT.json)"
    else:
        from ..scoring.service import cached_baseline

        basis = Basis.from_dict(about["basis"]) if isinstance(about.get("basis"), dict) else Basis.of_report(last)
        try:
            scoring = ScoringConfig.from_dict(about.get("scoring") or last.scoring)
        except (TypeError, ValueError) as e:
            raise UsageError(f"the run's scoring settings do not read ({e}): give --baseline REPORT.json") from None
        cache_dir = cache_dir or (Path(about["baseline_cache_dir"]) if about.get("baseline_cache_dir") else None)
        _, cached = cached_baseline(source, basis.cache, basis.target, scoring, cache_dir)
        if not cached.is_file():
            return None, (f"no report of the baseline {source} in the baseline cache ({cached.parent}): drawn without "
                          "it (give --baseline REPORT.json, or --baseline-cache-dir: the run's baseline_cache_dir)")
        report = EvalReport.load(cached)
    problems = Basis.of_report(last).mismatches(report, f"the baseline {source}")
    if problems:
        raise UsageError("; ".join(problems))
    return report, None
