"""What the LM-head statistics kernels share, in a module that imports none of them (and no torch
at run time): the backends' names and the statistics' type."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

BACKENDS = ("auto", "torch", "triton", "reference")
"""How `head_stats.head_stats` computes: by the evidence table, the chunked torch path, the Triton
kernel, or the materialised reference."""


class HeadTopK(NamedTuple):
    """Per row: the k largest logits, descending (ties to the lower id), and their rows of the weight."""

    values: Tensor  # [M, k] fp32
    ids: Tensor  # [M, k] int64


class HeadStats(NamedTuple):
    """Per row (see head_stats.py): the log-sum-exp, the label's log-prob, rank and tie order, the
    top-N log-probs."""

    lse: Tensor
    label_logprob: Tensor
    label_rank: Tensor
    label_order: Tensor
    top_logprobs: Tensor


class TemperedHeadStats(NamedTuple):
    """HeadStats' five fields, and what a draft sampled from softmax(z / T) is scored by (head_stats.py,
    `head_stats_tempered`): the tempered log-sum-exp and the label's tempered log-prob."""

    lse: Tensor
    label_logprob: Tensor
    label_rank: Tensor
    label_order: Tensor
    top_logprobs: Tensor
    tempered_lse: Tensor
    tempered_label_logprob: Tensor
