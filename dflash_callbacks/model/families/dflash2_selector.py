"""DFlash 2's candidate selector: its module, and the statistics the scorer reads of it.

At serving (vLLM's `qwen3_dflash2.compute_candidates` and its selector walk), each draft slot j of a
block offers the top-K tokens of its LM-head logits (values times `output_multiplier`, then
soft-capped, K = `selector_top_k`), and the selector scores candidate c given the token p proposed
before it (the anchor for slot 0):

    score_j(c | p) = unary_j[c] + < predecessor_codebook[p] * W_h h_j , successor_codebook[c] >

Greedy serving walks the block: slot j proposes the argmax over its K candidates given the token
slot j - 1 proposed (lowest candidate index on ties); sampling draws from softmax(score / T) over
them. A streak continues only while every earlier proposal was the true token, so the proposal at
slot j given the TRUE token before it is what serving proposes there: `selector_stats` scores each
slot teacher-forced, and describes it as `kernels.head_stats.HeadStats` does a DFlash slot (over
the K candidates instead of the vocabulary), plus what an exact DDTree over the candidate tree needs:
every slot's edge scores given each candidate of the slot before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels.head_stats import head_topk

NOT_PROPOSED = torch.iinfo(torch.int64).max
"""label_rank and label_order of a label that is not among its slot's candidates: the selector can
never propose it, so no top@k counts it, whatever k (K itself would let a top@k with k > K count it)."""
SCORE_ELEMENTS = 1 << 20
"""Rows of the edge scores per step of `selector_stats`: its [rows, K + 1, rank] temporaries hold
about this many fp32 values."""


class SelectorStats(NamedTuple):
    """One row per draft slot ([M] = [n * P]); the first five are HeadStats' fields, over the K candidates."""

    lse: Tensor  # [M] fp32 logsumexp of the teacher-forced scores
    label_logprob: Tensor  # [M] fp32 log q(label | true previous); -inf: not a candidate
    label_rank: Tensor  # [M] int64 candidates scoring above the label; NOT_PROPOSED: not a candidate
    label_order: Tensor  # [M] int64 rank + ties at a lower candidate index (0: the walk picks it); NOT_PROPOSED
    top_logprobs: Tensor  # [M, top_n] fp32 the K log-probs, descending, -inf past K
    candidate_ids: Tensor  # [M, K] int64 the slot's candidates, by unary value descending (ties: lower id)
    candidate_scores: Tensor  # [M, K] fp32 the teacher-forced scores (given the true previous token)
    edge_scores: Tensor  # [M, K(p), K(c)] fp32 score(c | p): p each candidate of the slot before (slot 0: the anchor)
    label_index: Tensor  # [M] int64 the label's candidate index; -1: not a candidate

    @property
    def edge_logprobs(self) -> Tensor:
        """[M, K, K] log q(c | p), as the teacher-forced log-probs are taken (bitwise equal on their row)."""
        return self.edge_scores - self.edge_scores.logsumexp(-1, keepdim=True)


class CandidateSelector(nn.Module):
    """The selector's weights (published names): two codebooks [V, rank] and W_h [rank, H]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def scores(self, unary: Tensor, hidden: Tensor, candidate_ids: Tensor, predecessor_ids: Tensor) -> Tensor:
        """score(c | p) [..., R, K] of candidates [..., K] (unary values `unary`) at hidden states [..., H]
        for predecessors [..., R], computed in unary's dtype."""
        dtype = unary.dtype
        projected = F.linear(hidden.to(dtype), self.hidden_projection.weight.to(dtype))  # [..., rank]
        context = _rows(self.predecessor_codebook, predecessor_ids, dtype) * projected.unsqueeze(-2)  # [..., R, rank]
        successors = _rows(self.successor_codebook, candidate_ids, dtype)  # [..., K, rank]
        return unary.unsqueeze(-2) + context @ successors.transpose(-1, -2)


