"""`dflash-callbacks extract | score | compare | watch | plot | profile | demo`.

An ordinary mistake (a wrong path, a folder of the wrong kind, a setting that can not
work here) prints one `error: ...` line per problem and exits with status 2; `--debug`
(or DFLASH_DEBUG=1) shows the traceback instead. Anything else is a bug: one line, exit
status 1, and `--debug` shows where.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from ..checks import did_you_mean
from . import demo, extract, plot, profile, score, watch
from .usage import USER_ERRORS, UsageError  # noqa: F401  (the CLI's error, importable from here)

COMMANDS = {  # command -> (the function adding its arguments, the function running it, its help)
    "demo": (demo.add_demo_arguments, demo.run_demo,
             "train a toy drafter on the CPU with both callbacks attached (the main job)"),
    "extract": (extract.add_extract_arguments, extract.run_extract,
                "cache a target's completions (greedy, or sampled as served) and hidden states for a task set"),
    "score": (score.add_score_arguments, score.run_score,
              "score a drafter folder (and a baseline) on a cache; print the per-task table"),
    "compare": (score.add_compare_arguments, score.run_compare,
                "compare a report (or a step of results.jsonl) with the baseline's report"),
    "watch": (watch.add_watch_arguments, watch.run_watch,
              "score the snapshots training runs write (--dir: DrafterEvalCallback(runner='external')) or the "
              "checkpoints a trainer saves (--checkpoints)"),
    "plot": (plot.add_plot_arguments, plot.run_plot,
             "draw a run folder's live tau per report against the baseline, with intervals and the stop (a PNG)"),
    "profile": (profile.add_profile_arguments, profile.run_profile,
                "time the target's verify forward, the drafter's round and a round's bookkeeping on a device: the "
                "costs JSON score --costs predicts speed-ups from"),
}
"""Each command's module imports what it runs when it runs it: a help, or a refused argument, answers
before torch loads."""


class Parser(argparse.ArgumentParser):
    """argparse, with an unknown option named first, and the option meant when one is close:
    `score --cahce X` says that --cahce is unknown (did you mean --cache?), where argparse
    says only that --cache is required."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        mine = args
        if self._subparsers is not None:  # the options before the command's name; the command's parser checks the rest
            mine = list(itertools.takewhile(lambda arg: arg.startswith("-"), args))
        unknown = self.unknown_options(mine)
        if unknown:
            self.error(f"\n{self.prog}: error: ".join(unknown))
        return super().parse_known_args(args, namespace)

    def _check_value(self, action, value):
        """A value outside a flag's choices (or a command name) is named with the one meant: `--aggregate densee`
        (did you mean 'dense'?)."""
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {choices})"
                                                 f"{did_you_mean(value, action.choices)}")
        super()._check_value(action, value)

    def unknown_options(self, args: list[str]) -> list[str]:
        """A line for each `--option` in `args` that this parser does not take (a prefix of one
        that it takes is argparse's to judge)."""
        known = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        lines = []
        for arg in args[: args.index("--")] if "--" in args else args:
            name = arg.split("=", 1)[0]
            if not name.startswith("--") or any(option.startswith(name) for option in known):
                continue
            lines.append(f"unrecognized argument {name}{did_you_mean(name, known, show=str)}")
        return lines


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dflash-callbacks", description=__doc__.split("\n\n")[0])
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (also DFLASH_DEBUG=1)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also DFLASH_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[debug])
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("DFLASH_DEBUG", "") not in ("", "0")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        for line in str(e).splitlines() or [type(e).__name__]:
            line = line.strip()
            if line and not line.endswith(":"):
                print(f"error: {line}", file=sys.stderr)
        return 2
    except Exception as e:
        if debug:
            raise
        print(f"error: internal error {type(e).__name__}: {e} (rerun with --debug for the traceback, and please "
              "report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
