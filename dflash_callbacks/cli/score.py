"""`dflash-callbacks score` and `dflash-callbacks compare` (and the scoring flags `watch` takes too).

Both check every input before any work starts (`score` runs the same preflight as the
callback, the baseline included), then print a per-task table, every number with its 95%
interval (`mean [lo, hi]`), delta and ratio paired, and a verdict per method.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ..scoring.config import ScoringConfig
from ..settings import add_arguments, given_arguments
from .usage import USER_ERRORS, UsageError


def add_scoring_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per ScoringConfig field (its help and default), and --config."""
    g = p.add_argument_group("scoring (ScoringConfig; a flag given here wins over --config)")
    g.add_argument("--config", type=Path, default=None,
                   help="a ScoringConfig YAML (e.g. conf/scoring.yaml); flags given on the command line win")
    add_arguments(g, ScoringConfig)


def scoring_flag(name: str) -> str:
    """How the command line spells a ScoringConfig field."""
    return "--" + name.replace("_", "-")


def scoring_config(args: argparse.Namespace) -> ScoringConfig:
    """--config (or the defaults), then the scoring flags given on the command line; every bad
    setting of both at once, one line each."""
    from ..config_files import load_config

    if args.config is not None and not args.config.is_file():
        raise UsageError(f"--config {args.config} is not a file: give a ScoringConfig YAML such as conf/scoring.yaml")
    return load_config(ScoringConfig, args.config, values=given_arguments(args, ScoringConfig))


BASELINE_CACHE_HELP = ("where baseline reports are cached (default $XDG_CACHE_HOME/dflash_callbacks/baselines, "
                       "~/.cache/dflash_callbacks/baselines when XDG_CACHE_HOME is unset)")


def output_problems(option: str, path: Path | None) -> list[str]:
    if path is not None and path.is_dir():
        return [f"{option} {path} is a folder: give the path of the JSON file to write"]
    if path is not None and not path.parent.is_dir():
        return [f"{option} {path}: the folder {path.parent} does not exist"]
    return []


FOLDERS = {"cache": ("the cache's", "`dflash-callbacks extract --out` makes one"),
           "target": ("the target model's", "a local transformers folder: nothing is downloaded")}


def folder_problems(flag: str, path: Path) -> list[str]:
    """--cache or --target (`flag`) `path`, missing or a file: one line (what is in it, preflight reads)."""
    what, made = FOLDERS[flag]
    if path.is_file():
        return [f"--{flag} {path} is a file: give {what} folder (e.g. {path.parent})"]
    if not path.is_dir():
        return [f"--{flag} {path} does not exist: give {what} folder ({made})"]
    return []


def path_problems(args: argparse.Namespace) -> list[str]:
    """What the folders given to `score` and `watch` are, told without torch: each one missing or of the wrong
    kind is one line."""
    problems = folder_problems("cache", args.cache) + folder_problems("target", args.target)
    if args.baseline is not None and not args.baseline.exists():
        problems.append(f"--baseline {args.baseline} does not exist: give a drafter folder or a saved report JSON")
    return problems


