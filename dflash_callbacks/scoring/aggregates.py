"""Per-task aggregates of per-anchor streaks (DESIGN.md, "Aggregates per task"), as a registry.

The scorer gives one method's streak for every scored anchor of a task, in anchor order:
`streaks[i]` belongs to anchor `first_anchor + i`. tau = streak + 1. An aggregate (`AGGREGATES`:
name -> `Aggregate`) says how a task's number is made from them (`value`), which stretches of the
text its interval resamples (`series`, `intervals.py`), and how the strict report reader holds a
stored number to the streaks it came from (`check`); every number lies within 1 and the method's
largest tau. Adding an aggregate is one entry here and its tests: the report, the intervals, the
logged keys, the monitors and the watchers iterate over the registry.

- `dense`: mean tau over all scored anchors.
- `live`: the schedule live speculative decoding follows on the target's text: a0 = first_anchor,
  a <- a + streak(a) + 1, until a leaves the scored anchors (the answer's end) or, where set, `max_rounds`
  rounds are done; the mean tau of those rounds (`live_rounds`).
- `pooled`: the number a serving engine prints, vLLM's "Mean acceptance length", 1 + accepted / drafts
  summed over every round of every answer: the whole live schedule of each task (never cut at
  `max_rounds`; its last round ends at the answer's end, as a streak never counts a label past the
  text), pooled over the tasks. A task's own number is its schedule's mean tau and its weight its count of
  rounds (`rounds`), so the run-level number is sum(taus) / sum(rounds) over every task
  (`Aggregate.run_level`), where `dense` and `live` weigh each task the same.

Where the drafter's proposal is sampled (DFlash 2's selector walk at T > 0, a probabilistic draft
rule), a slot's acceptance given the served text is a coin, not a fact: a method's `Streaks` then
carry, beside the integer streaks (`drawn`: a seeded draw of the coins, what `live` runs along), the
expected streak at each anchor (`expected`: sum_k prod_{j<=k} P(slot j accepted), what `dense`
averages). Where it is not (an argmax proposal), `expected` is None and `drawn` is exact.

Also `acceptance_curve` (for d = 1..max_depth, the share of anchors with streak >= d) and the
streaks as a report keeps them (`encode_streaks` / `decode_streaks`): each streak as base-36 digits
(0-9, a-z), as many per anchor as the largest tau needs (one up to 36), side by side in one string.
One byte per anchor, plain JSON that needs no escaping, readable by eye ("a9876543210" is a streak of
10 counting down), decoded in one vectorised step. Expected streaks are kept the same way in
thousandths of a token (`encode_expected` / `decode_expected`, `EXPECTED_SCALE`): every number of
the report is made from the kept values, so the strict reader can hold it to them.

numpy only: streaks may be a torch tensor (CPU) or any integer array.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..checks import check_int


def _check_streaks(streaks) -> np.ndarray:
    values = np.asarray(streaks)
    if values.ndim != 1:
        raise ValueError(f"streaks must be a 1-D array [n_anchors]; got {type(streaks).__name__} {tuple(values.shape)}")
    if values.size == 0:
        raise ValueError("streaks is empty: a task needs at least one scored anchor")
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"streaks must hold integers; got dtype {getattr(streaks, 'dtype', values.dtype)}")
    if values.min() < 0:
        raise ValueError(f"streaks must be >= 0; got a minimum of {int(values.min())}")
    return values.astype(np.int64)


EXPECTED_SCALE = 1000
"""Expected streaks are kept in units of 1 / EXPECTED_SCALE of a token."""


@dataclass(frozen=True)
class Streaks:
    """One task's per-anchor streaks of one method, in anchor order. `drawn`: int64 [n] the streak at each
    anchor (the argmax's run of true tokens, or, where the draft is sampled, a seeded draw of the acceptance
    coins); `expected`: float64 [n] the expected streak where the draft is sampled (None: `drawn` is exact)."""

    drawn: np.ndarray
    expected: np.ndarray | None = None
    visits: np.ndarray | None = None
    """float64 [n] how often the live schedule takes each anchor in expectation over the acceptance coins, on a
    cache that keeps the served support (`acceptance.expected_visits`; None: the schedule runs along `drawn`)."""

    @classmethod
    def of(cls, streaks) -> Streaks:
        """`streaks` as Streaks (integer streaks of an argmax proposal are taken as they are)."""
        return streaks if isinstance(streaks, Streaks) else cls(_check_streaks(streaks))

    @property
    def mean_streaks(self) -> np.ndarray:
        """float64 [n]: the streak each anchor has in expectation (the drawn one where it is exact)."""
        return self.drawn.astype(np.float64) if self.expected is None else self.expected


def dense_tau(streaks) -> float:
    """Mean of streak + 1 over all scored anchors."""
    return float((_check_streaks(streaks).astype(np.float64) + 1.0).mean())


def live_rounds(streaks, first_anchor: int, max_rounds: int | None = None) -> list[int]:
    """The tau of each round of the live schedule starting at `first_anchor`: `streaks[a - first_anchor]`
    is the streak at anchor a. Rounds stop when the next anchor is past the last scored one, or after
    `max_rounds` (>= 1; None: no limit) rounds."""
    values = _check_streaks(streaks).tolist()
    check_int("first_anchor", first_anchor, 0)
    check_int("max_rounds", max_rounds, 1, optional=True)
    limit = len(values) if max_rounds is None else max_rounds
    taus, anchor = [], first_anchor
    while anchor - first_anchor < len(values) and len(taus) < limit:
        tau = values[anchor - first_anchor] + 1
        taus.append(tau)
        anchor += tau
    return taus


def live_tau(streaks, first_anchor: int, max_rounds: int | None = None) -> float:
    """Mean tau over the rounds of `live_rounds` (at least one round always runs)."""
    taus = live_rounds(streaks, first_anchor, max_rounds)
    return sum(taus) / len(taus)


def acceptance_curve(streaks, max_depth: int) -> list[float]:
    """For d = 1..max_depth (>= 1): the share of anchors whose streak is >= d."""
    values = _check_streaks(streaks)
    check_int("max_depth", max_depth, 1)
    return (values[None, :] >= np.arange(1, max_depth + 1)[:, None]).mean(axis=1).tolist()


# ------------------------------------------------------------------ the registry
LIVE_BLOCKS = 3
"""A task's live rounds are resampled in at least this many blocks of text (`Aggregate.series`)."""


