"""Exact DDTree streaks over a candidate tree whose children depend on their parent (DFlash 2).

The tree of one anchor: the root is the anchor; a node at depth d + 1 is a candidate c of slot d,
and its children are the K candidates of slot d + 1 scored GIVEN c: log q_{d+1}(c' | c), the row c
of slot d + 1's edge log-probs (slot 0's rows are all the anchor's). A prefix's score is the sum of
its edges' log-probs, in float64, left to right. DDTree (Algorithm 1, as `kernels.ddtree`) with node
budget N pops the N best prefixes, best-first: by score, ties to the lexicographically smaller rank
tuple, where a node's rank is its place among its siblings (log-prob descending, ties to the lower
candidate index). The streak walks the labels down the popped set: depth d counts while the label
of every slot up to d is a candidate and its prefix was popped, cut at the first invalid slot.

Unlike DFlash's slots, these are not independent (a child's log-probs depend on its parent), so
the closed form of `kernels.ddtree` does not apply: Algorithm 1's heap runs here, for every anchor
at once. Each of the M = max(budgets) pops takes the best live entry of a frontier (its first
child and next sibling join it), so one run gives every budget: the label's prefix at depth d is in
the tree of budget N iff it was popped before pop N. Cost: O(A * M^2) comparisons and
A * (2M + 1) * L int16 rank tuples for A anchors of L slots (the tuples are read only where
scores tie exactly).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _validate(edge_logprobs, label_index, valid, budgets) -> tuple[int, ...]:
    if not isinstance(edge_logprobs, torch.Tensor) or edge_logprobs.dim() != 4 or \
            edge_logprobs.shape[-1] != edge_logprobs.shape[-2] or not edge_logprobs.is_floating_point():
        raise ValueError("edge_logprobs must be a float tensor of shape [A, L, K, K]; got "
                         f"{getattr(edge_logprobs, 'dtype', type(edge_logprobs))} "
                         f"{tuple(getattr(edge_logprobs, 'shape', ()))}")
    a, length, k, _ = edge_logprobs.shape
    for name, tensor, dtype in (("label_index", label_index, torch.int64), ("valid", valid, torch.bool)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.shape != (a, length):
            raise ValueError(f"{name} must be a {dtype} tensor of shape [A, L] = {[a, length]}; got "
                             f"{getattr(tensor, 'dtype', type(tensor))} {tuple(getattr(tensor, 'shape', ()))}")
    budgets = tuple(budgets)
    if not budgets:
        raise ValueError("budgets must name at least one budget")
    for budget in budgets:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= 32767:
            raise ValueError(f"budgets must be integers in [1, 32767]; got {budget!r} in {budgets!r}")
    if length < 1 or k < 1:
        raise ValueError(f"edge_logprobs must have L >= 1 and K >= 1; got shape {tuple(edge_logprobs.shape)}")
    return budgets


def candidate_ddtree_streaks(edge_logprobs: torch.Tensor, label_index: torch.Tensor, valid: torch.Tensor,
                             budgets: Iterable[int]) -> dict[int, torch.Tensor]:
    """DDTree streak per anchor for each budget: {N: int64 [A]} on the inputs' device.

    edge_logprobs [A, L, K, K]: log q_d(c | p), p the parent's candidate index in slot d - 1 (any row
    for slot 0), c the child's in slot d. label_index [A, L] int64: the label's candidate index in
    its slot, -1 where it is not a candidate. valid [A, L] bool: the streak stops at the first False.
    """
    budgets = _validate(edge_logprobs, label_index, valid, budgets)
    a, length, k, _ = edge_logprobs.shape
    m, dev = max(budgets), edge_logprobs.device
    every = torch.arange(a, device=dev)
    child_lp, child_of = edge_logprobs.double().sort(dim=-1, descending=True, stable=True)  # [A, L, K, K]
    # the label's rank among its siblings on the label path (K: no such node)
    parent = torch.cat([torch.zeros(a, 1, dtype=torch.int64, device=dev), label_index[:, :-1].clamp(min=0)], dim=1)
    siblings = child_of[every[:, None], torch.arange(length, device=dev), parent]  # [A, L, K]
    found = siblings == label_index[..., None]
    label_rank = torch.where(found.any(-1), found.int().argmax(-1), k)

    size = 2 * m + 1  # entry 0: the root's best child; pop t pushes at 2t + 1 (next sibling), 2t + 2 (first child)
    score = torch.full((a, size), float("-inf"), dtype=torch.float64, device=dev)
    parent_score = torch.zeros(a, size, dtype=torch.float64, device=dev)
    slot, rank, row = (torch.zeros(a, size, dtype=torch.int64, device=dev) for _ in range(3))
    on_label = torch.zeros(a, size, dtype=torch.bool, device=dev)
    parent_on_label = torch.ones(a, size, dtype=torch.bool, device=dev)
    tuples = torch.full((a, size, length), -1, dtype=torch.int16, device=dev)  # rank tuples, -1 past the depth
    score[:, 0] = child_lp[:, 0, 0, 0]
    on_label[:, 0] = label_rank[:, 0] == 0
    tuples[:, 0, 0] = 0
    popped_at = torch.full((a, length), m, dtype=torch.int64, device=dev)  # pop index of the label's prefix

    for t in range(m):
        live = score[:, : 2 * t + 1]
        best = live.max(dim=-1).values
        exists = best > float("-inf")  # an anchor whose tree has fewer than M nodes pops nothing more
        pick = _pick((live == best[:, None]) & exists[:, None], tuples[:, : 2 * t + 1])
        p_slot, p_rank, p_row = slot[every, pick], rank[every, pick], row[every, pick]
        p_label, p_parent_label = on_label[every, pick], parent_on_label[every, pick]
        p_parent_score = parent_score[every, pick]
        p_tuple = tuples[every, pick]
        score[every, pick] = float("-inf")
        popped_at[every, p_slot] = torch.where(exists & p_label, t, popped_at[every, p_slot])
        # its next sibling (same parent, rank + 1)
        sibling, next_rank = 2 * t + 1, p_rank + 1
        ok = exists & (next_rank < k)
        lp = child_lp[every, p_slot, p_row, next_rank.clamp(max=k - 1)]
        _push(score, parent_score, slot, rank, row, on_label, parent_on_label, tuples, sibling,
              torch.where(ok, p_parent_score + lp, float("-inf")), p_parent_score, p_slot, next_rank, p_row,
              p_parent_label & (next_rank == label_rank[every, p_slot]), p_parent_label,
              p_tuple.scatter(1, p_slot[:, None], next_rank[:, None].to(torch.int16)))
        # its first child (the next slot, rank 0, given its own candidate)
        child, next_slot = 2 * t + 2, (p_slot + 1).clamp(max=length - 1)
        ok = exists & (p_slot + 1 < length)
        own = child_of[every, p_slot, p_row, p_rank]
        lp = child_lp[every, next_slot, own, 0]
        _push(score, parent_score, slot, rank, row, on_label, parent_on_label, tuples, child,
              torch.where(ok, best + lp, float("-inf")), best, next_slot, torch.zeros_like(p_rank), own,
              p_label & (label_rank[every, next_slot] == 0), p_label,
              p_tuple.scatter(1, next_slot[:, None], torch.zeros_like(p_tuple[:, :1])))

    reached = valid.long().cumprod(dim=-1).bool()
    return {n: ((popped_at < n) & reached).long().cumprod(dim=-1).sum(dim=-1) for n in budgets}


def _pick(best: torch.Tensor, tuples: torch.Tensor) -> torch.Tensor:
    """Per anchor, the index of the entry to pop among those marked `best` [A, S] (the best score):
    the only one, or of the tied ones, the lexicographically smallest rank tuple [A, S, L]."""
    pick = best.int().argmax(-1)
    tied = (best.sum(-1) > 1).nonzero().flatten()
    if tied.numel():
        left = best[tied]
        for depth in range(tuples.shape[-1]):
            ranks = torch.where(left, tuples[tied, :, depth].int(), torch.iinfo(torch.int32).max)
            left = left & (ranks == ranks.min(-1, keepdim=True).values)
        pick[tied] = left.int().argmax(-1)  # rank tuples are unique: one is left
    return pick


def _push(score, parent_score, slot, rank, row, on_label, parent_on_label, tuples, at: int,
          new_score, new_parent_score, new_slot, new_rank, new_row, new_on_label, new_parent_on_label, new_tuple):
    """Write one frontier entry per anchor at column `at` (score -inf: nothing pushed)."""
    score[:, at], parent_score[:, at] = new_score, new_parent_score
    slot[:, at], rank[:, at], row[:, at] = new_slot, new_rank, new_row
    on_label[:, at], parent_on_label[:, at], tuples[:, at] = new_on_label, new_parent_on_label, new_tuple
