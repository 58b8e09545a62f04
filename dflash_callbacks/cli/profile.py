"""`dflash-callbacks profile`: time one speculative round's pieces on a device and write the costs JSON that
`score --costs` (`scoring.costs`) predicts speed-ups from (`profile.timing.profile_costs`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checks import DTYPE_NAMES
from ..settings import int_list
from .usage import UsageError


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, type=Path, help="the target model's folder (a transformers folder)")
    p.add_argument("--drafter", required=True, type=Path, help="the drafter folder (published layout, speculators, "
                                                               "or snapshot)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="the baseline drafter's folder, where its shape differs from the drafter's: its round is "
                        "timed too (baseline_draft)")
    p.add_argument("--out", required=True, type=Path, help="write the costs JSON here")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N: the serving device to profile")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES, help="the dtype the models serve in "
                                                                            "(default bfloat16)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="requests decoded side by side (speculation's gain shrinks as it grows; default 1)")
    p.add_argument("--block-sizes", type=int_list, default=None,
                   help="the block sizes scored, comma-separated (default: the drafter's)")
    p.add_argument("--ddtree-budgets", type=int_list, default=[4, 8], help="the DDTree budgets scored (default 4,8)")
    p.add_argument("--ddtree-sweep", type=int, default=None,
                   help="also every DDTree budget from 1 to N (scoring.ddtree_sweep)")
    p.add_argument("--topk", type=int_list, default=[], help="the top@k widths scored (default none)")
    p.add_argument("--contexts", type=int_list, default=[128, 512, 2048],
                   help="the context lengths L to time the target's forward after (default 128,512,2048)")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed runs of each piece (their mean is kept, the extreme tenths left out; default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs of each piece first (default 3)")


def run_profile(args: argparse.Namespace) -> int:
    problems = []
    for flag, path in (("--target", args.target), ("--drafter", args.drafter), ("--baseline", args.baseline)):
        if path is not None and not (path / "config.json").is_file():
            problems.append(f"{flag} {path} is not a model folder (no config.json there)")
    if args.out.is_dir() or not args.out.parent.is_dir():
        problems.append(f"--out {args.out}: give the path of the JSON file to write, in a folder that exists")
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--repeats", args.repeats, 1),
                             ("--warmup", args.warmup, 0), ("--ddtree-sweep", args.ddtree_sweep or 1, 1)):
        if value < low:
            problems.append(f"{flag} must be at least {low}; got {value}")
    for flag, values, low in (("--block-sizes", args.block_sizes or [2], 2), ("--ddtree-budgets", args.ddtree_budgets, 1),
                              ("--topk", args.topk, 1), ("--contexts", args.contexts or [0], 1)):
        if any(v < low for v in values):
            problems.append(f"{flag} must hold integers >= {low}; got {values}")
    if problems:
        raise UsageError("\n".join(problems))

    from ..cache.extract import load_target
    from ..checks import DTYPES, check_device
    from ..model import load_drafter
    from ..profile.timing import profile_costs

    device, dtype = check_device("--device", args.device), DTYPES[args.dtype]
    model, _ = load_target(args.target, device=device, dtype=dtype)
    drafter = load_drafter(args.drafter, dtype=dtype, device=device)
    baseline = None if args.baseline is None else load_drafter(args.baseline, dtype=dtype, device=device)
    blocks = args.block_sizes or [drafter.block_size]
    too_large = [b for b in blocks if b > drafter.block_size]
    if too_large:
        raise UsageError(f"--block-sizes {too_large} are above the drafter's trained block size {drafter.block_size}")
    budgets = sorted({*args.ddtree_budgets, *range(1, (args.ddtree_sweep or 0) + 1)})
    costs = profile_costs(model, drafter, block_sizes=blocks, ddtree_budgets=budgets, topk=args.topk,
                          contexts=args.contexts, batch_size=args.batch_size, repeats=args.repeats,
                          warmup=args.warmup, baseline=baseline)
    costs.to_json(args.out)
    L = costs.contexts[0]
    most = costs.largest_n
    print(f"{costs.device}, {costs.dtype}, batch {costs.batch_size}: target forward of 1 token after {L} "
          f"{1000 * costs.target_forward(1, L):.2f} ms, of {most} {1000 * costs.target_forward(most, L):.2f} ms; "
          + ", ".join(f"drafter round at block {b} {1000 * costs.draft_round(b):.2f} ms" for b in blocks))
    print(f"wrote {args.out} (score with --costs {args.out})", file=sys.stderr)
    return 0
