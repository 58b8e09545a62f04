"""The predicted speed-up against the measured one: real speculative decoding on the toy world, on this machine.

The toy baseline drafter is scored on the toy target's coding10 cache (vanilla and ddtree@N at each block size,
the live schedule over the whole completion), this machine is profiled (`dflash-callbacks profile`'s
`profile_costs`, at the cache's context lengths, in the same run), and each cached prompt is decoded, timed,
with plain greedy decoding and with each method at each block size: the real toy target with a real KV cache,
the drafter's context keys and values grown by each round's accepted tokens, a DDTree tree verified in one
forward under a tree mask (`profile.decode`). Per method: tau (the report's live mean, and the decoder's), the
predicted speed-up (`scoring.speed`) with its 95% interval, the measured one (the mean over tasks of plain
seconds / speculative seconds, each the median of `--passes`), and measured / predicted. One torch thread;
wall-clock seconds, or (`--clock cpu`) the thread's CPU time, which a shared machine's other processes do not add to.

    python benchmarks/bench_speedup.py                       # 10 tasks, vanilla, ddtree@4, ddtree@8 at blocks 8 and 4
    python benchmarks/bench_speedup.py --clock cpu           # the same in CPU seconds
    python benchmarks/bench_speedup.py --smallest            # seconds: 3 tasks of 32 tokens, vanilla and ddtree@4 at 8
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.demos.toy.world import build_toy_cache, toy_baseline_path, toy_target_path
from dflash_callbacks.profile.validate import check_speedups
from dflash_callbacks.settings import int_list


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10, help="the first N coding10 prompts (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="the cache's completion length (default 96)")
    p.add_argument("--budgets", type=int_list, default=[4, 8], help="DDTree budgets (default 4,8)")
    p.add_argument("--block-sizes", type=int_list, default=[8, 4], help="block sizes, the drafter's first (default 8,4)")
    p.add_argument("--passes", type=int, default=3, help="decodes of each prompt per method (the median; default 3)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs of each profiled piece (default 20)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall-clock seconds (default), or this thread's CPU time (on a shared machine: the same work "
                        "without the time other processes take)")
    p.add_argument("--smallest", action="store_true", help="3 tasks of 32 tokens, ddtree@4 at block 8, 1 pass")
    p.add_argument("--out", type=Path, default=None, help="where the cache is built (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.smallest:
        args.tasks, args.max_new_tokens, args.budgets, args.block_sizes, args.passes, args.repeats = 3, 32, [4], [8], 1, 10
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or Path(scratch)
        cache = build_toy_cache(folder / f"coding10-{args.max_new_tokens}", max_new_tokens=args.max_new_tokens)
        drafter = load_drafter(toy_baseline_path(), dtype=torch.float32)
        rows, costs, report = check_speedups(toy_target_path(), drafter, cache, ddtree_budgets=args.budgets,
                                             block_sizes=args.block_sizes, tasks=cache.task_names[: args.tasks],
                                             passes=args.passes, repeats=args.repeats, clock=args.clock)
    print(f"# {' '.join(shlex.quote(a) for a in ['python', 'benchmarks/bench_speedup.py', *(argv or sys.argv[1:])])}")
    print(f"{costs.device}, {costs.dtype}, {args.tasks} tasks of up to {args.max_new_tokens} new tokens, "
          f"{args.passes} passes, {args.clock} seconds, {time.perf_counter() - started:.0f} s in all; T_target(1, L) "
          f"{1000 * costs.target_forward(1, costs.contexts[0]):.2f} ms at L = {costs.contexts[0]}, "
          + ", ".join(f"T_draft({b}) {1000 * costs.draft_round(b):.2f} ms" for b in args.block_sizes))
    print("\n| method | tau (report) | tau (decoded) | predicted speed-up [95%] | measured | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.method} | {r.tau_report:.2f} | {r.tau_decoded:.2f} | {r.predicted:.2f}× [{r.predicted_lo:.2f}, "
              f"{r.predicted_hi:.2f}] | {r.measured:.2f}× | {r.ratio:.2f} |")
    worst = max(abs(r.ratio - 1) for r in rows)
    print(f"\nlargest |measured / predicted - 1|: {100 * worst:.0f}%")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
                                         "costs": costs.to_dict()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
