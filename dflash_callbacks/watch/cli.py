"""`dflash-callbacks watch`: one command, two watchers, exactly one of
- `--dir DIR`: the run folders of `DrafterEvalCallback(runner="external")` (`watch/runs.py`);
- `--checkpoints DIR`: the checkpoints any trainer saves, with no change to it (`watch/checkpoints.py`).
The flags both take (the cache, target, baseline, polling and scoring flags) are defined once, by
`watch/runs.py`; `watch/checkpoints.py` adds its own, which `--dir` refuses.
"""

from __future__ import annotations

import argparse

from . import checkpoints, runs


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    runs.add_watch_arguments(p)
    checkpoints.add_checkpoint_arguments(p)


def run_watch(args: argparse.Namespace) -> int:
    from ..scoring.cli import UsageError

    if (args.dir is None) == (args.checkpoints is None):
        raise UsageError("give exactly one of --dir (the run folders of DrafterEvalCallback(runner='external')) or "
                         "--checkpoints (the folder a trainer saves its checkpoints into)")
    if args.checkpoints is not None:
        return checkpoints.run_watch_checkpoints(args)
    misplaced = [checkpoints.flag(dest) for dest in checkpoints.DEFAULTS if hasattr(args, dest)]
    if misplaced:
        raise UsageError(f"{', '.join(misplaced)} go with --checkpoints, not --dir")
    return runs.run_watch(args)
