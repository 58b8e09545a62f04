"""`dflash-callbacks watch`: one command, two watchers, exactly one of
- `--dir DIR`: the run folders of `DrafterEvalCallback(runner="external")` (`watch/runs.py`);
- `--checkpoints DIR`: the checkpoints any trainer saves, with no change to it (`watch/checkpoint_watcher.py`,
  a `CheckpointWatcher` built from the `WatchSettings` its flags fill).
Both take the cache, target, baseline, polling and scoring flags; `--checkpoints` takes its own, and
the stop's (`StopSettings`' fields, as TrailingBaselineStop takes them), which `--dir` refuses.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

from ..scoring.config import ScoringConfig
from ..settings import StopSettings, add_arguments, given_arguments
from .usage import UsageError
from ..scoring.methods import unscored_monitor
from ..watch.nearby import RUN_FILE, runs_hint
from ..watch.watch_settings import DEFAULTS, WatchSettings
from .score import BASELINE_CACHE_HELP, add_scoring_arguments, path_problems, scoring_config, scoring_flag

CHECKPOINT_FLAGS: dict[str, Any] = DEFAULTS  # dest -> default: the flags only `watch --checkpoints` takes
STOP_FLAGS = ("verbose", "confidence")  # the StopSettings fields that are no flag: a watcher prints every line


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=None,
                   help="the callback's dirpath (one subfolder per run) or one run folder; waited for if it does not "
                        "exist yet (with --once it must exist)")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="the folder a trainer saves its checkpoints into: score each new one (no change to the trainer)")
    p.add_argument("--cache", required=True, type=Path, help="hidden-state cache folder")
    p.add_argument("--target", required=True, type=Path, help="target folder (only embed_tokens and lm_head are read)")
    p.add_argument("--baseline", type=Path, default=None, help="the baseline drafter folder or saved report JSON")
    p.add_argument("--baseline-cache-dir", type=Path, default=None, help=BASELINE_CACHE_HELP)
    p.add_argument("--poll-seconds", type=float, default=5.0, help="seconds between scans (>= 0)")
    p.add_argument("--idle-exit", type=float, default=None, help="exit after this many seconds without new work")
    p.add_argument("--once", action="store_true", help="score what is there now and exit")
    add_scoring_arguments(p)
    d = CHECKPOINT_FLAGS
    g = p.add_argument_group("watch --checkpoints DIR", argument_default=argparse.SUPPRESS)
    g.add_argument("--out", type=Path, help="the run folder of the reports (results.jsonl, run.json, STOP.json); "
                                            "default DIR/dflash-eval")
    g.add_argument("--state-key", help="read torch checkpoint files, the drafter's state dict under this key "
                                       "(SpecForge: draft_state_dict); default: HF-format drafter folders")
    g.add_argument("--state-file", help=f"with --state-key: the file read in a checkpoint folder (default "
                                        f"{d['state_file']})")
    g.add_argument("--drafter-config", type=Path, help="with --state-key: the drafter's config.json (or its folder)")
    g.add_argument("--step-pattern", help="a regular expression whose first group (or match) is the step in a "
                                          "checkpoint's name (default: the name's last integer)")
    g.add_argument("--settle-seconds", type=float, help="a checkpoint without the trainer's completion marker is "
                                                        "complete once its files are unchanged this long (default "
                                                        f"{d['settle_seconds']:g})")
    g.add_argument("--wandb-project", help="log the reports to this W&B project (default: no W&B)")
    g.add_argument("--wandb-name", help="the W&B run's name")
    g.add_argument("--wandb-group", help="the W&B group, e.g. the training run's, to see both together")
    g.add_argument("--tensorboard", type=Path, metavar="DIR", help="write the reports to this TensorBoard folder as well (extra: "
                   "dflash-callbacks[tensorboard])")
    g.add_argument("--mlflow-uri", metavar="URI", help="log the reports to this MLflow tracking server or store (http://host:port, "
                   "sqlite:///path; extra: dflash-callbacks[mlflow]), in a run made in --mlflow-experiment or the run "
                   "--mlflow-run-id")
    g.add_argument("--mlflow-experiment", metavar="NAME", help="with --mlflow-uri: the experiment a run is made in, named for the run "
                   "folder")
    g.add_argument("--mlflow-run-id", metavar="ID", help="with --mlflow-uri: the run the reports go to (e.g. the training's own)")
    g.add_argument("--max-steps", type=int, help="the training's last step: the projection's horizon; a report there "
                                                 "only warns (training ends anyway)")
    stop = p.add_argument_group("watch --checkpoints DIR --baseline B: the stop (TrailingBaselineStop's settings; "
                                "its decision goes to OUT/STOP.json)")
    add_arguments(stop, StopSettings, exclude=STOP_FLAGS)
    p.epilog = (f"watch --dir scores each run with the settings that change its numbers "
                f"({', '.join(scoring_flag(n) for n in ScoringConfig().fingerprint_fields())}) as its run.json records "
                "them; the other scoring flags say how this machine computes them. A run that records none (an older "
                "run) is scored with the flags and --config. A run that scores otherwise than a number-changing flag "
                "given here, or on another cache or target head, is refused in one line, and nothing is written into "
                "its folder.")


def run_watch(args: argparse.Namespace) -> int:
    """Every flag checked, all at once, before torch loads; then the watcher `--dir` or `--checkpoints` asks for."""
    if (args.dir is None) == (args.checkpoints is None):
        raise UsageError("give exactly one of --dir (the run folders of DrafterEvalCallback(runner='external')) or "
                         "--checkpoints (the folder a trainer saves its checkpoints into)")
    problems = path_problems(args)
    try:
        scoring = scoring_config(args)
    except ValueError as e:
        scoring, problems = None, problems + str(e).splitlines()
    if args.checkpoints is not None:
        try:
            settings = checkpoint_settings(args, scoring)
        except UsageError as e:
            problems += str(e).splitlines()
        if problems:
            raise UsageError("\n".join(problems))
        from ..watch.checkpoint_watcher import run_watch_checkpoints

        return run_watch_checkpoints(settings)
    misplaced = [flag(dest) for dest in [*CHECKPOINT_FLAGS, *given_arguments(args, StopSettings)] if hasattr(args, dest)]
    if misplaced:
        problems.append(f"{', '.join(misplaced)} go with --checkpoints, not --dir")
    if not all(math.isfinite(x) and x >= 0 for x in (args.poll_seconds, args.idle_exit) if x is not None):
        problems.append(f"--poll-seconds and --idle-exit must be finite numbers >= 0; got {args.poll_seconds:g} "
                        f"and {'none' if args.idle_exit is None else format(args.idle_exit, 'g')}")
    if args.dir.exists() and not args.dir.is_dir() or args.once and not args.dir.is_dir():
        problems.append(f"--dir {args.dir} is not a folder: give the callback's dirpath (or a run folder in it)")
    elif args.once and not holds_runs(args.dir):
        problems.append(f"--dir {args.dir} holds no run folder{runs_hint(args.dir)}")
    if problems:
        raise UsageError("\n".join(problems))
    from ..watch.runs import run_watch as watch_runs

    return watch_runs(args, scoring, given_settings(args))


def holds_runs(folder: Path) -> bool:
    """Whether `folder` is a run folder or holds one (as `watch.runs.run_folders` finds them)."""
    return (folder / RUN_FILE).is_file() or any((p / RUN_FILE).is_file() for p in folder.iterdir() if p.is_dir())


def given_settings(args: argparse.Namespace) -> dict[str, str]:
    """The number-changing scoring settings given as flags -> the flag (`{"window": "--window"}`). A key of
    --config is not one: like a default, it only stands in for what a run does not record."""
    numbers = ScoringConfig().fingerprint_fields()
    return {name: scoring_flag(name) for name in given_arguments(args, ScoringConfig) if name in numbers}


def checkpoint_settings(args: argparse.Namespace, scoring: ScoringConfig | None = None) -> WatchSettings:
    """The flags of `watch --checkpoints` as the watcher's `WatchSettings`, defaults filled in and checked, with
    the stop's settings (`stop`: a StopSettings, or None without --baseline; its monitor one of the methods
    `scoring` scores); UsageError listing every problem."""
    from ..model.config import DrafterConfig

    given = {dest for dest in CHECKPOINT_FLAGS if hasattr(args, dest)}
    s = {**CHECKPOINT_FLAGS, **{dest: getattr(args, dest) for dest in given}}
    root = args.checkpoints
    problems = []
    if not root.is_dir():
        problems.append(f"--checkpoints {root} is not a folder" + (" (it does not exist)" if not root.exists() else "")
                        + ": give the folder your trainer saves its checkpoints into")
    seconds = (args.poll_seconds, args.idle_exit, s["settle_seconds"])
    if not all(x is None or (math.isfinite(x) and x >= 0) for x in seconds):
        problems.append("--poll-seconds, --idle-exit and --settle-seconds must be finite numbers >= 0")
    if s["state_key"] is None and given & {"state_file", "drafter_config"}:
        problems.append("--state-file and --drafter-config go with --state-key (torch checkpoint files); an HF-format "
                        "drafter folder holds its own config.json")
    s["config"] = None
    if s["state_key"] is not None:
        if s["drafter_config"] is None:
            problems.append("--state-key reads torch checkpoint files, which hold no config: give the drafter's "
                            "config.json with --drafter-config")
        else:
            try:
                s["config"] = DrafterConfig.from_file(s["drafter_config"])
            except (OSError, ValueError) as e:
                problems.append(f"--drafter-config: {e}")
    if s["step_pattern"] is not None:
        try:
            s["step_pattern"] = re.compile(s["step_pattern"])
        except re.error as e:
            problems.append(f"--step-pattern {s['step_pattern']!r} is not a regular expression ({e}); e.g. "
                            r"'step_(\d+)'")
    stop = given_arguments(args, StopSettings)
    stop_flags = sorted(flag(k) for k in {*stop, *({"max_steps"} & given)})
    if stop_flags and args.baseline is None:
        problems.append(f"{', '.join(stop_flags)} set the stop, which compares with the baseline: give --baseline")
    s["stop"] = None
    if args.baseline is not None:
        try:
            s["stop"] = StopSettings(**stop)
        except ValueError as e:
            problems += [line.replace("`", "") for line in str(e).splitlines()]
    if s["stop"] is not None and scoring is not None:
        from ..settings import split_monitor

        speedup, monitor = split_monitor(s["stop"].monitor)
        unscored = unscored_monitor(monitor, scoring.methods, "--monitor", "scoring")
        problems += [unscored] if unscored else []
        if speedup and scoring.costs is None:
            problems.append(f"--monitor {s['stop'].monitor} judges the predicted speed-up, which needs --costs PATH "
                            f"(`dflash-callbacks profile --out PATH`); or monitor tau: --monitor {monitor}")
    if s["max_steps"] is not None and s["max_steps"] < 1:
        problems.append(f"--max-steps must be an integer >= 1; got {s['max_steps']}")
    if s["wandb_project"] is None and given & {"wandb_name", "wandb_group"}:
        problems.append("--wandb-name and --wandb-group name a run of --wandb-project: give the project")
    from ..engine.trackers.flags import tracker_flag_problems

    problems += tracker_flag_problems(None if s["tensorboard"] is None else str(s["tensorboard"]), s["mlflow_uri"],
                                      s["mlflow_experiment"], s["mlflow_run_id"])
    s["out"] = s["out"] if s["out"] is not None else root / "dflash-eval"
    if s["out"].exists() and not s["out"].is_dir():
        problems.append(f"--out {s['out']} is a file: give the folder the reports go to")
    if problems:
        raise UsageError("\n".join(problems))
    return WatchSettings(checkpoints=root, cache=args.cache, target=args.target, baseline=args.baseline,
                         baseline_cache_dir=args.baseline_cache_dir,
                         scoring=scoring if scoring is not None else ScoringConfig(), poll_seconds=args.poll_seconds,
                         idle_exit=args.idle_exit, once=args.once, **s)
