"""Simulated caches whose truth is known, for the intervals' tests and benchmarks/bench_intervals.py:
`Model` draws streaks the way a cache makes them, `report_of` makes a report of them as the scorer
does, `truths` gives the population means, and `coverage` how often the intervals hold them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dflash_callbacks.scoring import intervals
from dflash_callbacks.scoring.aggregates import Streaks, encode_streaks, live_rounds, task_numbers
from dflash_callbacks.scoring.intervals import RESAMPLES, paired_comparison, report_intervals
from dflash_callbacks.scoring.report import EvalReport


@dataclass(frozen=True)
class Model:
    """Streaks drawn the way a cache makes them. The text has a difficulty z at every position
    (an AR(1) process: stretches of easy and hard text), shifted per task by a task effect
    ~ N(0, task_sd) (or, with `task_df`, Student's t with that many degrees of freedom, scaled
    to the same sd: heavy tails); the drafter accepts depth d at anchor a when z[a + d] + task
    effect + noise > offset + slope (d - 1), and the streak is the run of accepted depths from
    d = 1. Neighbouring anchors read the same positions, so their streaks move together (a
    streak of 5 is followed by one of about 4). Two drafters (`offsets`) read the same text,
    and share half their noise: what pairs them."""

    tasks: int = 10
    anchors: int = 150
    block_size: int = 8
    task_sd: float = 0.5
    rho: float = 0.9
    noise: float = 0.3
    slope: float = 0.35
    offsets: tuple[float, ...] = (0.3, 0.0)  # ours, the baseline's (lower: better)
    task_df: int | None = None

    def text(self, rng: np.random.Generator, reps: int, tasks: int | None = None) -> np.ndarray:
        """What each anchor reads: the difficulty [reps, tasks, anchors, B - 1] at depths 1 to B - 1."""
        tasks = tasks or self.tasks
        length = self.anchors + self.block_size
        shocks = rng.standard_normal((reps, tasks, length))
        z = np.empty_like(shocks)
        z[..., 0] = shocks[..., 0]
        for j in range(1, length):
            z[..., j] = self.rho * z[..., j - 1] + math.sqrt(1 - self.rho**2) * shocks[..., j]
        if self.task_df is None:
            z += self.task_sd * rng.standard_normal((reps, tasks, 1))
        else:
            unit = rng.standard_t(self.task_df, (reps, tasks, 1)) / math.sqrt(self.task_df / (self.task_df - 2))
            z += self.task_sd * unit
        return z[..., np.arange(self.anchors)[:, None] + np.arange(1, self.block_size)]

    def accept(self, reads: np.ndarray, offset: float, shared: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The streaks of a drafter at `offset` over `reads`, its noise half `shared`, half its own."""
        noise = self.noise * math.sqrt(0.5) * (shared + rng.standard_normal(reads.shape))
        accepted = reads + noise > offset + self.slope * np.arange(self.block_size - 1)
        return np.cumprod(accepted, axis=-1).sum(axis=-1)

    def streaks(self, rng: np.random.Generator, reps: int, tasks: int | None = None) -> np.ndarray:
        """int streaks [drafters, reps, tasks, anchors]."""
        reads = self.text(rng, reps, tasks)
        shared = rng.standard_normal(reads.shape)
        return np.stack([self.accept(reads, offset, shared, rng) for offset in self.offsets])


def report_of(streaks, block_size: int, max_rounds: int = 30, name: str = "sim") -> EvalReport:
    """A report of one method ("vanilla") over tasks of streaks ([tasks, anchors], or a list of
    rows of any lengths), as the scorer makes it."""
    tasks = {}
    for i, row in enumerate(torch.as_tensor(np.asarray(one)) for one in streaks):
        numbers = task_numbers(Streaks.of(row), 0, max_rounds)
        tasks[f"t{i}"] = {"vanilla": {**numbers, "curve": [], "anchors": len(row),
                                      "streaks": encode_streaks(row, block_size)}}
    return EvalReport(drafter=name, cache={"path": "sim", "fingerprint": "sim"}, block_size=block_size, tasks=tasks,
                      scoring={"max_rounds": max_rounds})


def live_means(streaks: np.ndarray, max_rounds: int = 30) -> np.ndarray:
    """The live mean tau of each row of `streaks` [..., anchors]."""
    rows = np.asarray(streaks).reshape(-1, np.shape(streaks)[-1])
    found = [np.mean(live_rounds(torch.from_numpy(row), 0, max_rounds)) for row in rows]
    return np.array(found).reshape(np.shape(streaks)[:-1])


def truths(model: Model, seed: int = 12345, tasks: int = 5000, max_rounds: int = 30) -> dict[str, float]:
    """The population means (over task effects and text), by a large simulation: ours' dense and
    live mean tau and (two drafters) the ratios ours / baseline."""
    streaks = model.streaks(np.random.default_rng(seed), 1, tasks)[:, 0]  # [drafters, tasks, anchors]
    dense = (streaks + 1).mean(axis=(1, 2))
    live = live_means(streaks, max_rounds).mean(axis=1)
    found = {"dense": dense[0], "live": live[0]}
    if len(model.offsets) > 1:
        found.update({"dense ratio": dense[0] / dense[1], "live ratio": live[0] / live[1]})
    return found


