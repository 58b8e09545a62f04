"""`dflash-callbacks score` and `dflash-callbacks compare`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import BACKENDS, DTYPES, ScoringConfig
from .report import EvalReport, comparable, comparison_table


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_scoring_arguments(p: argparse.ArgumentParser) -> None:
    d = ScoringConfig()
    p.add_argument("--budgets", type=int_list, default=d.ddtree_budgets, help="DDTree node budgets (default 4,8)")
    p.add_argument("--topk", type=int_list, default=d.topk, help="top@k widths, e.g. 4,8 (default none)")
    p.add_argument("--window", type=int, default=None, help="score the first N completion tokens (default all)")
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    p.add_argument("--max-rounds", type=int, default=d.max_rounds, help="rounds of the live schedule")
    p.add_argument("--tasks", type=lambda s: s.split(","), default=None, help="comma-separated subset of tasks")
    p.add_argument("--anchors-per-forward", type=int, default=d.anchors_per_forward)
    p.add_argument("--vocab-chunk", type=int, default=None)
    p.add_argument("--backend", choices=BACKENDS, default=d.backend)
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=list(DTYPES), default=d.dtype)


def scoring_config(args: argparse.Namespace) -> ScoringConfig:
    return ScoringConfig(
        ddtree_budgets=args.budgets, topk=args.topk, window=args.window, block_size=args.block_size,
        max_rounds=args.max_rounds, tasks=args.tasks, anchors_per_forward=args.anchors_per_forward,
        vocab_chunk=args.vocab_chunk, backend=args.backend, device=args.device, dtype=args.dtype,
    )


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, type=Path, help="drafter folder (published layout or snapshot)")
    p.add_argument("--cache", required=True, type=Path, help="hidden-state cache folder")
    p.add_argument("--target", required=True, type=Path, help="target folder (only embed_tokens and lm_head are read)")
    p.add_argument("--baseline", type=Path, default=None, help="baseline drafter folder or saved report JSON")
    p.add_argument("--json", type=Path, default=None, help="write our report here")
    p.add_argument("--baseline-json", type=Path, default=None, help="write the baseline's report here")
    p.add_argument("--aggregate", choices=("live", "dense"), default="live", help="aggregate shown in the table")
    add_scoring_arguments(p)


def run_score(args: argparse.Namespace) -> int:
    from ..cache.format import HiddenStateCache
    from ..model import TargetHead, load_drafter
    from .scorer import score_drafter

    config = scoring_config(args)
    cache = HiddenStateCache(args.cache)
    head = TargetHead.from_pretrained(args.target)

    def score(folder: Path) -> EvalReport:
        return score_drafter(load_drafter(folder), cache, head, config, name=str(folder), progress=True)

    ours = score(args.drafter)
    if args.json:
        ours.to_json(args.json)
    baseline = None
    if args.baseline is not None:
        baseline = EvalReport.load(args.baseline) if args.baseline.is_file() else score(args.baseline)
        if args.baseline_json:
            baseline.to_json(args.baseline_json)
        for problem in comparable(ours, baseline):
            print(f"warning: {problem}", file=sys.stderr)
    print(comparison_table(ours, baseline, args.aggregate))
    return 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ours", type=Path, help="report JSON of our drafter")
    p.add_argument("baseline", type=Path, help="report JSON of the baseline")
    p.add_argument("--aggregate", choices=("live", "dense"), default="live")
    p.add_argument("--force", action="store_true", help="compare even if cache or block size differ")


def run_compare(args: argparse.Namespace) -> int:
    ours, baseline = EvalReport.load(args.ours), EvalReport.load(args.baseline)
    problems = comparable(ours, baseline)
    if problems and not args.force:
        print("refusing to compare: " + "; ".join(problems) + " (use --force to compare anyway)", file=sys.stderr)
        return 2
    print(comparison_table(ours, baseline, args.aggregate))
    return 0
