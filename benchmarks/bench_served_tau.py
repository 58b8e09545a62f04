"""tau as served at a temperature: the live speculative-sampling loop against the offline scorer.

On the toy world (the toy target, the toy baseline drafter, the coding10 prompts), per
temperature T (top-p `--top-p`):
- live: `served_live.live_runs` (tests/support), `--runs` requests per prompt decoded with speculative
  sampling at the served settings (argmax drafts, as vLLM's DFlash proposer), and the mean
  over requests of each one's mean tau per round, with its Monte-Carlo 95% interval (Student t);
- offline: `score_drafter` (vanilla) on a cache of `--samples` answers per prompt sampled at
  the same settings (`extract_cache(temperature=...)`): its `live` mean (the exact estimate of
  the live loop's) and `dense` mean, with the report's 95% intervals; the whole answer is scored
  (`max_rounds` = `--max-new-tokens`), as the live loop decodes it whole;
- teacher-forced: `teacher_forced.teacher_forced_tau` (tests/support) along the greedy coding10 cache,
  1 + sum_k prod_{j<=k} (1 - TV(p_j, q_j)), the approximation trainers log;
- with `--sample-rule`, also the live loop with drafts drawn from the drafter's tempered
  distribution (the draft rule 1 - TV is the acceptance chance of), to split the teacher-forced
  number's bias into the text's part and the draft rule's.

With `--family dflash2` the drafter is the toy DFlash 2 (`demos.toy.dflash2`: the toy baseline's backbone
and a selector trained `--dflash2-steps` steps on 64 answers to held-out requests), served as vLLM serves
it: its selector walk sampled at T, verified with q over its candidates (the live loop's "sample" rule);
offline, the scorer's expected streaks (dense) and its live schedule on a seeded draw of the acceptance
coins (live); no teacher-forced column (that estimate reads DFlash's logits).

    python benchmarks/bench_served_tau.py [--temperatures 0.7 1.0] [--top-p 0.95] [--runs 5] [--samples 5] [--sample-rule]
    python benchmarks/bench_served_tau.py --family dflash2 --temperatures 1.0
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash_callbacks import TargetHead, load_drafter
from dflash_callbacks.cache.extract import extract_cache, load_target
from dflash_callbacks.cache.sampling import Sampling
from dflash_callbacks.demos.toy.dflash2 import toy_dflash2_drafter
from dflash_callbacks.demos.toy.world import (
    TOY_LAYER_IDS, build_toy_cache, build_toy_training_cache, toy_baseline_path, toy_target_path,
)
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the live loop: a test oracle
from served_live import live_runs, live_tau  # noqa: E402
from teacher_forced import teacher_forced_tau  # noqa: E402


def toy_drafter(args: argparse.Namespace):
    if args.family == "dflash":
        return load_drafter(toy_baseline_path())
    training = build_toy_training_cache(args.out / "dflash2-train-64x128", n_sequences=64, seq_len=128, progress=False)
    return toy_dflash2_drafter(training.path, steps=args.dflash2_steps)


def live_se(runs) -> float:
    """The Monte-Carlo standard error of the live loop's mean (`live_tau`'s statistic)."""
    values = [sum(r.taus) / len(r.taus) for r in runs if r.taus]
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def row(T: float, args: argparse.Namespace, drafter) -> dict:
    target = toy_target_path()
    sampling = Sampling(T, args.top_p) if T > 0 else Sampling()
    started = time.perf_counter()
    rule = "argmax" if args.family == "dflash" else "sample"  # as vLLM serves each by default
    runs = live_runs(target, drafter, "coding10", sampling, runs_per_prompt=args.runs, max_new_tokens=args.max_new_tokens,
                     seed=args.seed, draft_rule=rule)
    live_s = time.perf_counter() - started
    live = live_tau(runs)

    started = time.perf_counter()
    cache = extract_cache(target, args.out / f"sampled-T{T:g}-p{args.top_p:g}-x{args.samples}-n{args.max_new_tokens}",
                          "coding10", TOY_LAYER_IDS, max_new_tokens=args.max_new_tokens, progress=False,
                          temperature=T, top_p=args.top_p if T > 0 else 1.0, samples=args.samples if T > 0 else 1,
                          seed=args.seed + 1)
    config = ScoringConfig(ddtree_budgets=[], device="cpu")  # the whole answer, as the live loop decodes it
    report = score_drafter(drafter, cache, TargetHead.from_pretrained(target), config)
    offline_s = time.perf_counter() - started
    mean, interval = report.mean["vanilla"], report.intervals["mean"]["vanilla"]
    coins = score_drafter(drafter, cache, TargetHead.from_pretrained(target), replace(config, estimators="coins"))
    coins_mean, coins_interval = coins.mean["vanilla"], coins.intervals["mean"]["vanilla"]
    before = score_drafter(drafter, cache, TargetHead.from_pretrained(target),  # the defaults before issue 35
                           replace(config, estimators="coins", max_rounds=30))
    before_mean, before_interval = before.mean["vanilla"], before.intervals["mean"]["vanilla"]

    forced = None
    if args.family == "dflash":
        greedy = build_toy_cache(args.out / f"greedy-n{args.max_new_tokens}", max_new_tokens=args.max_new_tokens)
        model, _ = load_target(target)
        with torch.no_grad():
            forced = teacher_forced_tau(model, drafter, greedy, sampling)
    sample_rule = offline_sample_rule = None
    if args.sample_rule and args.family == "dflash":  # and offline: the probabilistic draft rule's expected streaks
        sample_rule = list(live_tau(live_runs(target, drafter, "coding10", sampling, runs_per_prompt=args.runs,
                                              max_new_tokens=args.max_new_tokens, seed=args.seed, draft_rule="sample")))
        probabilistic = score_drafter(drafter, cache, TargetHead.from_pretrained(target),
                                      replace(config, draft_rule="probabilistic"))
        offline_sample_rule = [probabilistic.mean["vanilla"]["live"], *probabilistic.intervals["mean"]["vanilla"]["live"]]
    return {
        "sample_rule": sample_rule, "offline_sample_rule": offline_sample_rule,
        "temperature": T, "top_p": args.top_p, "live": list(live), "offline_live": [mean["live"], *interval["live"]],
        "offline_dense": [mean["dense"], *interval["dense"]], "teacher_forced": forced,
        "estimators": report.estimators, "coins_estimators": coins.estimators,
        "coins_live": [coins_mean["live"], *coins_interval["live"]],
        "coins_dense": [coins_mean["dense"], *coins_interval["dense"]],
        "live_mc_se": live_se(runs),
        "before_live": [before_mean["live"], *before_interval["live"]],
        "before_dense": [before_mean["dense"], *before_interval["dense"]],
        "pooled": [mean["pooled"], *interval["pooled"]], "coins_pooled": [coins_mean["pooled"], *coins_interval["pooled"]],
        "rounds": sum(len(r.taus) for r in runs), "live_runs": len(runs), "offline_tasks": len(cache),
        "prompts": 10, "live_seconds": live_s, "offline_seconds": offline_s,
        "live_inside_offline": interval["live"][0] <= live[0] <= interval["live"][1],
    }


def main() -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--runs", type=int, default=5, help="live requests per prompt")
    p.add_argument("--samples", type=int, default=5, help="sampled answers per prompt in the offline cache")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0, help="the live loop's seed; the cache's is seed + 1")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the toy is fastest on 1)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-served-tau"), help="caches are kept here")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--sample-rule", action="store_true", help="also run the live loop drawing drafts from the drafter")
    p.add_argument("--family", choices=("dflash", "dflash2"), default="dflash",
                   help="the toy baseline (DFlash), or the toy DFlash 2 (demos.toy.dflash2)")
    p.add_argument("--dflash2-steps", type=int, default=40, help="training steps of the toy DFlash 2")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    drafter = toy_drafter(args)
    name = "toy baseline" if args.family == "dflash" else f"toy DFlash 2 ({args.dflash2_steps} steps)"
    print(f"{name} on coding10, top-p {args.top_p}, {args.max_new_tokens} new tokens; 95% intervals")
    print("| T | live mean [MC interval] | offline live [interval] | offline dense [interval] | teacher-forced "
          "tau_probabilistic | rounds | prompts (live runs / offline answers) | seconds (live / offline) |"
          + (" live, sample rule [MC interval] | offline live, probabilistic [interval] |" if args.sample_rule else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if args.sample_rule else ""))
    for T in args.temperatures:
        r = row(T, args, drafter)
        rows.append(r)
        fmt = lambda v: f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"  # noqa: E731
        forced = "-" if r["teacher_forced"] is None else f"{r['teacher_forced']:.3f}"
        print(f"| {T:g} | {fmt(r['live'])} | {fmt(r['offline_live'])} | {fmt(r['offline_dense'])} | "
              f"{forced} | {r['rounds']} | {r['prompts']} ({r['live_runs']} / {r['offline_tasks']}) | "
              f"{r['live_seconds']:.0f} / {r['offline_seconds']:.0f} |"
              + (f" {fmt(r['sample_rule'])} | {fmt(r['offline_sample_rule'])} |" if r["sample_rule"] else ""), flush=True)
    print("reproduce: python " + " ".join(shlex.quote(a) for a in sys.argv))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
