"""DDTree streaks for many anchors at once, by the closed form (no tree is built).

DDTree Algorithm 1 with node budget n pops the n best prefixes (score = sum of
per-depth log-probs, ties to the lexicographically smaller rank tuple). With theta_n
the n-th largest prefix score over all depths, the label path's prefix at depth d,
of score S_d = sum_{i<=d} log q_i(y_i), is in the tree if S_d > theta_n (fewer than n
prefixes score more) and not if S_d < theta_n (n prefixes score more), so

    streak = #{d : S_d >= theta_n}, cut at the first invalid position,

except where some S_d == theta_n: then other prefixes tie with it and the rank tuples
decide. Such ties are common, not an accident of floats: a confident drafter's
log-prob rounds to 0.0 in fp32 (p > 1 - 6e-8), and every prefix then ties with its
child of rank 0, so counting ties as accepted would give a budget of n a streak
deeper than n. Those anchors run Algorithm 1's heap itself (`heap_streak`, n pops on
the same float64 scores), which is what `tests/oracles.py` computes for every anchor.
theta for every budget comes from the top M = max(budgets) prefix scores of each depth:

- depth 1: the top-M log-probs themselves;
- depth d: the best M scores at depth d only extend the best M at depth d-1, and the
  pair (j-th best prefix at depth d-1, r-th best log-prob at depth d), 0-based, is
  dominated by the (j+1)(r+1) pairs with j' <= j, r' <= r (rounding is monotone, so
  this holds for the float sums too). Only pairs with (j+1)(r+1) <= M can be needed,
  about M ln M of them instead of M^2;
- theta_n = the n-th largest of the L*M kept scores.

Sums are float64 and run left to right (parent score + log-prob) here, in the heap
and in the reference, so all agree bit for bit on the same inputs (a tie is detected
exactly). Everything but the tied anchors is vectorised over anchors; the only
Python loop is over depths. Memory: about A * M * (L + ln M) float64 values.
"""

from __future__ import annotations

import heapq
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


def _validate(top_logprobs, label_logprobs, label_order, valid, budgets) -> tuple[int, ...]:
    if not isinstance(top_logprobs, torch.Tensor) or top_logprobs.dim() != 3 or top_logprobs.dtype != torch.float32:
        raise ValueError(
            "top_logprobs must be a float32 tensor of shape [A, L, N]; got "
            f"{getattr(top_logprobs, 'dtype', type(top_logprobs))} {tuple(getattr(top_logprobs, 'shape', ()))}"
        )
    a, length, n = top_logprobs.shape
    if length < 1 or n < 1:
        raise ValueError(f"top_logprobs must have L >= 1 and N >= 1; got shape {tuple(top_logprobs.shape)}")
    for name, tensor, dtype in (("label_logprobs", label_logprobs, torch.float32), ("label_order", label_order, torch.int64),
                                ("valid", valid, torch.bool)):
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
    label_order: torch.Tensor,
    valid: torch.Tensor,
    budgets: Iterable[int],
) -> dict[int, torch.Tensor]:
    """DDTree streak per anchor for each budget: {n: int64 [A]} on the inputs' device.

    top_logprobs [A, L, N] float32: the N largest log q_d values per (anchor, depth),
    sorted descending, padded with -inf where V < N. label_logprobs [A, L] float32:
    log q_d(y_d). label_order [A, L] int64: the label's place in the descending order,
    ties to the lower token id (`HeadStats.label_order`), read only on tied anchors.
    valid [A, L] bool: the streak stops at the first False. budgets: integers in [1, N].
    """
    budgets = _validate(top_logprobs, label_logprobs, label_order, valid, budgets)
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

    running, label_scores = torch.zeros(a, dtype=torch.float64, device=top.device), []
    for step in label_logprobs.double().unbind(-1):  # left to right, as the heap sums (not a parallel scan)
        running = running + step
        label_scores.append(running)
    label_scores = torch.stack(label_scores, dim=-1)  # [A, L]
    reached = valid.long().cumprod(dim=-1).bool()
    out = {}
    for budget in budgets:
        theta = ranked[:, budget - 1 : budget]
        streak = ((label_scores >= theta) & reached).long().cumprod(dim=-1).sum(dim=-1)
        tied = ((label_scores == theta) & reached).any(dim=-1).nonzero().flatten().tolist()
        if tied:
            depths = min(budget, length)  # n pops never go below depth n
            tops = top[tied, :depths, :budget].tolist()
            orders = label_order[tied].tolist()
            reach = reached[tied].sum(dim=-1).tolist()
            exact = [heap_streak(t, o, budget, r) for t, o, r in zip(tops, orders, reach)]
            streak[tied] = torch.tensor(exact, dtype=torch.int64, device=streak.device)
        out[budget] = streak
    return out


def heap_streak(top: list[list[float]], label_order: list[int], budget: int, reach: int) -> int:
    """One anchor, Algorithm 1 itself: pop `budget` prefixes best-first (score descending,
    rank tuple ascending), then walk the label's rank tuple down the popped set, at most
    `reach` deep. top[d]: the best log-probs at depth d, descending (float64 values)."""
    k, length = len(top[0]), len(top)
    heap = [(-top[0][0], (0,), 0.0)]  # (-score, rank tuple, parent's score); rank tuples are unique
    popped = set()
    while heap and len(popped) < budget:
        neg_score, ranks, parent_score = heapq.heappop(heap)
        popped.add(ranks)
        depth, r = len(ranks), ranks[-1]
        if r + 1 < k:
            heapq.heappush(heap, (-(parent_score + top[depth - 1][r + 1]), ranks[:-1] + (r + 1,), parent_score))
        if depth < length:
            score = -neg_score
            heapq.heappush(heap, (-(score + top[depth][0]), ranks + (0,), score))
    streak = 0
    while streak < reach and tuple(label_order[: streak + 1]) in popped:
        streak += 1
    return streak


def ddtree_streaks_from_stats(stats, valid: torch.Tensor, budgets: Iterable[int]) -> dict[int, torch.Tensor]:
    """`ddtree_streaks_from_top` on head statistics (`HeadStats`: rows viewed as [A, L] by `valid`)."""
    a, length = valid.shape
    return ddtree_streaks_from_top(stats.top_logprobs.view(a, length, -1), stats.label_logprob.view(a, length),
                                   stats.label_order.view(a, length), valid, budgets)
