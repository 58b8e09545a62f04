"""The greedy walk: what a family drafts when each slot takes the argmax given the proposal before it.

Serving (vLLM's DSpark speculator, DeepSpec's `sample_block_tokens`, SpecForge's `spec_generate`)
proposes a block slot by slot: slot j's distribution is read with the previous proposal as the token
before it (the anchor for slot 0), its argmax is proposal j. Any family whose slot j reads only
`previous[:, :j+1]` (`Drafter.slot_features`) walks it through the family contract; for DFlash, whose
slots ignore the predecessor, it is the per-slot argmax.

Along a block's accepted streak the proposals are the true tokens, so the teacher-forced statistics
the scorer uses (`slot_stats` with the true tokens as predecessors) see exactly the distributions the
walk sees up to the first miss: the vanilla streak is the number of leading slots where the walk's
proposal equals the true token.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_walk(drafter, hidden: torch.Tensor, anchor_tokens: torch.Tensor, lm_head_weight: torch.Tensor,
                embed: nn.Embedding) -> tuple[torch.Tensor, torch.Tensor]:
    """(proposals int64 [n, P] as target ids, logits [n, P, V'] fp32) of the decoded blocks `hidden`
    [n, B, H] whose anchors hold `anchor_tokens` [n]; P = len(drafter.draft_rows(B)). The argmax breaks
    ties to the lowest id; a pruned draft vocabulary's indices are mapped to target ids."""
    n, B = hidden.shape[:2]
    P = len(drafter.draft_rows(B))
    weight = drafter.head_weight(lm_head_weight)
    vocab_ids = drafter.vocab_ids
    previous = torch.zeros(n, P, dtype=torch.long, device=hidden.device)
    previous[:, 0] = anchor_tokens
    proposals = torch.empty_like(previous)
    logits = []
    for j in range(P):
        slot = drafter.slot_features(hidden, previous, embed)[:, j]  # reads previous[:, :j+1] only
        logits.append(slot.float() @ weight.float().T)
        best = logits[-1].argmax(dim=-1)
        proposals[:, j] = best if vocab_ids is None else vocab_ids.to(best.device)[best]
        if j + 1 < P:
            previous[:, j + 1] = proposals[:, j]
    return proposals, torch.stack(logits, dim=1)
