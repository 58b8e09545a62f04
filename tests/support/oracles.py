"""Reference acceptance metrics on materialised drafter logits.

`streaks` is the definition every faster scorer in this package is tested against.
For each anchor it returns the streak (accepted draft tokens; tau = streak + 1) of:

- `vanilla`: the largest d with argmax_v z_i[v] == y_i for all i <= d, argmax ties
  to the lowest token id. Computed on the logits z (argmax q = argmax z, and the
  logits carry no softmax rounding).
- `top@k`: the largest d with rank_i(y_i) < k for all i <= d, where
  rank(y) = #{v : z_v > z_y} (strictly greater, so tied tokens share a rank).
- `ddtree@n`: DDTree Algorithm 1 with node budget n (root not counted), then a walk
  along the labels. Per depth the tokens are ordered by logit descending, ties to the
  lower token id (as the scorer and the DDTree authors' code order them: two distinct
  logits about 1e-6 apart can round to one fp32 log-prob, and must not tie there);
  K = min(n, V) tokens per depth are used. A prefix is a tuple of such ranks, its score
  is the left-to-right float64 sum of its log-probs (fp32 log_softmax) starting from 0.0. The best-first heap pops n prefixes in the order
  (score descending, rank tuple ascending lexicographically); the tree spans all L
  depths. The streak is the largest d whose label prefix (ranks of y_1..y_d) was
  popped, stopping at the first invalid position.

Method for `ddtree@n`: one exact heap run per anchor in plain Python over lists
(`kernels.ddtree.heap_streak`, which the fast scorer runs on tied anchors;
test_metrics.py checks it against the paper's tree and a brute force), after the vectorised part (log_softmax, the top-K values, the label's rank) is done
in torch. Only the top-K values matter (not which tied token sits where), and the
label's rank under the tie rule is #{v: z_v > z_y} + #{v < y: z_v == z_y}.
A sibling's score is recomputed from its parent's score (not by swapping one term
out of the current score), so every score is exactly the left-to-right sum, and
float ties resolve by the rank tuple exactly as Algorithm 1 says. Anchors whose
label walk cannot pass depth 0 (first label outside the top K, or no valid
position) skip the heap. Cost: about n heap pops per anchor and budget; thousands
of anchors at L = 15, n <= 8 take well under a second.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dflash_callbacks.kernels.ddtree import heap_streak  # Algorithm 1 itself; test_metrics checks it by brute force


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many positions from the start are all True (int64 [N])."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def _check_positive_ints(values: Iterable[int], name: str) -> tuple[int, ...]:
    values = tuple(values)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be integers >= 1; got {value!r} in {values!r}")
    return values


def _validate(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Checks shapes, dtypes and values; returns `valid` as a bool [N, L] tensor."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            "logits must be a floating-point tensor of shape [N, L, V]; got "
            f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}"
        )
    n, length, vocab = logits.shape
    if length < 1 or vocab < 1:
        raise ValueError(f"logits must have L >= 1 and V >= 1; got shape {tuple(logits.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.shape != (n, length):
        raise ValueError(
            f"labels must be an int64 tensor of shape [N, L] = {[n, length]}; got "
            f"{getattr(labels, 'dtype', type(labels))} {tuple(getattr(labels, 'shape', ()))}"
        )
    if labels.numel() and (labels.min() < 0 or labels.max() >= vocab):
        raise ValueError(
            f"labels must lie in [0, {vocab - 1}] (V = {vocab}); "
            f"got values in [{int(labels.min())}, {int(labels.max())}]"
        )
    if torch.isnan(logits).any() or (logits == float("inf")).any():
        raise ValueError("logits must not contain NaN or +inf")
    if logits.numel() and (logits.amax(dim=-1) == float("-inf")).any():
        raise ValueError("every logits row [n, l, :] needs at least one finite value (-inf masks some, not all)")
    if valid is None:
        return torch.ones(n, length, dtype=torch.bool, device=logits.device)
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != (n, length):
        raise ValueError(
            f"valid must be None or a bool tensor of shape [N, L] = {[n, length]}; got "
            f"{getattr(valid, 'dtype', type(valid))} {tuple(getattr(valid, 'shape', ()))}"
        )
    return valid


def streaks(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ddtree_budgets: Iterable[int] = (4, 8),
    topk: Iterable[int] = (),
    valid: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-anchor streaks of every method, as int64 [N] tensors on logits' device.

    logits [N, L, V] (any float dtype, computed in fp32), labels [N, L] int64 in
    [0, V), valid [N, L] bool or None (all valid; a streak stops at the first False).
    Keys: "vanilla", "ddtree@{n}" for n in ddtree_budgets, "top@{k}" for k in topk.
    """
    budgets = _check_positive_ints(ddtree_budgets, "ddtree_budgets")
    widths = _check_positive_ints(topk, "topk")
    valid = _validate(logits, labels, valid)
    z = logits.float()
    z_label = z.gather(-1, labels.unsqueeze(-1))  # [N, L, 1]
    z_rank = (z > z_label).sum(dim=-1)  # [N, L], ties share a rank

    out = {"vanilla": _leading_true((z.argmax(dim=-1) == labels) & valid)}
    if budgets:
        out.update(_ddtree_streaks(z, labels, valid, budgets))
    for k in widths:
        out[f"top@{k}"] = _leading_true((z_rank < k) & valid)
    return out


def _ddtree_streaks(
    z: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budgets: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """The `ddtree@n` entries of `streaks` (see the module docstring for the method)."""
    n_anchors, length, vocab = z.shape
    logprobs = torch.log_softmax(z, dim=-1)
    z_label = z.gather(-1, labels.unsqueeze(-1))
    token_ids = torch.arange(vocab, device=z.device)
    # Rank under "logit descending, ties to the lower token id".
    label_rank = (z > z_label).sum(-1) + ((z == z_label) & (token_ids < labels.unsqueeze(-1))).sum(-1)
    # A popped node's ancestors are popped first, so a budget of n never pops below
    # depth n: the depths past max(budgets) cannot change any pop and are left out.
    k_max, depth_max = min(max(budgets), vocab), min(max(budgets), length)
    top_values = logprobs[:, :depth_max].topk(k_max, dim=-1).values.double().cpu().tolist()
    label_rank_list = label_rank.cpu().tolist()

    out = {}
    for budget in budgets:
        k = min(budget, vocab)
        # Depth the walk can reach at most: up to the first invalid position or
        # the first label outside the top K.
        reach = _leading_true((label_rank < k) & valid).cpu().tolist()
        result = []
        for a in range(n_anchors):
            if reach[a] == 0:
                result.append(0)
                continue
            top = [row[:k] for row in top_values[a][: min(budget, length)]]
            result.append(heap_streak(top, label_rank_list[a], budget, reach[a]))
        out[f"ddtree@{budget}"] = torch.tensor(result, dtype=torch.int64, device=z.device)
    return out
