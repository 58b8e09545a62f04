"""Intervals (scoring/intervals.py): the pieces against plain references, coverage on simulated
caches whose true mean tau is known, and the toy world's baseline against itself and against
a worse drafter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dflash_callbacks.scoring.aggregates import encode_streaks, live_rounds
from dflash_callbacks.scoring.intervals import (
    RESAMPLES, Estimate, Resampled, block_lengths, circular_block_sums, interval_below, paired_comparison,
    report_intervals, resolution_warning, t_quantile, tasks_to_resolve,
)
from dflash_callbacks.scoring.report import EvalReport

# ----- a simulated cache whose truth is known ---------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """Streaks drawn the way a cache makes them. The text has a difficulty z at every position
    (an AR(1) process: stretches of easy and hard text), shifted per task by a task effect
    ~ N(0, task_sd); the drafter accepts depth d at anchor a when z[a + d] + task effect +
    noise > offset + slope (d - 1), and the streak is the run of accepted depths from d = 1.
    Neighbouring anchors read the same positions, so their streaks move together (a streak
    of 5 is followed by one of about 4). Two drafters (`offsets`) read the same text, and
    share half their noise: what pairs them."""

    tasks: int = 10
    anchors: int = 150
    block_size: int = 8
    task_sd: float = 0.5
    rho: float = 0.9
    noise: float = 0.3
    slope: float = 0.35
    offsets: tuple[float, ...] = (0.3, 0.0)  # ours, the baseline's (lower: better)

    def streaks(self, rng: np.random.Generator, reps: int, tasks: int | None = None) -> np.ndarray:
        """int streaks [drafters, reps, tasks, anchors]."""
        tasks = tasks or self.tasks
        length = self.anchors + self.block_size
        shocks = rng.standard_normal((reps, tasks, length))
        z = np.empty_like(shocks)
        z[..., 0] = shocks[..., 0]
        for j in range(1, length):
            z[..., j] = self.rho * z[..., j - 1] + math.sqrt(1 - self.rho**2) * shocks[..., j]
        z += self.task_sd * rng.standard_normal((reps, tasks, 1))
        reads = z[..., np.arange(self.anchors)[:, None] + np.arange(1, self.block_size)]  # [reps, tasks, anchors, B-1]
        shared = rng.standard_normal(reads.shape)
        out = []
        for offset in self.offsets:
            noise = self.noise * math.sqrt(0.5) * (shared + rng.standard_normal(reads.shape))
            accepted = reads + noise > offset + self.slope * np.arange(self.block_size - 1)
            out.append(np.cumprod(accepted, axis=-1).sum(axis=-1))
        return np.stack(out)


def report_of(streaks: np.ndarray, block_size: int, max_rounds: int = 30, name: str = "sim") -> EvalReport:
    """A report of one method ("vanilla") over tasks [tasks, anchors] of streaks, as the scorer makes it."""
    tasks = {}
    for i, row in enumerate(torch.from_numpy(streaks)):
        rounds = live_rounds(row, 0, max_rounds)
        tasks[f"t{i}"] = {"vanilla": {"dense": float(row.double().mean() + 1), "live": sum(rounds) / len(rounds),
                                      "curve": [], "live_rounds": rounds, "anchors": len(row),
                                      "streaks": encode_streaks(row, block_size)}}
    return EvalReport(drafter=name, cache={"path": "sim", "fingerprint": "sim"}, block_size=block_size, tasks=tasks,
                      scoring={"max_rounds": max_rounds})


def truths(model: Model, seed: int = 12345, tasks: int = 8000, max_rounds: int = 30) -> dict[str, float]:
    """The population means (over task effects and text), by a large simulation: ours' dense and
    live mean tau and the ratios ours / baseline."""
    streaks = model.streaks(np.random.default_rng(seed), 1, tasks)[:, 0]  # [drafters, tasks, anchors]
    dense = (streaks + 1).mean(axis=(1, 2))
    live = np.array([[np.mean(live_rounds(torch.from_numpy(row), 0, max_rounds)) for row in drafter]
                     for drafter in streaks]).mean(axis=1)
    return {"dense": dense[0], "live": live[0], "dense ratio": dense[0] / dense[1], "live ratio": live[0] / live[1]}


def coverage(model: Model, reps: int, seed: int) -> dict[str, float]:
    """How often the intervals of `reps` simulated caches hold the truth: ours' run-level mean
    and the paired ratio (dense and live), and a naive i.i.d. bootstrap of the anchors, tasks
    pooled, of ours' dense mean."""
    truth = truths(model)
    rng = np.random.default_rng(seed)
    streaks = model.streaks(rng, reps)
    hits = dict.fromkeys(["dense", "live", "dense ratio", "live ratio", "iid dense"], 0)
    for rep in range(reps):
        ours, base = (report_of(streaks[d, rep], model.block_size, name=n) for d, n in ((0, "ours"), (1, "base")))
        own = report_intervals(ours)["mean"]["vanilla"]
        paired = paired_comparison(ours, base)
        for agg in ("dense", "live"):
            lo, hi = own[agg]
            hits[agg] += lo <= truth[agg] <= hi
            ratio = paired[f"vanilla/{agg}"]["mean"].ratio
            hits[f"{agg} ratio"] += ratio.lo <= truth[f"{agg} ratio"] <= ratio.hi
        anchors = (streaks[0, rep] + 1.0).ravel()
        naive = anchors[rng.integers(0, anchors.size, (RESAMPLES, anchors.size))].mean(axis=1)
        lo, hi = np.quantile(naive, [0.025, 0.975])
        hits["iid dense"] += lo <= truth["dense"] <= hi
    return {k: v / reps for k, v in hits.items()}