def ratio_shrinkage(ours: EvalReport, other: EvalReport, resamples: int = RESAMPLES) -> dict[str, float]:
    """c of the paired run-level ratio ours / other for each aggregate, as `paired_comparison`
    computes it (the same draws): 0 where the spread of the task ratios is within-task noise."""
    found = {}
    for aggregate, resampled in intervals._resampled([(ours, "vanilla"), (other, "vanilla")], list(ours.tasks),
                                                     intervals.SEED, resamples, ["dense", "live"]).items():
        mean = resampled.means.mean(axis=1)
        gradient = np.array([[1 / mean[1], -mean[0] / mean[1] ** 2]])
        found[aggregate] = float(resampled.shrinkage(lambda means: (means[0] / means[1])[None], gradient)[0])
    return found


def coverage(model: Model, reps: int, seed: int, naive_reps: int = 100, resamples: int = RESAMPLES) -> dict[str, float]:
    """How often the intervals of `reps` simulated caches hold the truth: ours' run-level mean
    and the paired ratio (dense and live), the ratio's also among the caches where its c is 0
    ("dense ratio | c=0", with "dense ratio c=0" the share of those caches), and, on the first
    `naive_reps`, a naive i.i.d. bootstrap of the anchors, tasks pooled, of ours' dense mean."""
    truth = truths(model)
    rng = np.random.default_rng(seed)
    streaks = model.streaks(rng, reps)
    hits = dict.fromkeys(["dense", "live", "dense ratio", "live ratio", "iid dense"], 0)
    zero = dict.fromkeys(["dense ratio | c=0", "live ratio | c=0"], 0)
    counts = dict.fromkeys(["dense ratio c=0", "live ratio c=0"], 0)
    for rep in range(reps):
        ours, base = (report_of(streaks[d, rep], model.block_size, name=n) for d, n in ((0, "ours"), (1, "base")))
        own = report_intervals(ours, resamples=resamples)["mean"]["vanilla"]
        paired = paired_comparison(ours, base, resamples=resamples)
        shrink = ratio_shrinkage(ours, base, resamples) if model.tasks >= intervals.MIN_TASKS else {}
        for agg in ("dense", "live"):
            lo, hi = own[agg]
            hits[agg] += lo <= truth[agg] <= hi
            ratio = paired[f"vanilla/{agg}"]["mean"].ratio
            held = ratio.lo <= truth[f"{agg} ratio"] <= ratio.hi
            hits[f"{agg} ratio"] += held
            if shrink.get(agg) == 0:
                counts[f"{agg} ratio c=0"] += 1
                zero[f"{agg} ratio | c=0"] += held
        if rep < naive_reps:
            anchors = (streaks[0, rep] + 1.0).ravel()
            naive = anchors[rng.integers(0, anchors.size, (RESAMPLES, anchors.size))].mean(axis=1)
            lo, hi = np.quantile(naive, [0.025, 0.975])
            hits["iid dense"] += lo <= truth["dense"] <= hi
    naive = min(naive_reps, reps)
    found = {k: v / reps for k, v in hits.items() if k != "iid dense"}
    found["iid dense"] = hits["iid dense"] / naive if naive else math.nan
    for key, held in zero.items():
        caches = counts[key.replace(" | ", " ")]
        found[key] = held / caches if caches else math.nan
    found.update({k: v / reps for k, v in counts.items()})
    return found


def spread_scan(tasks: int, spreads: np.ndarray, seed: int = 11) -> list[dict[str, float]]:
    """Ours' dense run-level mean over `tasks` tasks of one simulated cache, each task's taus
    moved to the same mean and then apart so that the task means have each of `spreads` as
    their standard deviation (the same text, the same draws every time): per spread, the
    between-task shrinkage c, the interval's width and the blocks per resample (summed over
    tasks), across the spread where c reaches 0."""
    taus = Model(tasks=tasks, rho=0.7, task_sd=0.0, offsets=(-0.5,)).streaks(np.random.default_rng(seed), 1)[0, 0] + 1.0
    taus += taus.mean() - taus.mean(axis=1, keepdims=True)  # every task's mean the same: spread 0
    effects = np.random.default_rng(seed + 1).standard_normal(tasks)
    effects = (effects - effects.mean()) / effects.std(ddof=1)
    found = []
    for spread in spreads:
        moved = taus + spread * effects[:, None]
        resampled = intervals.Resampled([(row[None], np.ones((1, len(row)))) for row in moved], [4] * tasks,
                                        np.random.default_rng(0))
        (one,) = resampled.run_level(lambda means: means, np.eye(1), [(-np.inf, np.inf)])
        found.append({"spread": float(spread), "c": float(resampled.shrinkage(lambda means: means, np.eye(1))[0]),
                      "width": one.hi - one.lo, "blocks": int(resampled.blocks.sum())})
    return found