def schedule(streaks: Streaks) -> tuple[np.ndarray, np.ndarray]:
    """The whole live schedule of a task, anchor by anchor: (visits [n], taus [n]) float64, visits[i] how often
    the schedule takes anchor first_anchor + i as a round's anchor (1 or 0 along the drawn streaks) and taus[i]
    the tau it counts there. `pooled` is sum(visits * taus) / sum(visits). Where the streaks carry expected
    visits (the conditional estimators), those and the expected taus."""
    if streaks.visits is not None:
        return streaks.visits, streaks.mean_streaks + 1.0
    drawn = streaks.drawn
    visits = np.zeros(drawn.size)
    anchor = 0
    while anchor < drawn.size:
        visits[anchor] = 1.0
        anchor += int(drawn[anchor]) + 1
    return visits, drawn.astype(np.float64) + 1.0


@dataclass(frozen=True)
class Aggregate:
    name: str
    help: str
    value: Callable[[Streaks, int, int | None], float]
    """(streaks, first_anchor, max_rounds) -> the task's number."""
    series: Callable[[np.ndarray, list[tuple[dict, Streaks]], int], tuple[int, np.ndarray, np.ndarray]]
    """(taus [A, n] of A arms scored on the same anchors (the expected taus where a draft is sampled), each arm's
    (stored numbers of the task, streaks), the block length the dense taus ask for) -> (its block length, values
    [A, m], counts [A, m]): the intervals resample blocks of these positions, a task's mean being sum(values) /
    sum(counts)."""
    check: Callable[[dict, Streaks, float | None], str | None]
    """(a task's stored numbers of one method, its streaks, max_rounds: an int, math.inf for none (to the answer's
    end), None where not known) -> why they do not follow, or None."""
    weight: str | None = None
    """The task field that weighs a task in the run-level number, sum(weight * value) / sum(weight) (the series'
    sums pooled over tasks, what the intervals then resample); None: every task weighs the same."""

    def run_level(self, numbers: list[dict]) -> float:
        """The run-level number from each task's stored numbers of one method."""
        if self.weight is None:
            return sum(n[self.name] for n in numbers) / len(numbers)
        return sum(n[self.weight] * n[self.name] for n in numbers) / sum(n[self.weight] for n in numbers)


