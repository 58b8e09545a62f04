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

What the interval's width is made of (two more tables; the JSON's "spread"). From the live requests, y_ij the
mean tau per round of request j to prompt i (n_i requests with a round; `--runs` each, less any whose first
token was EOS):
- the variance decomposition of y (one-way random effects, by the method of moments): within-prompt
  sigma_w^2 = sum_i sum_j (y_ij - ybar_i)^2 / sum_i (n_i - 1), the variance between requests to one prompt;
  between-prompt sigma_b^2 = max(0, var(ybar_i) - sigma_w^2 * mean_i(1 / n_i)), the variance of the prompts'
  own served tau (the variance of the prompt means, less what their within part puts in it); and
  sigma_b^2 / (sigma_b^2 + sigma_w^2), the between-prompt share of one request's variance;
- the floor: the width hi - lo of the Student-t 95% interval (`served_live.mean_interval`) of the mean of
  S requests per prompt, every request one task (10 S values, 10 S - 1 degrees of freedom: as the report's
  interval counts a cache's answers), at S = 1 and S = `--samples`, averaged over the `--runs` ways to pick them:
  pick g takes requests g, g + 1, ..., g + S - 1 of each prompt, modulo the fewest requests a prompt has
  (`--runs`, unless a request began with EOS), with the smallest and largest of the widths. That is the width of served tau measured directly, with no estimator, on as many
  served answers as the cache holds. For argmax drafts a request's acceptances are fixed by its text (the
  emitted token equals the draft exactly when the draft was accepted), so y is a function of the text alone
  and the floor is the sampled text's own variation; the offline widths are shown as ratios to it
  (conditional `live` and `dense`, coin `live`, and the pre-issue-35 `live`). `floor30` is the same over
  each request's first 30 rounds, the quantity the pre-issue default (`max_rounds: 30`) scored;
- of each offline report (conditional, coins, pre-issue) and aggregate (live, dense), the two parts of
  `scoring/intervals.py`'s two-stage bootstrap: s^2, the variance of the task means (ddof 1), and w, the
  mean over tasks of the within-task block-bootstrap variance of the task's mean (its own seeded draws
  of `intervals.Resampled`, not the report's; the run-level variance is max(s^2, w) / tasks), and
  `t_width`, the width of the Student-t interval of the same task numbers (the floor's rule, no bootstrap);
- with `--samples` > 1, the same decomposition of each offline report's task numbers (live, dense), the
  cache's answers grouped by their prompt (`Sampling.answer_names`): for the conditional estimators, which
  are functions of the text alone, the between-prompt part is the variation no estimator on these prompts
  removes, whatever it computes from each answer and however many answers it is given.

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

import numpy as np
import torch

from dflash_callbacks import TargetHead, load_drafter
from dflash_callbacks.cache.extract import extract_cache, load_target
from dflash_callbacks.cache.sampling import SAMPLING_KEYS, Sampling
from dflash_callbacks.demos.toy.dflash2 import toy_dflash2_drafter
from dflash_callbacks.demos.toy.world import (
    TOY_LAYER_IDS, build_toy_cache, build_toy_training_cache, toy_baseline_path, toy_target_path,
)
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.intervals import RESAMPLES, SEED, Resampled, positions
from dflash_callbacks.scoring.scorer import score_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the live loop: a test oracle
from served_live import live_runs, live_tau, mean_interval  # noqa: E402
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


def per_prompt(runs, rounds: int | None = None) -> list[list[float]]:
    """Each prompt's requests' mean tau per round (over their first `rounds` rounds; all if None), in the
    loop's order; a request without a round has no tau and is left out."""
    groups: dict[str, list[float]] = {}
    for r in runs:
        if r.taus:
            taus = r.taus[:rounds]
            groups.setdefault(r.task, []).append(sum(taus) / len(taus))
    return list(groups.values())


def decomposition(groups: list[list[float]]) -> dict | None:
    """{"between", "within", "between_share"}: the method-of-moments variance components of the requests'
    taus (the module's doc); None with fewer than 2 requests to every prompt or fewer than 2 prompts."""
    if len(groups) < 2 or min(len(g) for g in groups) < 2:
        return None
    means = np.array([np.mean(g) for g in groups])
    within = sum(((np.array(g) - m) ** 2).sum() for g, m in zip(groups, means)) / sum(len(g) - 1 for g in groups)
    between = max(0.0, means.var(ddof=1) - within * np.mean([1 / len(g) for g in groups]))
    total = between + within
    return {"between": float(between), "within": float(within), "between_share": float(between / total) if total else 0.0}


def floor(groups: list[list[float]], per_prompt: int) -> dict | None:
    """{"mean", "min", "max"} of the floor's widths (the module's doc): S = `per_prompt` requests to each prompt,
    the Student-t interval over all of them, pick g taking requests g..g+S-1 (mod the fewest a prompt has);
    None when a prompt has fewer than S requests or there are fewer than 2 values."""
    have = min(len(g) for g in groups)
    if per_prompt > have or len(groups) * per_prompt < 2:
        return None
    widths = []
    for g in range(have):
        _, lo, hi = mean_interval([group[(g + k) % have] for group in groups for k in range(per_prompt)])
        widths.append(hi - lo)
    return {"mean": float(np.mean(widths)), "min": min(widths), "max": max(widths)}


def task_spread(report, aggregate: str) -> dict:
    """{"s2", "w"} of vanilla's `aggregate` in `report`: the two parts of the report's two-stage bootstrap."""
    found = [positions([(report, "vanilla")], task, [aggregate]) for task in report.tasks]
    resampled = Resampled([series[aggregate] for _, series in found], [lengths[aggregate] for lengths, _ in found],
                          np.random.default_rng(SEED), RESAMPLES)
    _, lo, hi = mean_interval(resampled.means[0].tolist())
    return {"s2": float(resampled.means[0].var(ddof=1)), "w": float(resampled.within[0].var(axis=1, ddof=1).mean()),
            "t_width": hi - lo}


def offline_groups(report, prompts: list[str], aggregate: str) -> list[list[float]]:
    """vanilla's `aggregate` of each answer in `report`, grouped by prompt (the cache's names of its answers)."""
    sampling = Sampling(**{k: report.sampling[k] for k in SAMPLING_KEYS}) if report.sampling else Sampling()
    return [[report.value(f"vanilla/{aggregate}", name) for name in sampling.answer_names(p)] for p in prompts]


def spread(runs, reports: dict, samples: int) -> dict:
    """What the widths are made of (the module's doc): the decomposition, the floors, and each report's parts."""
    groups = per_prompt(runs)
    prompts = list(dict.fromkeys(r.task for r in runs))
    floors = {"1": floor(groups, 1), str(samples): floor(groups, samples)}
    floors30 = {"1": floor(per_prompt(runs, 30), 1), str(samples): floor(per_prompt(runs, 30), samples)}
    return {"decomposition": decomposition(groups), "floor": floors, "floor30": floors30,
            "report_parts": {name: {agg: {**task_spread(report, agg),
                                          "decomposition": decomposition(offline_groups(report, prompts, agg))}
                                    for agg in ("live", "dense")} for name, report in reports.items()}}


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
        "samples": args.samples if T > 0 else 1,
        "spread": spread(runs, {"conditional": report, "coins": coins, "before": before}, args.samples if T > 0 else 1),
    }