def drafter_problems(args: argparse.Namespace) -> list[str]:
    """What --drafter, --state-key and --drafter-config can be told to be without reading them."""
    if args.drafter.is_dir():
        return [f"--{flag.replace('_', '-')} goes with a torch checkpoint file; --drafter {args.drafter} is a folder, "
                "which holds its own config.json and tensors"
                for flag in ("state_key", "drafter_config") if getattr(args, flag) is not None]
    if not args.drafter.is_file() or args.drafter.suffix in (".json", ".safetensors"):
        return [f"--drafter {args.drafter} is not a folder: give a drafter folder (config.json and *.safetensors), a "
                "snapshot folder, or a trainer's torch checkpoint file with --drafter-config"]
    if args.drafter_config is None:
        return [f"--drafter {args.drafter} is a checkpoint file, which holds no drafter config: give the config.json "
                "it was trained with as --drafter-config (and --state-key draft_state_dict for a SpecForge "
                "training_state.pt)"]
    if not args.drafter_config.exists():
        return [f"--drafter-config {args.drafter_config} does not exist: give the config.json the checkpoint was "
                "trained with"]
    return []


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, type=Path,
                   help="drafter folder (published layout, speculators, or snapshot), or a trainer's torch checkpoint file "
                        "(with --drafter-config, and --state-key)")
    p.add_argument("--state-key", default=None,
                   help="with a torch checkpoint file: the entry holding the drafter's tensors (SpecForge's "
                        "training_state.pt: draft_state_dict)")
    p.add_argument("--drafter-config", type=Path, default=None,
                   help="with a torch checkpoint file: the drafter's config.json (SpecForge: the draft config it was "
                        "trained with)")
    p.add_argument("--cache", required=True, type=Path, help="hidden-state cache folder")
    p.add_argument("--target", required=True, type=Path, help="target folder (only embed_tokens and lm_head are read)")
    p.add_argument("--baseline", type=Path, default=None, help="baseline drafter folder or saved report JSON")
    p.add_argument("--baseline-cache-dir", type=Path, default=None,
                   help=BASELINE_CACHE_HELP)
    p.add_argument("--json", type=Path, default=None, help="write our report here")
    p.add_argument("--baseline-json", type=Path, default=None, help="write the baseline's report here")
    p.add_argument("--aggregate", choices=("live", "dense"), default="live", help="aggregate shown in the table")
    add_scoring_arguments(p)


def drafter_source(args: argparse.Namespace):
    """(config, tensor shapes, the state of a checkpoint file or None) of --drafter (`drafter_problems` found
    none)."""
    from ..model import DrafterConfig
    from ..model.drafter import split_stored_head
    from ..model.io import read_checkpoint, read_config, read_state_shapes

    if args.drafter.is_dir():
        return read_config(args.drafter), read_state_shapes(args.drafter), None
    config = DrafterConfig.from_file(args.drafter_config)
    state = read_checkpoint(args.drafter, args.state_key)
    return config, {k: tuple(v.shape) for k, v in split_stored_head(state)[0].items()}, state


