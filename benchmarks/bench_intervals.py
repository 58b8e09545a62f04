"""How the intervals and the stop behave on simulated caches whose truth is known (the model of
streaks in tests/support/simulated_caches.py): the figures docs/numbers.md quotes.

- `coverage`: per setting, the share of 95% intervals holding the truth over `--reps` caches:
  ours' run-level mean and the paired ratio to the baseline (dense and live), the ratio's
  among the caches where the between-task shrinkage c is 0 (and how often it is), and an
  i.i.d. bootstrap of the pooled anchors.
- `task`: one task's own interval (its text drawn again, its effect fixed), dense and live:
  how often it holds the task's truth, and how often live's has zero width.
- `continuity`: the width of a run-level interval as the spread of the task means crosses
  the point where c becomes 0 (3 and 10 tasks): the largest jump between neighbouring
  spreads, with the rule now (t(T-1) always) and the rule before (t over the blocks where
  c = 0).
- `stop`: runs of `--reports` reports of a drafter whose true ratio to the baseline is 0.90
  (the boundary of min_ratio=0.9) or 0.80, on one cache per run (its tasks and text fixed, the
  baseline's report fixed, ours' acceptance noise drawn again at every report): how often
  `StopPolicy` stops with patience 1, 2 and 3, the share of reports that trail, and the paired
  ratio's interval width, monitoring dense and live.

    python benchmarks/bench_intervals.py [--part coverage task continuity stop] [--reps 1000] [--runs 200] \
        [--reports 10] [--json out.json]

(One process, on a shared core: coverage about 30 minutes at --reps 1000; task 3; continuity 1;
stop 10 to 25.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the simulated caches

from dflash_callbacks.engine.stop import StopPolicy  # noqa: E402
from dflash_callbacks.scoring.intervals import (  # noqa: E402
    CONFIDENCE, paired_comparison, positions, report_intervals, t_quantile,
)
from simulated_caches import Model, coverage, live_means, report_of, spread_scan, truths  # noqa: E402

SETTINGS = {  # the settings of the coverage table (10 tasks, 150 anchors, B = 8 unless said)
    "stretches correlated at 0.7, task effects 0.5 (the test's)": Model(rho=0.7, offsets=(-0.5, -0.8)),
    "weak drafters (tau about 2), correlation 0.9": Model(),
    "within-task noise dominates (task effects 0.1)": Model(rho=0.7, task_sd=0.1, offsets=(-0.5, -0.8)),
    "tasks differ very strongly (task effects 1.0)": Model(rho=0.7, task_sd=1.0, offsets=(-0.5, -0.8)),
    "heavy-tailed task effects (t, 3 d.o.f., sd 0.5)": Model(rho=0.7, task_df=3, offsets=(-0.5, -0.8)),
    "3 tasks": Model(tasks=3, rho=0.7, offsets=(-0.5, -0.8)),
    "3 tasks, heavy-tailed task effects": Model(tasks=3, rho=0.7, task_df=3, offsets=(-0.5, -0.8)),
    "30 tasks": Model(tasks=30, rho=0.7, offsets=(-0.5, -0.8)),
    "2 tasks (within-task interval, no verdict)": Model(tasks=2, rho=0.7, offsets=(-0.5, -0.8)),
    "1 task (within-task interval, no verdict)": Model(tasks=1, rho=0.7, offsets=(-0.5, -0.8)),
}


def part_coverage(reps: int) -> dict:
    found = {}
    for name, model in SETTINGS.items():
        started = time.time()
        found[name] = {k: round(float(v), 3) for k, v in coverage(model, reps=reps, seed=1).items()}
        print(f"{name} ({time.time() - started:.0f} s)\n  " + ", ".join(f"{k} {v}" for k, v in found[name].items()),
              flush=True)
    return found


def part_continuity() -> dict:
    """The width of ours' dense run-level interval against the spread of the task means
    (`spread_scan`: the same text and draws, the task means moved apart), across the spread
    where c reaches 0, now and with the rule before (t over the blocks where c = 0)."""
    found, tail = {}, 1 - (1 - CONFIDENCE) / 2
    for tasks in (3, 10):
        rows = spread_scan(tasks, np.linspace(0.0, 0.3, 61))
        for row in rows:  # the rule before widened by t(blocks - T) where c = 0, t(T - 1) where c > 0
            row["width before"] = row["width"] if row["c"] > 0 else \
                row["width"] * t_quantile(tail, row["blocks"] - tasks) / t_quantile(tail, tasks - 1)
        steps = {rule: max(max(b[rule] / a[rule], a[rule] / b[rule]) for a, b in zip(rows, rows[1:]))
                 for rule in ("width", "width before")}
        cross = next(row for row in rows if row["c"] > 0)["spread"]
        found[f"{tasks} tasks"] = {"largest step now": round(steps["width"], 3),
                                   "largest step before": round(steps["width before"], 3), "c > 0 from spread": cross}
        print(f"continuity, {tasks} tasks (the task means' sd from 0 to 0.3 in steps of 0.005, c > 0 from "
              f"{cross:.3f}): "
              f"largest step in width x{steps['width']:.3f} now, x{steps['width before']:.2f} with the rule before",
              flush=True)
    return found


TASK_SETTINGS = {  # one task, its effect fixed (task_sd 0): only the text varies
    "300 anchors, correlation 0.7": Model(tasks=1, anchors=300, rho=0.7, task_sd=0.0, offsets=(-0.5,)),
    "300 anchors, correlation 0.9": Model(tasks=1, anchors=300, rho=0.9, task_sd=0.0, offsets=(0.0,)),
    "300 anchors, correlation 0.95": Model(tasks=1, anchors=300, rho=0.95, task_sd=0.0, offsets=(-0.5,)),
    "1000 anchors, correlation 0.98": Model(tasks=1, anchors=1000, rho=0.98, task_sd=0.0, offsets=(0.0,)),
}


def part_task(reps: int) -> dict:
    """A task's own interval, dense and live (30 rounds): how often it holds the task's truth
    (the mean over its text), its live blocks, and the share of live intervals of zero width."""
    found = {}
    for name, model in TASK_SETTINGS.items():
        truth = truths(model, tasks=2000)
        hits, zero, blocks = {"dense": 0, "live": 0}, 0, []
        for streaks in model.streaks(np.random.default_rng(6), reps)[0, :, 0]:
            report = report_of(streaks[None], model.block_size)
            own = report_intervals(report)["tasks"]["t0"]["vanilla"]
            for aggregate in hits:
                hits[aggregate] += own[aggregate][0] <= truth[aggregate] <= own[aggregate][1]
            zero += own["live"][0] == own["live"][1]
            lengths, series = positions([(report, "vanilla")], "t0")
            blocks.append(-(-series["live"][0].shape[1] // lengths["live"]))
        found[name] = {"dense": hits["dense"] / reps, "live": hits["live"] / reps, "live zero width": zero / reps,
                       "live blocks": float(np.mean(blocks))}
        print(f"one task, {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in found[name].items()), flush=True)
    return found


def population_means(model: Model, offset: float) -> dict[str, float]:
    """A drafter's dense and live mean tau over 3000 simulated tasks (the same text and noise for
    every offset, the baseline's shared noise included: common random numbers)."""
    rng = np.random.default_rng(99)
    reads = model.text(rng, 1, 3000)[0]
    shared = rng.standard_normal(reads.shape)
    streaks = model.accept(reads, offset, shared, np.random.default_rng(101))
    return {"dense": float((streaks + 1).mean()), "live": float(live_means(streaks).mean())}


