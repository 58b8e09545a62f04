"""Partial LM-head statistics over vocabulary splits, and their merge.

The Triton path (`triton_head_stats.py`) splits the vocabulary [0, V) into S splits of
`split_width` columns (split s holds columns [s * split_width, (s + 1) * split_width),
the last one cut at V) and computes, per (split, row), with z = hidden @ weight.T and a
per-row pivot p (the kernel's own value of z_y):

    max          [S, M] fp32   max of z_v over the split
    sum_exp      [S, M] fp32   sum of exp(z_v - max) over the split
    label_logit  [S, M] fp32   z_y in the split that holds y, 0 in the others
    n_greater    [S, M] int32  #{v in split, v != y : z_v > p}
    n_tied_below [S, M] int32  #{v in split, v < y : z_v == p}
    top          [S, M, N] fp32  the split's N largest z_v in any order, -inf where
                               the split has fewer than N columns (N = top_n)
    pivot        [S, M] fp32   p as the split computed it (every split computes the
                               same value; kept so tests can check p == z_y bitwise)

`merge_splits` turns them into the `HeadStats` of `head_stats.py`: lse by log-add-exp
of the splits, label_logprob = z_y - lse, the counts summed, the top-N of the union
of the splits' lists. A pure function of its inputs (torch ops, any device), so it is
tested on its own against partials built from materialised logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .types import HeadStats


class SplitPartials(NamedTuple):
    max: Tensor
    sum_exp: Tensor
    label_logit: Tensor
    n_greater: Tensor
    n_tied_below: Tensor
    top: Tensor
    pivot: Tensor


def merge_splits(parts: SplitPartials, labels: Tensor, split_width: int, top_n: int) -> HeadStats:
    """The statistics of all V columns from the per-split partials (see module doc).

    labels [M] int64 in [0, V); split_width: the columns per split (the split holding
    y is y // split_width); top_n: the N of the partial lists, also the output width.
    """
    s, m = parts.max.shape
    if parts.top.shape != (s, m, top_n):
        raise ValueError(f"top partials must be [S, M, top_n] = {[s, m, top_n]}; got {list(parts.top.shape)}")
    peak = parts.max.amax(dim=0)  # every split holds a column, so this is finite
    lse = peak + torch.log((parts.sum_exp * torch.exp(parts.max - peak)).sum(dim=0))
    z_y = parts.label_logit.gather(0, (labels // split_width)[None])[0]
    rank = parts.n_greater.sum(dim=0, dtype=torch.int64)
    order = rank + parts.n_tied_below.sum(dim=0, dtype=torch.int64)
    if top_n:
        top = parts.top.permute(1, 0, 2).reshape(m, s * top_n).topk(top_n, dim=1).values
    else:
        top = parts.top.new_empty(m, 0)
    return HeadStats(lse, z_y - lse, rank, order, top - lse[:, None])