def print_spread(rows: list[dict]) -> None:
    """The second table: what the widths are made of (the module's doc)."""
    print("\nwhat the widths are made of: the live requests' variance components, the floor (the t interval's width "
          "of served tau measured on S requests per prompt, mean [min, max] over the picks), and the offline widths "
          "at S answers per prompt over the floor at S")
    print("| T | sigma_b^2 | sigma_w^2 | between share | floor, S = 1 | floor, S = samples | floor30, S = samples | "
          "conditional live / floor | conditional dense / floor | coin live / floor | pre-issue live / floor30 | "
          "pre-issue live / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, s, S = r["spread"]["decomposition"], r["spread"], str(r["samples"])
        fl, fl30 = s["floor"][S], s["floor30"][S]
        show = lambda f: "-" if f is None else f"{f['mean']:.3f} [{f['min']:.3f}, {f['max']:.3f}]"  # noqa: E731
        ratio = lambda v, f: "-" if f is None else f"{(v[2] - v[1]) / f['mean']:.2f}"  # noqa: E731
        parts = ("-", "-", "-") if d is None else \
            (f"{d['between']:.5f}", f"{d['within']:.5f}", f"{d['between_share']:.2f}")
        print(f"| {r['temperature']:g} | {' | '.join(parts)} | {show(s['floor']['1'])} | {show(fl)} (S = {S}) | "
              f"{show(fl30)} | {ratio(r['offline_live'], fl)} | {ratio(r['offline_dense'], fl)} | "
              f"{ratio(r['coins_live'], fl)} | {ratio(r['before_live'], fl30)} | {ratio(r['before_live'], fl)} |")
    print("\nthe report's two parts (s^2: the variance of the task means; w: the mean within-task bootstrap variance)")
    print("and, with several answers per prompt, the same decomposition of the task numbers (sigma_b^2, sigma_w^2, "
          "between share)")
    print("and the width of the t interval over the same task numbers, over the floor at S")
    print("| T | estimators | live s^2 | live w | live t width / floor | live sigma_b^2, sigma_w^2 (share) | "
          "dense s^2 | dense w | dense t width / floor | dense sigma_b^2, sigma_w^2 (share) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = r["spread"]["floor"][str(r["samples"])]
        for name, parts in r["spread"]["report_parts"].items():
            cells = []
            for agg in ("live", "dense"):
                d = parts[agg]["decomposition"]
                cells += [f"{parts[agg]['s2']:.5f}", f"{parts[agg]['w']:.5f}",
                          "-" if fl is None else f"{parts[agg]['t_width'] / fl['mean']:.2f}",
                          "-" if d is None else f"{d['between']:.5f}, {d['within']:.5f} ({d['between_share']:.2f})"]
            print(f"| {r['temperature']:g} | {name} | {' | '.join(cells)} |")


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
    print_spread(rows)
    print("reproduce: python " + " ".join(shlex.quote(a) for a in sys.argv))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