def run_score(args: argparse.Namespace) -> int:
    problems = output_problems("--json", args.json) + output_problems("--baseline-json", args.baseline_json)
    if args.baseline_json is not None and args.baseline is None:
        problems.append("--baseline-json writes the baseline's report: give the baseline with --baseline")
    if args.json is not None and args.baseline_json is not None and args.json.resolve() == args.baseline_json.resolve():
        problems.append(f"--json and --baseline-json are both {args.json}: give each report its own file")
    problems += drafter_problems(args) + path_problems(args)
    costs = None
    try:
        scoring = scoring_config(args)
    except ValueError as e:
        problems += str(e).splitlines()
    else:
        costs, more = score_costs(scoring, args)
        problems += more
    if problems:  # every one of them before torch loads (the drafter's config is read with its family, which
        # needs torch: what its block size refuses, preflight says)
        raise UsageError("\n".join(problems))

    from ..scoring.basis import drafter_difference
    from ..scoring.table import comparison_table
    from ..scoring.service import PreflightError, ScoringService, ServiceSpec, preflight

    spec = ServiceSpec(
        cache=str(args.cache), target=str(args.target),
        baseline=None if args.baseline is None else str(args.baseline),
        scoring=scoring,
        baseline_cache_dir=None if args.baseline_cache_dir is None else str(args.baseline_cache_dir),
    )
    try:
        config, shapes, state = drafter_source(args)
    except USER_ERRORS as e:  # what needs no drafter is checked too: every problem at once
        try:
            preflight(spec, None)
        except PreflightError as more:
            raise UsageError(f"{e}\n{more}") from None
        raise
    preflight(spec, config, shapes, warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    service = ScoringService(spec, owns_process=True)
    if state is None:
        ours = service.score_folder(args.drafter, progress=True)
    else:
        ours = service.score(config, state, name=str(args.drafter), progress=True)
    if args.json:
        ours.to_json(args.json)
    baseline = service.baseline(progress=True)
    if baseline is not None and args.baseline_json:
        baseline.to_json(args.baseline_json)
    if baseline is not None and (note := drafter_difference(ours, baseline)):
        print(f"warning: {note}", file=sys.stderr)
    print(comparison_table(ours, baseline, args.aggregate))
    print(f"ours: {ours.served()}" + ("" if baseline is None else f"\nthe baseline: {baseline.served()}"))
    if costs is not None:
        print_speedups(ours, baseline, costs, args.aggregate, args.cache, device_type=scoring.resolved_device().type,
                       force=scoring.force_costs)
    return 0


def score_costs(scoring: ScoringConfig, args: argparse.Namespace):
    """(the costs `--costs` names or None, the problems with them): what is not a costs file, or a file measured
    for another target (the --target folder's shape), drafter, dtype or (an explicit) device, unless forced."""
    if scoring.costs is None:
        return None, []
    from ..scoring.costs import CostsError
    from ..scoring.speed import config_costs

    drafter = None
    if args.drafter.is_dir() and (args.drafter / "config.json").is_file():
        from ..scoring.speed import drafter_folder_shape

        drafter = drafter_folder_shape(args.drafter)  # None where it can not tell: the drafter's read says why
    target = args.target if (args.target / "config.json").is_file() else None
    try:
        costs, warnings = config_costs(scoring, target, drafter_shape_given=drafter)
    except (CostsError, OSError, KeyError) as e:
        return None, [f"--costs {scoring.costs}: {e}"]
    for line in warnings:
        print(f"warning: --costs {scoring.costs}: {line}", file=sys.stderr)
    return costs, []


def print_speedups(ours, baseline, costs, aggregate: str, cache: Path | None = None, *, device_type: str | None = None,
                   force: bool = False) -> None:
    """The predicted speed-up table and the fastest line (`scoring.speed`), each task at its mean context in
    `cache` (None: the costs' middle length); a costs file of another device kind is refused unless `force`."""
    from ..scoring.costs import check_costs_fit
    from ..scoring.speed import speedup_table, task_contexts

    for line in check_costs_fit(costs, force, device_type=device_type):
        print(f"warning: the costs: {line}", file=sys.stderr)
    contexts = None if cache is None else task_contexts(cache, ours)
    print(speedup_table(ours, baseline, costs, aggregate, contexts))


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ours", type=Path, help="our report: a report JSON, or a run's results.jsonl (see --step)")
    p.add_argument("baseline", type=Path, help="the baseline's report JSON, or another drafter's report JSON (scored on "
                                               "the same cache): delta and ratio are paired on the same anchors")
    p.add_argument("--step", type=int, default=None, help="with a results.jsonl: the step to compare (default: the last)")
    p.add_argument("--aggregate", choices=("live", "dense"), default="live")
    p.add_argument("--force", action="store_true", help="compare even if the cache, target, block size, tasks, methods "
                                                        "or scoring fields differ (what is dropped is said), or the "
                                                        "--costs file was measured in another dtype")
    p.add_argument("--costs", type=Path, default=None,
                   help="a costs file of the serving device (`dflash-callbacks profile`): also print each method's "
                        "predicted speed-up, ours, the baseline's and the paired ratio, and the fastest configuration "
                        "(default: the costs our report was scored with, its scoring.costs, when that file is here)")


def load_ours(path: Path, step: int | None):
    if path.is_dir():
        raise UsageError(f"{path} is a folder: the first argument is our report JSON (from `score --json`) or a run's "
                         "results.jsonl; a drafter folder is scored with `dflash-callbacks score --drafter`")
    from ..scoring.report import EvalReport, read_results

    if path.suffix != ".jsonl":
        if step is not None:
            raise UsageError("--step picks a report from a results.jsonl; this is a single report")
        return EvalReport.load(path)
    if not path.is_file():
        raise UsageError(f"no results file at {path}")
    results = read_results(path)
    for line in results.skipped:
        print(f"warning: {path} {line}; that line is left out", file=sys.stderr)
    reports = results.reports
    failed = {e["step"]: e["error"] for e in results.errors if e["step"] not in {r.step for r in reports}}
    if step in failed:
        raise UsageError(f"step {step} of {path} was not scored: {failed[step]}")
    if not reports:
        raise UsageError(f"{path} holds no report" + (f"; the scoring of steps {sorted(failed)} failed" if failed else ""))
    if step is None:
        last = max(reports, key=lambda r: r.step)
        for later in sorted(s for s in failed if s > last.step):
            print(f"warning: step {later} of {path} was not scored ({failed[later]}); step {last.step} is the last "
                  "with a report", file=sys.stderr)
        return last
    chosen = [r for r in reports if r.step == step]
    if not chosen:
        raise UsageError(f"{path} has no report of step {step}; it has steps {sorted(r.step for r in reports)}")
    return chosen[-1]


def load_baseline(path: Path):
    if path.is_dir():
        raise UsageError(f"the baseline {path} is a folder: compare takes the baseline's report JSON; score a drafter "
                         f"folder with `dflash-callbacks score --drafter OURS --baseline {path} --baseline-json base.json` "
                         "and compare with base.json")
    from ..scoring.report import EvalReport

    if path.suffix == ".jsonl":
        raise UsageError(f"the baseline {path} is a results.jsonl: the first argument may be a results.jsonl, the second "
                         "must be the baseline's report JSON (e.g. from `score --baseline-json`); are they swapped?")
    return EvalReport.load(path)


def run_compare(args: argparse.Namespace) -> int:
    from ..scoring.basis import Basis, drafter_difference
    from ..scoring.table import comparison_table

    ours, baseline = load_ours(args.ours, args.step), load_baseline(args.baseline)
    # anything that changes numbers refuses, a method scored on one side only included
    problems = replace(Basis.of_report(ours), methods=()).mismatches(baseline, f"the baseline {args.baseline}")
    only_ours = [m for m in ours.methods if m not in baseline.methods]
    only_theirs = [m for m in baseline.methods if m not in ours.methods]
    if only_ours or only_theirs:
        sides = [f"{', '.join(only_ours)} only in {args.ours}"] * bool(only_ours)
        sides += [f"{', '.join(only_theirs)} only in {args.baseline}"] * bool(only_theirs)
        problems.append(f"the methods differ ({'; '.join(sides)})")
    if problems and not args.force:
        raise UsageError("refusing to compare: " + "; ".join(problems) + " (use --force to compare anyway)")
    note = drafter_difference(ours, baseline)
    for problem in problems + ([note] if note else []):
        print(f"warning: {problem}", file=sys.stderr)
    if only_ours or only_theirs:
        print(f"warning: dropping {', '.join(only_ours + only_theirs)}: the table shows the methods both score",
              file=sys.stderr)
    print(comparison_table(ours, baseline, args.aggregate, other=baseline.drafter))
    print(f"ours: {ours.served()}\n{baseline.drafter}: {baseline.served()}")  # each side's rule and cache settings
    costs, named = compare_costs(args, ours)
    if costs is not None:
        from ..scoring.costs import check_costs_fit

        forced = args.force or (args.costs is None and bool(ours.scoring.get("force_costs")))  # as it was scored
        for line in check_costs_fit(costs, forced, dtype=ours.scoring.get("dtype")):
            print(f"warning: {named}: {line}", file=sys.stderr)
        cache = Path(ours.cache["path"]) if ours.cache.get("path") else None
        print_speedups(ours, baseline, costs, args.aggregate, cache if cache is not None and cache.is_dir() else None)
    return 0


def compare_costs(args: argparse.Namespace, ours):
    """(the costs compare predicts the speed-ups on, how a warning names them): `--costs`, or else the costs
    file our report was scored with (its `scoring.costs`); (None, "") where neither names one, or where the
    recorded file is not here or not a costs file (one warning line; --costs gives one)."""
    from ..scoring.costs import Costs, CostsError

    if args.costs is not None:
        return Costs.load(args.costs), f"--costs {args.costs}"
    recorded = ours.scoring.get("costs")
    if not recorded:
        return None, ""
    named = f"the costs {args.ours} was scored with ({recorded})"
    if not Path(recorded).is_file():
        print(f"warning: no predicted speed-up: {named} is not here; give the costs file with --costs FILE",
              file=sys.stderr)
        return None, ""
    try:
        return Costs.load(recorded), named
    except CostsError as e:
        print(f"warning: no predicted speed-up: {e}; give a costs file with --costs FILE", file=sys.stderr)
        return None, ""
