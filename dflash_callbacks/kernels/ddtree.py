"""DDTree streaks for many anchors at once, by the closed form (no tree is built).

DDTree Algorithm 1 with node budget n keeps the n best prefixes (score = sum of
per-depth log-probs). The label path is in the tree at depth d iff its score
S_d = sum_{i<=d} log q_i(y_i) is among the n best, so with theta_n the n-th largest
prefix score over all depths,

    streak = #{d : S_d >= theta_n}, cut at the first invalid position,

exact up to float ties between prefix scores (`scoring.metrics.streaks` is the
reference that also resolves ties). theta for every budget comes from the top
M = max(budgets) prefix scores of each depth:

- depth 1: the top-M log-probs themselves;
- depth d: the best M scores at depth d only extend the best M at depth d-1, and the
  pair (j-th best prefix at depth d-1, r-th best log-prob at depth d), 0-based, is
  dominated by the (j+1)(r+1) pairs with j' <= j, r' <= r (rounding is monotone, so
  this holds for the float sums too). Only pairs with (j+1)(r+1) <= M can be needed,
  about M ln M of them instead of M^2;
- theta_n = the n-th largest of the L*M kept scores.

Sums are float64 and run left to right (parent score + log-prob), as in the
reference, so both agree bit for bit on the same inputs. Everything is vectorised
over anchors; the only Python loop is over depths. Memory: about A * M * (L + ln M)
float64 values.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _pairs(m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All (j, r), 0-based, with (j + 1) * (r + 1) <= m, as two index vectors."""
    j = torch.arange(m, device=device)
    per_j = m // (j + 1)
    parent = torch.repeat_interleave(j, per_j)
    start = torch.cumsum(per_j, 0) - per_j
    rank = torch.arange(parent.numel(), device=device) - torch.repeat_interleave(start, per_j)
    return parent, rank


def _validate(top_logprobs, label_logprobs, valid, budgets) -> tuple[int, ...]:
    if not isinstance(top_logprobs, torch.Tensor) or top_logprobs.dim() != 3 or top_logprobs.dtype != torch.float32:
        raise ValueError(
            "top_logprobs must be a float32 tensor of shape [A, L, N]; got "
            f"{getattr(top_logprobs, 'dtype', type(top_logprobs))} {tuple(getattr(top_logprobs, 'shape', ()))}"
        )
    a, length, n = top_logprobs.shape
    if length < 1 or n < 1:
        raise ValueError(f"top_logprobs must have L >= 1 and N >= 1; got shape {tuple(top_logprobs.shape)}")
    for name, tensor, dtype in (("label_logprobs", label_logprobs, torch.float32), ("valid", valid, torch.bool)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.shape != (a, length):
            raise ValueError(
                f"{name} must be a {dtype} tensor of shape [A, L] = {[a, length]}; got "
                f"{getattr(tensor, 'dtype', type(tensor))} {tuple(getattr(tensor, 'shape', ()))}"
            )
    budgets = tuple(budgets)
    for budget in budgets:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= n:
            raise ValueError(f"budgets must be integers in [1, N = {n}]; got {budget!r} in {budgets!r}")
    if not budgets:
        raise ValueError("budgets must name at least one budget")
    if not (top_logprobs[..., :-1] >= top_logprobs[..., 1:]).all():
        raise ValueError("top_logprobs must be sorted descending along the last dim (pad with -inf), without NaN")
    return budgets


def ddtree_streaks_from_top(
    top_logprobs: torch.Tensor,
    label_logprobs: torch.Tensor,
    valid: torch.Tensor,
    budgets: Iterable[int],
) -> dict[int, torch.Tensor]:
    """DDTree streak per anchor for each budget: {n: int64 [A]} on the inputs' device.

    top_logprobs [A, L, N] float32: the N largest log q_d values per (anchor, depth),
    sorted descending, padded with -inf where V < N. label_logprobs [A, L] float32:
    log q_d(y_d). valid [A, L] bool: the streak stops at the first False. budgets:
    integers in [1, N].
    """
    budgets = _validate(top_logprobs, label_logprobs, valid, budgets)
    a, length, _ = top_logprobs.shape
    m = max(budgets)
    top = top_logprobs[..., :m].double()
    parent, rank = _pairs(m, top.device)

    best = top[:, 0]  # [A, M]: best prefix scores at the current depth, descending
    per_depth = [best]
    for d in range(1, length):
        candidates = best[:, parent] + top[:, d, rank]
        best = candidates.topk(m, dim=-1).values
        per_depth.append(best)
    ranked = torch.cat(per_depth, dim=-1).topk(m, dim=-1).values  # [A, M]

    label_scores = torch.cumsum(label_logprobs.double(), dim=-1)  # [A, L]
    reached = valid.long().cumprod(dim=-1).bool()
    out = {}
    for budget in budgets:
        theta = ranked[:, budget - 1 : budget]
        out[budget] = ((label_scores >= theta) & reached).long().cumprod(dim=-1).sum(dim=-1)
    return out
