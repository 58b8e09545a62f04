"""`dflash-callbacks extract | score | compare | watch | demo`."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, function adding its arguments, function running it, help)
COMMANDS = {
    "demo": ("dflash_callbacks.demos.demo", "add_demo_arguments", "run_demo_cli",
             "train a toy drafter on the CPU with both callbacks attached (the main job)"),
    "extract": ("dflash_callbacks.cache.extract", "add_extract_arguments", "run_extract",
                "cache a target's greedy completions and hidden states for a task set"),
    "score": ("dflash_callbacks.scoring.cli", "add_score_arguments", "run_score",
              "score a drafter folder (and a baseline) on a cache; print the per-task table"),
    "compare": ("dflash_callbacks.scoring.cli", "add_compare_arguments", "run_compare",
                "compare two saved reports"),
    "watch": ("dflash_callbacks.callbacks.watch", "add_watch_arguments", "run_watch",
              "score the snapshots a training run writes (DrafterEvalCallback(runner='external'))"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-callbacks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), add_arguments)(p)
        p.set_defaults(run=(module, run))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, run = args.run
    return int(getattr(importlib.import_module(module), run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
