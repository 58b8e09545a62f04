"""What the intervals cost: the bootstrap against the scoring of a coding10 report, on the CPU.

Scores the toy baseline (or `--drafter`) on the toy world's coding10 cache `--repeats` times
(`score_drafter`: every task, every method, and the report's own intervals), and times on the
same report, as often and interleaved, in CPU seconds of this process (medians: timings on
shared cores are noisy; with --threads 1 CPU time is the time the work takes alone):
- `report_intervals`: the 95% interval of every mean a report carries (inside `score_drafter`);
- `paired_comparison`: the paired delta and ratio against a second report (at publishing time).
Prints each, its share of the scoring time without it, the resamples, and the size of the
report as a results.jsonl line (and the part that is the per-anchor streaks).

    python benchmarks/bench_bootstrap.py [--threads 1] [--repeats 7] [--drafter DIR] [--cache DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_callbacks import TargetHead, load_drafter
from dflash_callbacks.cache.format import HiddenStateCache
from dflash_callbacks.demos.toy.world import build_toy_cache, toy_baseline_path, toy_target_path
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.intervals import RESAMPLES, paired_comparison, report_intervals
from dflash_callbacks.scoring.scorer import score_drafter


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, default=None, help="drafter folder (default: the toy baseline)")
    p.add_argument("--cache", type=Path, default=Path("runs/bench-bootstrap/coding10"))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the tests use 1)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not (args.cache / "manifest.json").is_file():
        build_toy_cache(args.cache, block_size=8, progress=True)
    cache, head = HiddenStateCache(args.cache), TargetHead.from_pretrained(toy_target_path())
    drafter = load_drafter(args.drafter or toy_baseline_path())
    config = ScoringConfig(device="cpu")
    score_drafter(drafter, cache, head, config)  # warm up
    scoring, intervals, paired = [], [], []

    def timed(run, into: list):  # CPU seconds of this process: other work on shared cores does not count
        started = time.process_time()
        out = run()
        into.append(time.process_time() - started)
        return out

    for _ in range(args.repeats):
        report = timed(lambda: score_drafter(drafter, cache, head, config), scoring)
        timed(lambda: report_intervals(report), intervals)
        timed(lambda: paired_comparison(report, report), paired)
    score, own, pair = (statistics.median(x) for x in (scoring, intervals, paired))
    line = json.dumps({**report.to_dict(), "score_seconds": score}, allow_nan=False)
    streaks = sum(len(n["streaks"]) for t in report.tasks.values() for n in t.values())
    anchors = sum(per_method[report.methods[0]]["anchors"] for per_method in report.tasks.values())
    figures = {
        "tasks": len(report.tasks), "methods": report.methods, "anchors": anchors,
        "resamples": RESAMPLES, "threads": args.threads, "repeats": args.repeats,
        "scoring_s": score, "report_intervals_s": own, "paired_comparison_s": pair,
        "report_intervals_share": own / (score - own), "paired_comparison_share": pair / (score - own),
        "report_line_bytes": len(line.encode()), "streaks_bytes": streaks,
    }
    print(f"coding10 on the toy world: {figures['tasks']} tasks, {figures['anchors']} anchors, methods "
          f"{', '.join(report.methods)}; {args.threads} torch thread(s), CPU time, medians of {args.repeats}")
    print(f"  scoring a report (intervals included)  {1000 * score:8.1f} ms")
    print(f"  report_intervals ({RESAMPLES} resamples)    {1000 * own:8.1f} ms  "
          f"{100 * figures['report_intervals_share']:.1f}% of the scoring without it")
    print(f"  paired_comparison (at publishing)      {1000 * pair:8.1f} ms  "
          f"{100 * figures['paired_comparison_share']:.1f}% of it")
    print(f"  a results.jsonl line: {figures['report_line_bytes']:,} bytes, of which the streaks {streaks:,}")
    print("reproduce: python " + " ".join(shlex.quote(a) for a in sys.argv))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
