"""Per-task aggregates of per-anchor streaks (DESIGN.md, "Aggregates per task").

The scorer gives one method's streak for every scored anchor of a task, in anchor
order: `streaks[i]` belongs to anchor `first_anchor + i`. tau = streak + 1.

- `dense_tau`: mean tau over all scored anchors.
- `live_rounds` / `live_tau`: the schedule live speculative decoding follows on the
  target's greedy text: a0 = first_anchor, a <- a + streak(a) + 1, until a leaves the
  scored anchors or `max_rounds` rounds are done; the tau of each round / their mean.
- `acceptance_curve`: for d = 1..max_depth, the share of anchors with streak >= d.
"""

from __future__ import annotations

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
