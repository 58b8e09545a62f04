"""Per-task aggregates of per-anchor streaks (DESIGN.md, "Aggregates per task").

The scorer gives one method's streak for every scored anchor of a task, in anchor
order: `streaks[i]` belongs to anchor `first_anchor + i`. tau = streak + 1.

- `dense_tau`: mean tau over all scored anchors.
- `live_rounds` / `live_tau`: the schedule live speculative decoding follows on the
  target's greedy text: a0 = first_anchor, a <- a + streak(a) + 1, until a leaves the
  scored anchors or `max_rounds` rounds are done; the tau of each round / their mean.
- `acceptance_curve`: for d = 1..max_depth, the share of anchors with streak >= d.
- `encode_streaks` / `decode_streaks`: the streaks as a report keeps them, for the
  intervals (`intervals.py`): each streak as base-36 digits (0-9, a-z), as many per
  anchor as `block_size - 1` needs (one for block sizes up to 36), side by side in one
  string. One byte per anchor, plain JSON that needs no escaping, readable by eye
  ("a9876543210" is a streak of 10 counting down), decoded in one vectorised step.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import check_int


def _check_streaks(streaks: torch.Tensor) -> torch.Tensor:
    if not isinstance(streaks, torch.Tensor) or streaks.dim() != 1:
        raise ValueError(
            f"streaks must be a 1-D tensor [n_anchors]; got {type(streaks).__name__} "
            f"{tuple(getattr(streaks, 'shape', ()))}"
        )
    if streaks.numel() == 0:
        raise ValueError("streaks is empty: a task needs at least one scored anchor")
    if streaks.is_floating_point() or streaks.is_complex() or streaks.dtype == torch.bool:
        raise ValueError(f"streaks must hold integers; got dtype {streaks.dtype}")
    if streaks.min() < 0:
        raise ValueError(f"streaks must be >= 0; got a minimum of {int(streaks.min())}")
    return streaks


def dense_tau(streaks: torch.Tensor) -> float:
    """Mean of streak + 1 over all scored anchors."""
    streaks = _check_streaks(streaks)
    return float((streaks.double() + 1.0).mean())


def live_rounds(streaks: torch.Tensor, first_anchor: int, max_rounds: int) -> list[int]:
    """The tau of each round of the live schedule starting at `first_anchor`.

    `streaks[a - first_anchor]` is the streak at anchor a. Rounds stop when the next
    anchor is past the last scored one, or after `max_rounds` (>= 1) rounds.
    """
    streaks = _check_streaks(streaks)
    check_int("first_anchor", first_anchor, 0)
    check_int("max_rounds", max_rounds, 1)
    values = streaks.tolist()
    taus = []
    anchor = first_anchor
    while anchor - first_anchor < len(values) and len(taus) < max_rounds:
        tau = values[anchor - first_anchor] + 1
        taus.append(tau)
        anchor += tau
    return taus


def live_tau(streaks: torch.Tensor, first_anchor: int, max_rounds: int) -> float:
    """Mean tau over the rounds of `live_rounds` (at least one round always runs)."""
    taus = live_rounds(streaks, first_anchor, max_rounds)
    return sum(taus) / len(taus)


def acceptance_curve(streaks: torch.Tensor, max_depth: int) -> list[float]:
    """For d = 1..max_depth (>= 1): the share of anchors whose streak is >= d."""
    streaks = _check_streaks(streaks)
    check_int("max_depth", max_depth, 1)
    depths = torch.arange(1, max_depth + 1, device=streaks.device)
    return (streaks.unsqueeze(0) >= depths.unsqueeze(1)).double().mean(dim=1).tolist()


DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_DIGIT_VALUE = np.full(256, -1, dtype=np.int64)
_DIGIT_VALUE[np.frombuffer(DIGITS.encode(), dtype=np.uint8)] = np.arange(len(DIGITS))


def streak_width(block_size: int) -> int:
    """Base-36 digits per anchor: enough for the largest streak, block_size - 1."""
    check_int("block_size", block_size, 2)
    width, top = 1, len(DIGITS)
    while top < block_size:  # streaks 0..block_size-1 need block_size values
        width, top = width + 1, top * len(DIGITS)
    return width


def encode_streaks(streaks: torch.Tensor, block_size: int) -> str:
    """The streaks of one task and method as `streak_width(block_size)` base-36 digits each."""
    values = _check_streaks(streaks).cpu().to(torch.int64).numpy()
    if values.max() > block_size - 1:
        raise ValueError(f"streaks must be at most block_size - 1 = {block_size - 1}; got {int(values.max())}")
    width = streak_width(block_size)
    digits = (values[:, None] // len(DIGITS) ** np.arange(width - 1, -1, -1)) % len(DIGITS)
    return np.frombuffer(DIGITS.encode(), dtype=np.uint8)[digits].tobytes().decode()


def decode_streaks(text: str, block_size: int) -> np.ndarray:
    """`encode_streaks`' string back to int64 streaks; ValueError saying what is wrong with a
    string that is not one (a character outside 0-9a-z, a length that is not a whole number of
    anchors, a streak above block_size - 1)."""
    width = streak_width(block_size)
    if not isinstance(text, str) or not text or not text.isascii() or len(text) % width:
        raise ValueError(f"is not a non-empty string of base-36 digits, {width} per anchor")
    digits = _DIGIT_VALUE[np.frombuffer(text.encode(), dtype=np.uint8)].reshape(-1, width)
    if (digits < 0).any():
        raise ValueError("holds a character other than the base-36 digits 0-9 and a-z")
    # 13 digits (block sizes past 36**12) can exceed int64: Python integers there
    powers = np.array([len(DIGITS) ** k for k in range(width - 1, -1, -1)], dtype=object if width > 12 else np.int64)
    values = digits.astype(powers.dtype) @ powers
    if values.max() > block_size - 1:
        raise ValueError(f"holds the streak {int(values.max())}, above block_size - 1 = {block_size - 1}")
    return values.astype(np.int64)