def offset_for(model: Model, base: float, aggregate: str, ratio: float) -> float:
    """Ours' offset whose population ratio of `aggregate` means to the baseline at `base` is `ratio`."""
    target = ratio * population_means(model, base)[aggregate]
    lo, hi = base, base + 3.0  # a higher offset: a worse drafter
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if population_means(model, mid)[aggregate] > target else (lo, mid)
    return (lo + hi) / 2


STOP_MODELS = {  # the baseline at offset -0.8 (the coverage test's); ours at the offset giving the true ratio
    "the test's model (drafter noise 0.3)": Model(rho=0.7),
    "drafters that disagree more at each anchor (noise 1.0)": Model(rho=0.7, noise=1.0),
}


def part_stop(runs: int, reports: int, models: int | None = None) -> dict:
    base_offset, found = -0.8, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # patience 1's warning
        policies = {p: StopPolicy(monitor="vanilla/dense", min_ratio=0.9, patience=p, verbose=False) for p in (1, 2, 3)}
    for setting, model in list(STOP_MODELS.items())[:models]:
        for aggregate in ("dense", "live"):
            for ratio in (0.9, 0.8):
                started, offset = time.time(), offset_for(model, base_offset, aggregate, ratio)
                other = "live" if aggregate == "dense" else "dense"
                other_ratio = population_means(model, offset)[other] / population_means(model, base_offset)[other]
                stops, trailing, widths = dict.fromkeys(policies, 0), 0, []
                for run in range(runs):
                    rng = np.random.default_rng([7, run])
                    reads = model.text(rng, 1)[0]
                    shared = rng.standard_normal(reads.shape)
                    base = report_of(model.accept(reads, base_offset, shared, rng), model.block_size, name="base")
                    base_value, history, bounds = base.value(f"vanilla/{aggregate}"), [], {}
                    for step in range(1, reports + 1):
                        ours = report_of(model.accept(reads, offset, shared, rng), model.block_size, name="ours")
                        mean = paired_comparison(ours, base)[f"vanilla/{aggregate}"]["mean"]
                        history.append((step, ours.value(f"vanilla/{aggregate}")))
                        bounds[step] = mean.ratio.hi
                        widths.append(mean.ratio.hi - mean.ratio.lo)
                        trailing += policies[1].trails(history[-1][1], mean.ratio.hi, base_value)
                    for patience, policy in policies.items():
                        stops[patience] += any(policy.decide(history[:k], base_value, None, bounds).stop
                                               for k in range(1, reports + 1))
                name = f"{setting}: {aggregate}, true ratio {ratio:.2f}"
                found[name] = {**{f"stopped, patience {p}": round(n / runs, 3) for p, n in stops.items()},
                               "reports trailing": round(trailing / (runs * reports), 3),
                               "ratio interval width": round(float(np.mean(widths)), 4),
                               f"its true {other} ratio": round(other_ratio, 3)}
                print(f"{name} ({runs} runs of {reports} reports, {time.time() - started:.0f} s): "
                      + ", ".join(f"{k} {v}" for k, v in found[name].items()), flush=True)
    return found


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices=("coverage", "task", "continuity", "stop"),
                   default=["coverage", "task", "continuity", "stop"])
    p.add_argument("--reps", type=int, default=1000, help="simulated caches per coverage setting")
    p.add_argument("--runs", type=int, default=200, help="simulated runs per stop setting")
    p.add_argument("--reports", type=int, default=10, help="reports per simulated run")
    p.add_argument("--stop-models", type=int, default=None, help="how many of the stop part's drafter models (default all)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    parts = {"coverage": lambda: part_coverage(args.reps), "task": lambda: part_task(args.reps // 4),
             "continuity": part_continuity,
             "stop": lambda: part_stop(args.runs, args.reports, args.stop_models)}
    figures = {part: parts[part]() for part in args.part}
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return figures


if __name__ == "__main__":
    main()
