"""Numbers with their uncertainty: a 95% interval for every mean of a report, and the paired
comparison of two reports scored on the same anchors (delta, ratio and a verdict).

How the numbers are made (DESIGN.md): a few tasks (prompts); within a task, a streak at every
anchor of the target's text (dense) and the rounds of the live schedule over it (live).
Neighbouring anchors share most of their context and their label windows overlap, so their
streaks move together (a streak of 5 is followed by one of about 4): resampling anchors one by
one would take 500 correlated anchors for 500 independent ones and give intervals far too
narrow. So the bootstrap respects how the data is made, in two stages:

- Within a task, stretches of its text are resampled: the circular block bootstrap (Politis &
  Romano 1992) over the task's anchor positions, whose resampled mean is centred on the
  task's. A resample takes every anchor in its blocks (dense) or every live round that starts
  in them (live: their mean tau, a ratio of sums). The block length is the one the dense
  taus' own autocorrelation asks for (`block_lengths`: Politis & White 2004, as corrected by
  Patton, Politis & White 2009), per task: long stretches of easy or hard text, long blocks;
  for live, cut so that the positions its rounds span hold `aggregates.LIVE_BLOCKS` blocks (30 rounds can
  span fewer positions than one dense block).
- Across tasks, the tasks are drawn with replacement; each drawn task brings one of its
  within-task resamples. A task's observed mean already carries its within-task noise, so the
  spread of the drawn tasks' means is shrunk by `c`, c^2 = T/(T-1) (1 - w/s^2) (0 when that is
  negative; s^2 the variance of the T task means, w the mean within-task bootstrap variance):
  the resampled run-level mean then has variance s^2/T, the unbiased one, instead of counting
  the within-task noise twice (Davison & Hinkley 1997, section 3.8); where c = 0, w/T. In all
  max(s^2, w) / T, which moves smoothly as s^2 crosses w.
- The 95% percentile interval of the resamples is widened around the estimate by t/z, the
  Student t quantile over the normal one, with T - 1 degrees of freedom, c = 0 or not (the
  spread across tasks is judged from T tasks either way; widening by t over the blocks where
  c = 0 made the width jump there, x2.3 at 3 tasks, and held the truth in 0.88-0.89 of the
  simulated caches with c = 0, docs/numbers.md): Hesterberg's "expanded percentile interval"
  (2015), without which ten tasks give an interval too narrow. A per-task interval is that
  task's within-task resamples, widened with its blocks less one.
- Fewer than MIN_TASKS tasks can not tell the spread across tasks: the run-level interval is
  the within-task one (the drawn tasks' within-task resamples, widened with the blocks less the
  tasks), and `Comparison.verdict` says "too few tasks" instead of judging.

Paired comparison (`paired_comparison`): ours and the other report are resampled together,
the same tasks and the same blocks of text (dense: the very same anchors; live: the rounds of
each that start in the same stretches), so what a task or a stretch of text does to both
cancels in delta = ours - other and ratio = ours / other. The shrinkage is computed per
statistic on its linearisation (delta: the per-task deltas; ratio: (ours_t - r other_t) /
mean other).

Everything is vectorised (numpy) and seeded (SEED and the aggregate's name fix the draws), so
a report's intervals are the same every time they are computed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np

from .aggregates import AGGREGATES, task_streaks
from .methods import Method, Monitor


class EvalReport(Protocol):
    """What the intervals read of a report (`report.EvalReport` is one; report.py computes the intervals a
    report carries with this module, which therefore never imports it)."""

    drafter: str
    tasks: dict[str, dict[str, dict[str, Any]]]

    @property
    def methods(self) -> list[str]: ...

    def max_tau(self, method: str | Method) -> int: ...

    def value(self, monitor: str | Monitor, task: str = "mean") -> float: ...

    def interval(self, monitor: str | Monitor, task: str = "mean") -> tuple[float, float]: ...

CONFIDENCE = 0.95
RESAMPLES = 1000
"""Bootstrap resamples per interval: the 2.5% and 97.5% quantiles rest on 25 resamples each
(their Monte Carlo error is about 4% of the interval's half-width, and the seed fixes it)."""
SEED = 0
MIN_TASKS = 3
"""The fewest tasks a run-level interval is made from. With fewer, the spread across tasks can
not be told from one or two task means (one task: not at all; two: the t quantile with one
degree of freedom is 12.7), so the run-level interval is the within-task one, the text's noise
alone (`Comparison.verdict`: "too few tasks"; the stop does not act on it)."""


@lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at p (1/2 < p < 1) for an integer df >= 1: exact to 1e-12 up to
    df = 200 (the closed-form distribution function of Abramowitz & Stegun 26.7.3-4, solved by
    bisection), the Cornish-Fisher expansion (26.7.5, error below 1e-9) above it."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 1/2 < p < 1 and df >= 1; got p={p}, df={df}")
    if df > 200:
        z = NormalDist().inv_cdf(p)
        terms = [(z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
                 (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
                 (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160]
        return z + sum(term / df ** (i + 1) for i, term in enumerate(terms))

    def central(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(df))
        s, c = math.sin(theta), math.cos(theta)
        if df % 2 == 0:
            total = term = 1.0
            for k in range(1, df // 2):
                term *= c * c * (2 * k - 1) / (2 * k)
                total += term
            return s * total
        total = term = c if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c * c * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + s * total)

    target, lo, hi = 2 * p - 1, 0.0, 1.0
    while central(hi) < target:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if central(mid) < target else (lo, mid)
    return (lo + hi) / 2


def block_lengths(series: np.ndarray) -> np.ndarray:
    """The circular block bootstrap's block length for each row of `series` [A, n] (Politis &
    White 2004 with the correction of Patton, Politis & White 2009): from the autocovariances
    up to twice the lag m after which the autocorrelation stays insignificant for
    max(5, sqrt(log10 n)) lags (a flat-top window), ceil((2 G^2 / D)^(1/3) n^(1/3)), between 1
    and min(3 sqrt(n), n / 3). 1 for a constant row (nothing to resample) and for n < 4."""
    x = np.atleast_2d(np.asarray(series, dtype=np.float64))
    rows, n = x.shape
    centred = x - x.mean(axis=1, keepdims=True)
    varied = np.abs(centred).max(axis=1) > 0
    if n < 4 or not varied.any():
        return np.ones(rows, dtype=np.int64)
    runs = max(5, math.ceil(math.sqrt(math.log10(n))))
    max_lag = min(math.ceil(math.sqrt(n)) + runs, n - 1)
    longest = math.ceil(min(3 * math.sqrt(n), n / 3))
    with np.errstate(all="ignore"):  # a constant row gives 0 / 0 here; it gets 1 at the end
        spectrum = np.fft.rfft(centred, 2 * n, axis=1)
        cov = np.fft.irfft(spectrum * spectrum.conj(), 2 * n, axis=1)[:, : max_lag + 1] / n  # lags 0..max_lag
        small = np.abs(cov[:, 1:]) < 2 * math.sqrt(math.log10(n) / n) * cov[:, :1]  # [:, k - 1]: lag k insignificant
        ran = np.concatenate([np.zeros((rows, 1), dtype=np.int64), np.cumsum(small, axis=1)], axis=1)
        quiet = ran[:, runs:] - ran[:, :-runs] == runs  # [:, m]: lags m+1..m+runs all insignificant
        big = ~small
        # m: the lag after which the correlogram is negligible (else the last significant lag)
        # (n = 4 or 5: fewer lags than `runs`, so no stretch of them can be quiet)
        first_quiet = quiet.argmax(axis=1) if quiet.shape[1] else np.zeros(rows, dtype=np.int64)
        m = np.where(quiet.any(axis=1), first_quiet,
                     np.where(big.any(axis=1), max_lag - big[:, ::-1].argmax(axis=1), 0))
        lags = np.maximum(np.minimum(2 * m, max_lag), 1)[:, None]
        k = np.arange(1, max_lag + 1)[None]
        flat_top = np.minimum(np.maximum(2 * (1 - k / lags), 0), 1)  # 1 up to lag M / 2, then down to 0 at M = 2m
        g = 2 * (flat_top * k * cov[:, 1:]).sum(axis=1)
        spectral = cov[:, 0] + 2 * (flat_top * cov[:, 1:]).sum(axis=1)
        optimal = np.ceil(np.cbrt(1.5 * g * g / (spectral * spectral) * n))  # (2 G^2 / D)^(1/3) n^(1/3)
    # a long-range-correlated short series can give a spectral estimate <= 0: the longest blocks, to be safe
    optimal[~(spectral > 0)] = longest
    return np.where(varied, np.minimum(np.maximum(optimal, 1), longest), 1).astype(np.int64)


def circular_block_sums(series: np.ndarray, length: int, starts: np.ndarray) -> np.ndarray:
    """Sums [A, R] of circular-block resamples of each row of `series` [A, n], all alike:
    block k of resample r holds the `length` values from starts[k, r] on (ints in [0, n),
    [K, R] with K = ceil(n / length)), wrapping past the end; the last block is cut so that a
    resample holds n values."""
    series = np.atleast_2d(np.asarray(series, dtype=np.float64))
    n, blocks = series.shape[1], starts.shape[0]
    if not 1 <= length <= n or blocks != -(-n // length):
        raise ValueError(f"circular_block_sums: {blocks} blocks of {length} do not make {n} values")
    sums = np.concatenate([np.zeros((len(series), 1)), np.cumsum(np.concatenate([series, series[:, :length]], axis=1),
                                                                 axis=1)], axis=1)
    whole = sums[:, length : length + n] - sums[:, :n]  # the sum of the block starting at each position
    last = n - (blocks - 1) * length
    cut = np.take(sums, starts[-1] + last, axis=1) - np.take(sums, starts[-1], axis=1)
    return np.take(whole, starts[:-1], axis=1).sum(axis=1) + cut


@dataclass(frozen=True)
class Estimate:
    """A number and its 95% interval."""

    value: float
    lo: float
    hi: float

    def show(self, percent: bool = False, sign: bool = False) -> str:
        """`mean [lo, hi]`: "5.21 [4.80, 5.63]", as a percentage ("91% [85%, 97%]") or signed."""
        if percent:
            return f"{100 * self.value:.0f}% [{100 * self.lo:.0f}%, {100 * self.hi:.0f}%]"
        form = "+.2f" if sign else ".2f"
        return f"{self.value:{form}} [{self.lo:{form}}, {self.hi:{form}}]"


def _expanded(estimates: np.ndarray, resamples: np.ndarray, dfs: np.ndarray, bounds: np.ndarray) -> list[Estimate]:
    """Per row: the percentile interval of `resamples` [N, R], widened around `estimates` [N]
    by t(df)/z (df < 1: not widened), within `bounds` [N, 2]."""
    tail = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(resamples, [tail, 1 - tail], axis=-1)
    z = NormalDist().inv_cdf(1 - tail)
    widen = np.array([t_quantile(1 - tail, int(df)) / z if df >= 1 else 1.0 for df in dfs])
    low, high = np.asarray(bounds, dtype=np.float64).T
    lo = np.clip(estimates + widen * (lo - estimates), low, high)
    hi = np.clip(estimates + widen * (hi - estimates), low, high)
    return [Estimate(float(e), float(a), float(b)) for e, a, b in zip(estimates, lo, hi)]


class Resampled:
    """The two-stage resamples of A arms over T tasks, all resampled alike (a method of a report; ours and the
    other report's same method): each task's mean and RESAMPLES within-task block resamples of it, the task
    draws, and from them each arm's resampled run-level mean in two parts (between tasks, within tasks), for
    `run_level` to combine.

    Within a task, what is resampled is stretches of the text: blocks of anchor positions.
    A task is given as `values` and `counts` [A, n] over its positions, its mean Σ values /
    Σ counts: dense, every anchor's tau and 1; live, a round's tau and 1 at the anchor where
    the round starts, 0 elsewhere (over the stretch the rounds cover). So the rounds of two
    drafters are paired by where they are in the text, and a resample takes the rounds in
    its blocks. `pooled` (an aggregate with a weight, `aggregates.Aggregate.weight`): the sums are
    what is pooled over tasks, so each arm becomes two, its Σ values (arms 0..A-1) and its Σ counts
    (arms A..2A-1), whose run-level ratio the statistic takes."""

    def __init__(self, tasks: list[tuple[np.ndarray, np.ndarray]], lengths: list[int], rng: np.random.Generator,
                 resamples: int = RESAMPLES, pooled: bool = False):
        """`tasks[t]`: (values, counts) [A, n_t]; `lengths[t]` the task's block length."""
        count, arms = len(tasks), len(tasks[0][0]) * (2 if pooled else 1)
        if pooled:
            self.means = np.array([np.concatenate([values.sum(axis=1), counts.sum(axis=1)])
                                   for values, counts in tasks]).T  # [2A, T]
        else:
            self.means = np.array([values.sum(axis=1) / counts.sum(axis=1) for values, counts in tasks]).T  # [A, T]
        self.within = np.empty((arms, count, resamples))  # [A, T, R]
        self.blocks = np.empty(count, dtype=np.int64)  # [T] blocks per resample of each task
        for t, ((values, counts), length) in enumerate(zip(tasks, lengths)):
            n = values.shape[1]
            length = min(length, n)
            self.blocks[t] = -(-n // length)
            starts = rng.integers(0, n, (self.blocks[t], resamples))
            if pooled:  # a resample of blocks without a round: its task's sums
                found = circular_block_sums(np.concatenate([values, counts]), length, starts)
                empty = found[len(values):] <= 0
                self.within[:, t] = np.where(np.concatenate([empty, empty]), self.means[:, t : t + 1], found)
                continue
            if counts.all():  # dense: every resample holds n anchors
                self.within[:, t] = circular_block_sums(values, length, starts) / n
                continue
            sums, taken = np.split(circular_block_sums(np.concatenate([values, counts]), length, starts), 2)
            with np.errstate(divide="ignore", invalid="ignore"):  # a resample of blocks without a round: its task's mean
                self.within[:, t] = np.where(taken > 0, sums / taken, self.means[:, t : t + 1])
        draws = rng.integers(0, count, (resamples, count))  # [R, T] the tasks drawn
        picks = rng.integers(0, resamples, (resamples, count))  # [R, T] the within-task resample each brings
        drawn = self.means[:, draws]  # [A, R, T]
        self.between = drawn.mean(axis=2) - self.means.mean(axis=1, keepdims=True)  # [A, R]
        self.deviation = (self.within[:, draws, picks] - drawn).mean(axis=2)  # [A, R]

    def run_level(self, statistic: Callable[[np.ndarray], np.ndarray], gradients: np.ndarray,
                  bounds: np.ndarray) -> list[Estimate]:
        """S statistics of the arms' run-level means (the means over tasks; `statistic` maps
        [A, ...] to [S, ...]) with their intervals; `gradients` [S, A] are their derivatives at
        the estimate, which set each one's shrinkage of the between-task part (the module's doc);
        `bounds` [S, 2] the legal range of each."""
        count, size = self.means.shape[1], len(gradients)
        mean = self.means.mean(axis=1)
        if count < MIN_TASKS:  # the within-task interval alone: the text's noise, not the spread across tasks
            shrink, dfs = np.zeros(size), np.full(size, int((self.blocks - 1).sum()))
        else:  # always t(T - 1): the spread across tasks is estimated from T tasks whether or not c is 0
            shrink, dfs = self.shrinkage(statistic, gradients), np.full(size, count - 1)
        combined = mean[:, None, None] + shrink[None, :, None] * self.between[:, None] + self.deviation[:, None]
        resampled = statistic(combined)[np.arange(size), np.arange(size)]  # statistic s of the arms shrunk for s
        return _expanded(statistic(mean), resampled, dfs, bounds)

    def shrinkage(self, statistic: Callable[[np.ndarray], np.ndarray], gradients: np.ndarray) -> np.ndarray:
        """c of each of the S statistics (the module's doc; T >= 2): c^2 = T/(T-1) (1 - w/s^2), 0
        where s^2 <= w, so that the resampled run-level mean has the variance max(s^2, w) / T."""
        count = self.means.shape[1]
        spread = (gradients @ self.means).var(axis=1, ddof=1)
        noise = np.einsum("sa,atr->str", gradients, self.within).var(axis=2, ddof=1).mean(axis=1)
        # the jackknife over tasks: s^2 / T for a mean, and a ratio's curvature besides
        left_out = statistic((self.means.sum(axis=1, keepdims=True) - self.means) / (count - 1))
        spread = np.maximum(spread, count * (count - 1) * left_out.var(axis=1))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(spread > noise, np.sqrt(count / (count - 1) * (1 - noise / spread)), 0.0)

    def per_task(self, statistic: Callable[[np.ndarray], np.ndarray], bounds: np.ndarray) -> list[list[Estimate]]:
        """The S statistics of each task's means with their intervals (that task's within-task
        resamples): [S][T]."""
        estimates, resampled = statistic(self.means), statistic(self.within)  # [S, T], [S, T, R]
        size, count = estimates.shape
        found = _expanded(estimates.ravel(), resampled.reshape(size * count, -1), np.tile(self.blocks - 1, size),
                          np.repeat(np.asarray(bounds, dtype=np.float64), count, axis=0))
        return [found[s * count : (s + 1) * count] for s in range(size)]


def taus(report: EvalReport, task: str, method: str) -> np.ndarray:
    """The tau of every anchor of a task (from the streaks the report keeps; their expectation where the draft
    is sampled, `aggregates.Streaks`)."""
    numbers = report.tasks[task][method]
    if "streaks" not in numbers:
        raise ValueError(f"the report of {report.drafter} keeps no per-anchor streaks (it was written before scorer "
                         "version 4): score it again for intervals")
    return task_streaks(numbers, report.max_tau(method)).mean_streaks + 1


def positions(arms: list[tuple[EvalReport, str]], task: str,
              aggregates: list[str] | None = None) -> tuple[dict[str, int], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A task's block length for each aggregate (default: all) and `Resampled`'s (values, counts) over its
    positions for each (`aggregates.Aggregate.series`); `arms` are (report, method) pairs scored on the same
    anchors. The text's dependence, in positions: the longest block the arms' dense taus ask for
    (`block_lengths`)."""
    dense = np.stack([taus(report, task, method) for report, method in arms])  # [A, n]
    kept = [(report.tasks[task][method], task_streaks(report.tasks[task][method], report.max_tau(method)))
            for report, method in arms]
    length = int(block_lengths(dense).max())
    found = {name: AGGREGATES[name].series(dense, kept, length) for name in aggregates or AGGREGATES}
    return {name: f[0] for name, f in found.items()}, {name: (f[1], f[2]) for name, f in found.items()}


def _rng(seed: int, aggregate: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(aggregate.encode())])


def _resampled(arms: list[tuple[EvalReport, str]], tasks: list[str], seed: int, resamples: int,
               aggregates: list[str] | None = None) -> dict[str, Resampled]:
    """Per aggregate (default: all), the arms resampled alike over `tasks`, drawn from the seed and the aggregate's
    name alone: the same arms give the same resamples whatever else a report holds."""
    names = list(aggregates or AGGREGATES)
    found = [positions(arms, task, names) for task in tasks]
    return {agg: Resampled([series[agg] for _, series in found], [lengths[agg] for lengths, _ in found],
                           _rng(seed, agg), resamples, pooled=AGGREGATES[agg].weight is not None)
            for agg in names}


def arm_values(aggregate: str, arms: int) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    """(each arm's number from `Resampled.means`-shaped means [A or 2A, ...], its gradient [A, A or 2A] at a mean
    [A or 2A]): the means themselves, or for a pooled aggregate each arm's Σ values / Σ counts."""
    if AGGREGATES[aggregate].weight is None:
        return (lambda means: means), (lambda mean: np.eye(arms))

    def gradient(mean: np.ndarray) -> np.ndarray:
        out = np.zeros((arms, 2 * arms))
        out[np.arange(arms), np.arange(arms)] = 1 / mean[arms:]
        out[np.arange(arms), arms + np.arange(arms)] = -mean[:arms] / mean[arms:] ** 2
        return out

    return (lambda means: means[:arms] / means[arms:]), gradient


def report_intervals(report: EvalReport, resamples: int = RESAMPLES, seed: int = SEED,
                     aggregates: list[str] | None = None) -> dict:
    """The intervals a report carries (`EvalReport.intervals`): {"confidence", "resamples",
    "seed", "mean": {METHOD: {AGG: [lo, hi]}}, "tasks": {TASK: {METHOD: {AGG: [lo, hi]}}}}, of every aggregate
    (or those named). Each method is resampled on its own, from the seed and the aggregate alone: its interval
    is a function of its numbers on the cache, whatever else the report scores."""
    out = {"confidence": CONFIDENCE, "resamples": resamples, "seed": seed, "mean": {m: {} for m in report.methods},
           "tasks": {task: {m: {} for m in report.methods} for task in report.tasks}}
    for method in report.methods:
        bounds = [(1.0, float(report.max_tau(method)))]
        for aggregate, resampled in _resampled([(report, method)], list(report.tasks), seed, resamples,
                                               aggregates).items():
            value, gradient = arm_values(aggregate, 1)
            overall = resampled.run_level(value, gradient(resampled.means.mean(axis=1)), bounds)[0]
            per_task = resampled.per_task(value, bounds)[0]
            # 4 decimals: well inside the resampling's own error, half the bytes
            out["mean"][method][aggregate] = [round(overall.lo, 4), round(overall.hi, 4)]
            for task, one in zip(report.tasks, per_task):
                out["tasks"][task][method][aggregate] = [round(one.lo, 4), round(one.hi, 4)]
    return out


@dataclass(frozen=True)
class Comparison:
    """Ours against another report on one monitor and task ("mean": the run level, over `tasks`
    tasks; None: not said)."""

    monitor: str
    task: str
    delta: Estimate  # ours - other
    ratio: Estimate  # ours / other
    tasks: int | None = None

    @property
    def too_few_tasks(self) -> bool:
        """A run-level comparison over fewer than MIN_TASKS tasks: its interval is the within-task one."""
        return self.task == "mean" and self.tasks is not None and self.tasks < MIN_TASKS

    @property
    def verdict(self) -> str:
        """"ahead" or "behind" when the whole ratio interval is above or below 1, else "not
        distinguishable"; "too few tasks" at the run level over fewer than MIN_TASKS tasks."""
        if self.too_few_tasks:
            return "too few tasks"
        return "ahead" if self.ratio.lo > 1 else "behind" if self.ratio.hi < 1 else "not distinguishable"

    def says(self, other: str = "the baseline") -> str:
        """The verdict in plain words: "behind the baseline", "ahead of the baseline", "not
        distinguishable from the baseline at this cache size", or "no verdict: 2 tasks are too
        few to tell (at least 3); the interval is the within-task one"."""
        if self.too_few_tasks:
            return (f"no verdict: {self.tasks} task{'s are' if self.tasks != 1 else ' is'} too few to tell "
                    f"(at least {MIN_TASKS}); the interval is the within-task one")
        return {"ahead": f"ahead of {other}", "behind": f"behind {other}",
                "not distinguishable": f"not distinguishable from {other} at this cache size"}[self.verdict]


def paired_comparison(ours: EvalReport, other: EvalReport, resamples: int = RESAMPLES,
                      seed: int = SEED) -> dict[str, dict[str, Comparison]]:
    """Ours against `other` (the baseline, or another drafter) scored on the same anchors: for
    each monitor (METHOD/AGG, the methods both score) and each task and "mean", the delta and
    the ratio with their paired intervals. ValueError when the two do not hold the same tasks,
    or a task's anchors differ (another cache, window or block size)."""
    if sorted(ours.tasks) != sorted(other.tasks):
        raise ValueError(f"the reports hold other tasks ({sorted(ours.tasks)} and {sorted(other.tasks)}): "
                         "a paired comparison needs the same tasks")
    tasks = list(ours.tasks)
    methods = [m for m in ours.methods if m in other.methods]
    if not methods:
        raise ValueError(f"the reports score no method in common ({ours.methods} and {other.methods})")
    uneven = [t for t in tasks if ours.tasks[t][methods[0]].get("anchors") != other.tasks[t][methods[0]].get("anchors")]
    if uneven:
        raise ValueError(f"tasks {uneven} were scored on other anchors in the two reports (another cache, window or "
                         "block size): a paired comparison needs the same anchors")
    out: dict[str, dict[str, Comparison]] = {}
    for method in methods:  # each pair on its own: the same draws whatever else the reports score
        out.update(_paired([(ours, method), (other, method)], tasks, resamples, seed))
    return out


def method_comparison(report: EvalReport, ours: str, other: str, aggregate: str, resamples: int = RESAMPLES,
                      seed: int = SEED) -> Comparison:
    """Two methods of one report (e.g. `vanilla` against `vanilla:vllm-as-written`), paired as two reports
    are (`paired_comparison`: the same tasks and stretches of text): the run-level delta and ratio of
    `aggregate`, ours - other and ours / other, named by `ours`."""
    paired = _paired([(report, ours), (report, other)], list(report.tasks), resamples, seed, [aggregate])
    return paired[f"{ours}/{aggregate}"]["mean"]


def _paired(arms: list[tuple[EvalReport, str]], tasks: list[str], resamples: int, seed: int,
            aggregates: list[str] | None = None) -> dict[str, dict[str, Comparison]]:
    """The paired comparison of two arms (report, method), for each aggregate (default: all), at the run level
    ("mean") and per task, named by the first arm's method."""
    (ours, method), (other, theirs) = arms
    top = float(max(ours.max_tau(method), other.max_tau(theirs)))
    bounds = [(1 - top, top - 1), (1 / top, top)]
    out: dict[str, dict[str, Comparison]] = {}
    for aggregate, resampled in _resampled(arms, tasks, seed, resamples, aggregates).items():
        value, gradient = arm_values(aggregate, 2)

        def delta_and_ratio(means: np.ndarray, value=value) -> np.ndarray:
            both = value(means)
            return np.stack([both[0] - both[1], both[0] / both[1]])

        mean = resampled.means.mean(axis=1)
        o, b = value(mean)
        grads = gradient(mean)  # d(ours, other) / d(means)
        gradients = np.stack([grads[0] - grads[1], grads[0] / b - o / b**2 * grads[1]])
        overall = resampled.run_level(delta_and_ratio, gradients, bounds)
        per_task = resampled.per_task(delta_and_ratio, bounds)
        monitor = f"{method}/{aggregate}"
        out[monitor] = {"mean": Comparison(monitor, "mean", overall[0], overall[1], len(tasks))}
        for task, delta, ratio in zip(tasks, per_task[0], per_task[1]):
            out[monitor][task] = Comparison(monitor, task, delta, ratio)
    return out


def interval_below(comparison: Comparison, min_ratio: float | None = None, min_delta: float | None = None) -> bool:
    """The stop's test (`confidence` on): the whole ratio interval lies below `min_ratio` (or,
    for a delta threshold, the whole delta interval below `min_delta`); give exactly one. Never
    over fewer than MIN_TASKS tasks (`Comparison.too_few_tasks`)."""
    if (min_ratio is None) == (min_delta is None):
        raise ValueError("interval_below takes exactly one of min_ratio and min_delta")
    if comparison.too_few_tasks:  # no run-level interval: nothing lies below anything
        return False
    return comparison.ratio.hi < min_ratio if min_ratio is not None else comparison.delta.hi < min_delta


def tasks_to_resolve(baseline: EvalReport, monitor: str, min_ratio: float) -> int | None:
    """About how many tasks the baseline's own interval on `monitor` needs to be no wider
    (half-width relative to its mean) than the margin 1 - min_ratio; None when it already is.
    The half-width scales as t(T-1) / sqrt(T): the expanded interval's own rule."""
    monitor = Monitor.parse(monitor)
    lo, hi = baseline.interval(monitor)
    value, count, margin = baseline.value(monitor), len(baseline.tasks), 1 - min_ratio
    half = (hi - lo) / 2 / value
    if half <= margin or margin <= 0:  # min_ratio >= 1: no margin below the baseline for the rule to measure
        return None

    def scale(tasks: int) -> float:
        t = t_quantile(1 - (1 - CONFIDENCE) / 2, tasks - 1) / t_quantile(1 - (1 - CONFIDENCE) / 2, count - 1) \
            if count > 1 else 1.0
        return t * math.sqrt(count / tasks)

    # scale falls as tasks grow (t falls, sqrt grows): the first count that resolves it, by bisection from
    # the normal quantile's answer (t > z: no fewer tasks can do), in O(log tasks) steps, not one per task
    z = NormalDist().inv_cdf(1 - (1 - CONFIDENCE) / 2)
    t_now = t_quantile(1 - (1 - CONFIDENCE) / 2, count - 1) if count > 1 else z
    low = max(count + 1, math.ceil(count * (half * z / t_now / margin) ** 2))  # scale(low - 1) > margin / half
    if half * scale(low) <= margin:
        return low
    high = 2 * low
    while half * scale(high) > margin:
        low, high = high, 2 * high
    while high - low > 1:  # scale(low) too wide, scale(high) resolves it
        mid = (low + high) // 2
        low, high = (mid, high) if half * scale(mid) > margin else (low, mid)
    return high


def resolution_warning(baseline: EvalReport, monitor: str, min_ratio: float) -> str | None:
    """The setup warning: one line when the cache is too small to ever resolve `min_ratio` on
    `monitor` (the baseline's own interval half-width, relative to its mean, is larger than the
    margin 1 - min_ratio), saying about how many tasks it would take, or that fewer than
    MIN_TASKS tasks give no run-level interval to judge; None when it resolves it."""
    larger = "e.g. `extract --tasks coding50`" if len(baseline.tasks) < 50 else "a task YAML of your own"
    if len(baseline.tasks) < MIN_TASKS:
        return (f"the cache's {len(baseline.tasks)} task{'s are' if len(baseline.tasks) > 1 else ' is'} too few for a "
                f"run-level interval (at least {MIN_TASKS}): the stop judges no report (a larger task set: {larger})")
    needed = tasks_to_resolve(baseline, monitor, min_ratio)
    if needed is None:
        return None
    lo, hi = baseline.interval(monitor)
    value = baseline.value(monitor)
    return (f"the cache's {len(baseline.tasks)} tasks can not resolve min_ratio={float(min_ratio)!r} on {monitor}: the "
            f"baseline's own 95% interval, {value:.2f} [{lo:.2f}, {hi:.2f}], is +-{50 * (hi - lo) / value:.0f}% of "
            f"its mean, wider than the {100 * (1 - min_ratio):.2g}% margin; about {needed} tasks would resolve it "
            f"(a larger task set: {larger}); the stop still runs")
