"""`dflash-callbacks watch`: score the snapshots a training run writes, from elsewhere.

Pair it with `DrafterEvalCallback(runner="external", dirpath=RUN_DIR)`. The watcher
scores the baseline once into `RUN_DIR/reports/baseline.json`, then every snapshot
`RUN_DIR/snapshots/step-XXXXXXXX/` that has no report yet into
`RUN_DIR/reports/step-XXXXXXXX.json` (an `{"error": ...}` object when scoring fails),
each written atomically. The training process picks the reports up and logs them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..files import atomic_write_json
from ..scoring.cli import add_scoring_arguments, scoring_config
from .evaluator import Evaluator, EvaluatorSpec
from .runners import BASELINE, describe, report_file
from .snapshot import list_snapshots


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, payload)


def scan_once(evaluator: Evaluator, run_dir: Path) -> int:
    """Score every snapshot without a report; returns how many were scored."""
    reports = run_dir / "reports"
    if evaluator.spec.baseline is not None and not report_file(reports, BASELINE).exists():
        try:
            write_json(report_file(reports, BASELINE), evaluator.baseline().to_dict())
        except Exception as e:
            write_json(report_file(reports, BASELINE), {"error": describe(e)})
    done = 0
    for step, folder in list_snapshots(run_dir / "snapshots"):
        target = report_file(reports, step)
        if target.exists():
            continue
        try:
            payload = evaluator.score_folder(folder, step).to_dict()
        except FileNotFoundError:
            continue  # pruned by the training run before we got to it
        except Exception as e:
            payload = {"error": describe(e)}
        write_json(target, payload)
        done += 1
    return done


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, type=Path, help="the run's dflash folder (DrafterEvalCallback dirpath)")
    p.add_argument("--cache", required=True, type=Path)
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--baseline", type=Path, default=None)
    p.add_argument("--baseline-cache-dir", type=Path, default=None)
    p.add_argument("--poll-seconds", type=float, default=5.0)
    p.add_argument("--idle-exit", type=float, default=None, help="exit after this many seconds without a new snapshot")
    p.add_argument("--once", action="store_true", help="score what is there now and exit")
    add_scoring_arguments(p)


def run_watch(args: argparse.Namespace) -> int:
    spec = EvaluatorSpec(
        cache=str(args.cache), target=str(args.target),
        baseline=None if args.baseline is None else str(args.baseline),
        scoring=scoring_config(args).to_dict(),
        baseline_cache_dir=None if args.baseline_cache_dir is None else str(args.baseline_cache_dir),
    )
    evaluator = Evaluator(spec)
    last_work = time.time()
    while True:
        if scan_once(evaluator, args.dir):
            last_work = time.time()
        if args.once or (args.idle_exit is not None and time.time() - last_work > args.idle_exit):
            return 0
        time.sleep(args.poll_seconds)