def _dense_series(taus: np.ndarray, arms: list[tuple[dict, Streaks]], length: int) -> tuple[int, np.ndarray, np.ndarray]:
    return length, taus, np.ones_like(taus)


def _round_series(taus: np.ndarray, rounds: list[np.ndarray], length: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Each round's tau at the position where it starts: the rounds of two drafters are paired by where they
    are in the text, and a resample takes the rounds that start in its blocks. The block is the dense one
    (the text's dependence, in positions), cut so that the positions the rounds span hold LIVE_BLOCKS."""
    values, counts, span = np.zeros_like(taus), np.zeros_like(taus), 1
    for a, taken in enumerate(rounds):
        starts = np.concatenate([[0], np.cumsum(taken)[:-1]]).astype(np.int64)  # a round's anchor, from the first
        values[a, starts], counts[a, starts] = taken, 1
        span = max(span, min(taus.shape[1], int(taken.sum())))
    return max(1, min(length, span // LIVE_BLOCKS)), values[:, :span], counts[:, :span]


def _live_series(taus: np.ndarray, arms: list[tuple[dict, Streaks]], length: int) -> tuple[int, np.ndarray, np.ndarray]:
    if any(streaks.visits is not None for _, streaks in arms):  # the expected schedule: pooled's series
        return _pooled_series(taus, arms, length)
    return _round_series(taus, [np.asarray(n["live_rounds"], dtype=np.float64) for n, _ in arms], length)


def _pooled_series(taus: np.ndarray, arms: list[tuple[dict, Streaks]], length: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The whole schedule's visits and taus at each anchor (`schedule`), over the anchors it spans."""
    found = [schedule(streaks) for _, streaks in arms]
    values, counts = np.stack([v * t for v, t in found]), np.stack([v for v, _ in found])
    ends = [int(np.ceil(i + t[i])) for v, t in found for i in np.flatnonzero(v)[-1:]]  # past each last round
    span = max(1, min(taus.shape[1], max(ends)))
    return max(1, min(length, span // LIVE_BLOCKS)), values[:, :span], counts[:, :span]


def _dense_value(streaks: Streaks, first_anchor: int, max_rounds: int | None) -> float:
    return float(streaks.mean_streaks.mean()) + 1.0


def _live_value(streaks: Streaks, first_anchor: int, max_rounds: int | None) -> float:
    if streaks.visits is not None:  # the expected schedule to the answer's end (the scorer keeps none with max_rounds)
        return pooled_numbers(streaks)[0]
    return live_tau(streaks.drawn, first_anchor, max_rounds)


def pooled_numbers(streaks: Streaks) -> tuple[float, float]:
    """(the task's pooled number, its weight `rounds`): the whole schedule's mean tau and its count of rounds."""
    visits, taus = schedule(streaks)
    rounds = float(visits.sum())
    return float((visits * taus).sum()) / rounds, rounds


def _pooled_value(streaks: Streaks, first_anchor: int, max_rounds: int | None) -> float:
    return pooled_numbers(streaks)[0]


def _check_dense(numbers: dict, streaks: Streaks, max_rounds: int | None) -> str | None:
    mean = float(streaks.mean_streaks.mean()) + 1
    if not math.isclose(numbers["dense"], mean, rel_tol=1e-9):
        kind = "streaks'" if streaks.expected is None else "expected streaks'"
        return f"'dense' is {numbers['dense']!r}; the {kind} mean tau is {mean!r}"
    return None


def _check_live(numbers: dict, streaks: Streaks, max_rounds: int | None) -> str | None:
    kept, streaks_visits = streaks, streaks.visits
    rounds, anchor, streaks = numbers.get("live_rounds", []), 0, streaks.drawn
    for i, tau in enumerate(rounds):
        if anchor >= len(streaks) or tau != streaks[anchor] + 1:
            return (f"'live_rounds'[{i}] is {tau}; the live schedule over the streaks "
                    + ("has ended there" if anchor >= len(streaks) else f"gives {int(streaks[anchor]) + 1}"))
        anchor += tau
    if max_rounds is not None and (len(rounds) > max_rounds or (anchor < len(streaks) and len(rounds) < max_rounds)):
        limit = "to the answer's end" if max_rounds == math.inf else f"at most max_rounds={max_rounds}"
        return (f"'live_rounds' holds {len(rounds)} rounds; the live schedule over the streaks, {limit}, "
                f"has {'fewer' if len(rounds) > max_rounds else 'more'}")
    if streaks_visits is not None:
        expected = pooled_numbers(kept)[0]
        if not math.isclose(numbers["live"], expected, rel_tol=1e-9):
            return f"'live' is {numbers['live']!r}; the expected live schedule's mean tau is {expected!r}"
    elif rounds and not math.isclose(numbers["live"], sum(rounds) / len(rounds), rel_tol=1e-9):
        return f"'live' is {numbers['live']!r}; the mean of 'live_rounds' is {sum(rounds) / len(rounds)!r}"
    return None


def _check_pooled(numbers: dict, streaks: Streaks, max_rounds: int | None) -> str | None:
    value, rounds = pooled_numbers(streaks)
    if not math.isclose(numbers.get("rounds", math.nan), rounds, rel_tol=1e-9):
        return f"'rounds' is {numbers.get('rounds')!r}; the whole live schedule over the streaks has {rounds!r}"
    if not math.isclose(numbers["pooled"], value, rel_tol=1e-9):
        return f"'pooled' is {numbers['pooled']!r}; the whole live schedule's mean tau is {value!r}"
    return None


AGGREGATES: dict[str, Aggregate] = {a.name: a for a in (
    Aggregate("dense", "mean tau over every scored anchor (its expectation where the draft is sampled)",
              _dense_value, _dense_series, _check_dense),
    Aggregate("live", "mean tau of the rounds live speculative decoding runs along the text (a seeded draw of the "
                      "acceptance coins where the draft is sampled)", _live_value, _live_series, _check_live),
    Aggregate("pooled", "the number vLLM prints as its mean acceptance length: 1 + accepted / drafts over every "
                        "round of every answer (the whole live schedule of each task, pooled over the tasks)",
              _pooled_value, _pooled_series, _check_pooled, weight="rounds"),
)}


def task_numbers(streaks: Streaks, first_anchor: int, max_rounds: int | None) -> dict:
    """Every aggregate of one task and method, its live rounds and the pooled weight (`rounds`), as a report
    keeps them (without the curve and the encoded streaks)."""
    out = {name: aggregate.value(streaks, first_anchor, max_rounds) for name, aggregate in AGGREGATES.items()}
    out.update(live_rounds=live_rounds(streaks.drawn, first_anchor, max_rounds), rounds=pooled_numbers(streaks)[1])
    return out


# ------------------------------------------------------------------ the streaks as a report keeps them
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_DIGIT_VALUE = np.full(256, -1, dtype=np.int64)
_DIGIT_VALUE[np.frombuffer(DIGITS.encode(), dtype=np.uint8)] = np.arange(len(DIGITS))


def streak_width(max_tau: int) -> int:
    """Base-36 digits per anchor: enough for the largest streak, max_tau - 1 (a DFlash block of B: B - 1)."""
    check_int("max_tau", max_tau, 2)
    width, top = 1, len(DIGITS)
    while top < max_tau:  # streaks 0..max_tau-1 need max_tau values
        width, top = width + 1, top * len(DIGITS)
    return width


def encode_streaks(streaks, max_tau: int) -> str:
    """The streaks of one task and method as `streak_width(max_tau)` base-36 digits each."""
    values = _check_streaks(streaks)
    if values.max() > max_tau - 1:
        raise ValueError(f"streaks must be at most max_tau - 1 = {max_tau - 1}; got {int(values.max())}")
    width = streak_width(max_tau)
    digits = (values[:, None] // len(DIGITS) ** np.arange(width - 1, -1, -1)) % len(DIGITS)
    return np.frombuffer(DIGITS.encode(), dtype=np.uint8)[digits].tobytes().decode()


def decode_streaks(text: str, max_tau: int) -> np.ndarray:
    """`encode_streaks`' string back to int64 streaks; ValueError saying what is wrong with a string that is
    not one (a character outside 0-9a-z, a length that is not a whole number of anchors, a streak above
    max_tau - 1)."""
    width = streak_width(max_tau)
    if not isinstance(text, str) or not text or not text.isascii() or len(text) % width:
        raise ValueError(f"is not a non-empty string of base-36 digits, {width} per anchor")
    digits = _DIGIT_VALUE[np.frombuffer(text.encode(), dtype=np.uint8)].reshape(-1, width)
    if (digits < 0).any():
        raise ValueError("holds a character other than the base-36 digits 0-9 and a-z")
    # 13 digits (taus past 36**12) can exceed int64: Python integers there
    powers = np.array([len(DIGITS) ** k for k in range(width - 1, -1, -1)], dtype=object if width > 12 else np.int64)
    values = digits.astype(powers.dtype) @ powers
    if values.max() > max_tau - 1:
        raise ValueError(f"holds the streak {int(values.max())}, above max_tau - 1 = {max_tau - 1}")
    return values.astype(np.int64)


def encode_expected(expected, max_tau: int) -> str:
    """Expected streaks (floats from 0 to max_tau - 1) in thousandths of a token (`EXPECTED_SCALE`, rounded to
    the nearest), as `encode_streaks` keeps integers."""
    values = np.asarray(expected, dtype=np.float64)
    if values.ndim != 1 or not values.size or not np.isfinite(values).all() or values.min() < 0 \
            or values.max() > max_tau - 1:
        raise ValueError(f"expected streaks must be a non-empty 1-D array of numbers from 0 to {max_tau - 1}")
    return encode_streaks(np.rint(values * EXPECTED_SCALE).astype(np.int64), (max_tau - 1) * EXPECTED_SCALE + 1)


def quantize_expected(expected) -> np.ndarray:
    """The expected streaks as a report keeps them (`encode_expected`, read back): float64."""
    return np.rint(np.asarray(expected, dtype=np.float64) * EXPECTED_SCALE) / EXPECTED_SCALE


def decode_expected(text: str, max_tau: int) -> np.ndarray:
    """`encode_expected`'s string back to float64 expected streaks; ValueError for a string that is not one."""
    return decode_streaks(text, (max_tau - 1) * EXPECTED_SCALE + 1).astype(np.float64) / EXPECTED_SCALE


def task_streaks(numbers: dict, max_tau: int) -> Streaks:
    """The Streaks a report keeps for one task and method (`streaks`, `expected` where the draft is sampled or the
    cache keeps the served support, and `visits` there, in thousandths as `encode_expected` keeps them);
    ValueError naming the field that is not what it must be."""
    try:
        drawn = decode_streaks(numbers["streaks"], max_tau)
    except ValueError as e:
        raise ValueError(f"'streaks' {e}") from None
    if "expected" not in numbers:
        return Streaks(drawn)
    try:
        expected = decode_expected(numbers["expected"], max_tau)
    except ValueError as e:
        raise ValueError(f"'expected' {e}") from None
    if len(expected) != len(drawn):
        raise ValueError(f"'expected' holds {len(expected)} anchors; 'streaks' holds {len(drawn)}")
    if "visits" not in numbers:
        return Streaks(drawn, expected)
    try:
        visits = decode_expected(numbers["visits"], 2)
    except ValueError as e:
        raise ValueError(f"'visits' {e}") from None
    if len(visits) != len(drawn) or visits[0] != 1:
        raise ValueError(f"'visits' holds {len(visits)} anchors from {visits[0]!r}; the live schedule starts at the "
                         f"first of the {len(drawn)} anchors")
    return Streaks(drawn, expected, visits)
