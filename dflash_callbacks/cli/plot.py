"""`dflash-callbacks plot RUN [--out PNG]`: the demo's picture for any run folder: live tau of ours per
report with its 95% interval, against the baseline's level and interval, one panel per method; with
the stop's settings (or a watcher's STOP.json), the monitored panel carries its threshold, grace
period and projection, and the step the stop would have stopped at (its decisions replayed on the
reports, as it took them while training).

The reports are the run's results.jsonl; the baseline's report is --baseline (a saved report JSON, or a
drafter folder) or the baseline drafter run.json names, read from the baseline cache where training
left it (scored with the run's cache, target head and scoring settings)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..settings import StopSettings, add_arguments, given_arguments
from .score import BASELINE_CACHE_HELP
from .usage import UsageError

STOP_FLAGS = ("verbose", "action")  # StopSettings fields that draw nothing


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="RUN", type=Path, help="a run folder (results.jsonl, run.json), or a folder of runs (the newest "
                                          "is drawn)")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default RUN/live_tau.png)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="the baseline's saved report JSON, or its drafter folder (default: the one run.json names)")
    p.add_argument("--baseline-cache-dir", type=Path, default=None, help=BASELINE_CACHE_HELP)
    p.add_argument("--max-steps", type=int, default=None,
                   help="the training's last step: the stop's projection horizon, and how far it is drawn")
    stop = p.add_argument_group("the stop drawn on its monitored panel (TrailingBaselineStop's settings; none given: "
                                "no stop, unless the run folder holds a watcher's STOP.json, whose monitor is drawn)")
    add_arguments(stop, StopSettings, exclude=STOP_FLAGS)


def run_folder(path: Path) -> Path:
    """`path` itself when it is a run folder, else the newest run folder in it (run ids sort by time)."""
    if (path / "results.jsonl").is_file() or (path / "run.json").is_file():
        return path
    runs = sorted(p for p in path.iterdir() if (p / "run.json").is_file()) if path.is_dir() else []
    if not runs:
        raise UsageError(f"{path} is not a run folder and holds none: give a folder with results.jsonl and run.json "
                         "(<dirpath>/<run id>/)")
    if len(runs) > 1:
        print(f"plot: {len(runs)} runs in {path}; drawing the newest, {runs[-1].name}", flush=True)
    return runs[-1]


def run_plot(args: argparse.Namespace) -> int:
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError(f"--max-steps must be an integer >= 1; got {args.max_steps}")
    if args.baseline is not None and not args.baseline.exists():
        raise UsageError(f"--baseline {args.baseline} does not exist: give a saved report JSON or a drafter folder")
    folder = run_folder(args.folder)
    stop_flags = given_arguments(args, StopSettings)
    stop_file = folder / "STOP.json"
    if not stop_flags and stop_file.is_file():
        stop_flags = {"monitor": json.loads(stop_file.read_text()).get("monitor", StopSettings().monitor)}
    settings = StopSettings(**stop_flags) if stop_flags else None  # refused here, one line per problem
    out = args.out or folder / "live_tau.png"
    if out.is_dir() or not out.parent.is_dir():
        raise UsageError(f"--out {out}: give the path of a PNG in a folder that exists")

    from ..engine.run_folder import RunFolder
    from ..engine.stop import StopPolicy
    from ..plot import plot_live_tau, replay_stop

    run = RunFolder(folder)
    reports = sorted(run.read_results().reports, key=lambda r: r.step)
    if not reports:
        raise UsageError(f"{run.results_path} holds no report yet: nothing to draw")
    baseline, said = baseline_report(run, reports[-1], args.baseline, args.baseline_cache_dir)
    if said:
        print(f"plot: {said}", flush=True)
    stop = None if settings is None else StopPolicy(settings)
    if stop is not None and stop.monitor.split("/")[0] not in reports[-1].methods:
        raise UsageError(f"--monitor {stop.monitor}: the run scores only {reports[-1].methods}")
    stop_step, reason = (None, None) if stop is None or baseline is None else \
        replay_stop(reports, baseline, stop, args.max_steps)
    title = f"run {folder.name}: live tau of ours against the baseline ({len(reports)} reports)"
    why = f"stopped at step {stop_step}: {reason}" if stop_step is not None else None
    plot_live_tau(reports, baseline, out, title=title, stop=stop, stop_step=stop_step, stop_reason=why,
                  horizon=args.max_steps)
    print(f"plot: {len(reports)} reports of {folder}" + (f", the stop at step {stop_step}" if stop_step else "")
          + f": {out}", flush=True)
    return 0


def baseline_report(run, last, given: Path | None, cache_dir: Path | None):
    """(the baseline's report or None, a line saying why there is none): from `given` (a report JSON, or a
    drafter folder) or run.json's baseline folder, whose report is read from the baseline cache. A report of
    another cache, target head, block size or tasks than the run's is refused."""
    from ..scoring.basis import Basis
    from ..scoring.config import ScoringConfig
    from ..scoring.report import EvalReport
    from ..scoring.service import cached_baseline

    about = run.about()
    source = given if given is not None else Path(about["baseline"]) if about.get("baseline") else None
    if source is None:
        return None, "run.json names no baseline drafter: drawn without the baseline (give --baseline REPORT.json)"
    if source.is_file():
        report = EvalReport.load(source)
    elif not (source / "config.json").is_file():
        return None, f"the baseline {source} is gone: drawn without it (give --baseline REPORT.json)"
    else:
        basis = Basis.from_dict(about["basis"])
        scoring = ScoringConfig.from_dict(about["scoring"])
        _, cached = cached_baseline(source, basis.cache, basis.target, scoring, cache_dir)
        if not cached.is_file():
            return None, (f"no report of the baseline {source} in the baseline cache ({cached.parent}): drawn without "
                          "it (give --baseline REPORT.json, or --baseline-cache-dir: the run's baseline_cache_dir)")
        report = EvalReport.load(cached)
    problems = Basis.of_report(last).mismatches(report, f"the baseline {source}")
    if problems:
        raise UsageError("; ".join(problems))
    return report, None