def _rows(codebook: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """codebook[ids] [..., rank] in `dtype` (index_select: about twice as fast as indexing on the CPU)."""
    return codebook.index_select(0, ids.flatten()).view(*ids.shape, -1).to(dtype)


def serving_unary(values: Tensor, settings) -> Tensor:
    """The K candidates' logits as vLLM hands them to the selector: times output_multiplier, then
    tanh(v / cap) * cap when final_logit_softcapping is set."""
    values = values * settings.output_multiplier
    cap = settings.final_logit_softcapping
    return values if cap is None else torch.tanh(values / cap) * cap


@torch.no_grad()
def selector_stats(selector: CandidateSelector, settings, features: Tensor, weight: Tensor, labels: Tensor,
                   previous: Tensor, top_n: int, backend: str = "auto", chunk_size: int | None = None) -> SelectorStats:
    """The selector's statistics of n blocks: features [n, P, H] (the draft rows' hidden states), weight
    [V, H] (the LM head), labels and previous [n, P] (the true token at and before each slot). The
    top-K never materialises [n * P, V] (`head_topk`, `backend` and `chunk_size` as for head_stats);
    the selector runs in fp32."""
    n, slots, hidden = features.shape
    k, rows = settings.selector_top_k, n * slots
    top = head_topk(features.reshape(rows, hidden), weight, k, backend=backend, chunk_size=chunk_size)
    unary, ids = serving_unary(top.values, settings), top.ids.view(n, slots, k)
    before = torch.cat([previous[:, :1, None].expand(n, 1, k), ids[:, :-1]], dim=1)  # [n, P, K]: slot 0, the anchor
    predecessors = torch.cat([before, previous[..., None]], dim=-1).view(rows, k + 1)  # + the true previous token
    flat, ids = features.reshape(rows, hidden), ids.view(rows, k)
    step = max(1, SCORE_ELEMENTS // ((k + 1) * selector.predecessor_codebook.shape[1]))
    scores = torch.cat([selector.scores(unary[r:r + step], flat[r:r + step], ids[r:r + step], predecessors[r:r + step])
                        for r in range(0, rows, step)]) if rows else unary.new_empty(0, k + 1, k)
    # teacher-forced: the edge row of the true previous token where it is a candidate of the slot before
    # (slot 0: any row, each is the anchor's), so the two agree bitwise; else the extra row
    hit = before.reshape(rows, k) == previous.reshape(rows, 1)
    row = torch.where(hit.any(-1), hit.int().argmax(-1), k)
    forced = scores.gather(1, row[:, None, None].expand(rows, 1, k))[:, 0]  # [M, K]
    lse = forced.logsumexp(-1)
    match = ids == labels.reshape(rows, 1)
    proposed, index = match.any(-1), match.int().argmax(-1)
    label_score = forced.gather(1, index[:, None])[:, 0]
    above = (forced > label_score[:, None]).sum(-1)
    tied_before = ((forced == label_score[:, None]) & (torch.arange(k, device=ids.device) < index[:, None])).sum(-1)
    logprobs = forced - lse[:, None]
    ranked = torch.full((rows, top_n), float("-inf"), device=ids.device)
    ranked[:, : min(k, top_n)] = logprobs.sort(dim=-1, descending=True).values[:, :top_n]
    return SelectorStats(
        lse=lse,
        label_logprob=torch.where(proposed, label_score - lse, float("-inf")),
        label_rank=torch.where(proposed, above, NOT_PROPOSED),
        label_order=torch.where(proposed, above + tied_before, NOT_PROPOSED),
        top_logprobs=ranked,
        candidate_ids=ids,
        candidate_scores=forced,
        edge_scores=scores[:, :k],
        label_index=torch.where(proposed, index, -1),
    )


def greedy_walk(stats: SelectorStats, blocks: int) -> Tensor:
    """[n, P] the tokens greedy serving proposes in each block, from `selector_stats` of its slots:
    start from the anchor (edge row 0 of slot 0), take the argmax candidate (lowest index on ties),
    continue from its row."""
    k = stats.candidate_ids.shape[-1]
    edges, ids = stats.edge_scores.view(blocks, -1, k, k), stats.candidate_ids.view(blocks, -1, k)
    row, tokens = torch.zeros(blocks, dtype=torch.int64, device=ids.device), []
    for j in range(edges.shape[1]):
        row = edges[torch.arange(blocks), j, row].argmax(-1)  # torch's argmax: the first maximum
        tokens.append(ids[torch.arange(blocks), j].gather(1, row[:, None])[:, 0])
    return torch.stack(tokens, dim=1)
