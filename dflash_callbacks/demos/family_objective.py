"""The training objective of every drafter family whose slot logits are `slot_features @ head_weight^T`
(DFlash, DSpark, Domino), in plain PyTorch: teacher-forced cross-entropy of each draft slot's
distribution over the family's own layout (`Drafter.draft_rows`), the token before each slot the true
one (the anchor, then the labels), as the trainers teach them.

It is `objective.sequence_loss` with the family's slots in place of DFlash's rows 1 .. B-1: the same
anchors drawn from the same generator, the same block forward, the slot j of P weighted
exp(-j / gamma) (`slot_weights`), averaged over valid labels. For a DFlash drafter the two are the
same loss (tested). The trainers add terms this one leaves out: DSpark's trainers a distance to the
verifier's distribution and the confidence head's calibration (a cache holds no verifier
distribution, so neither can be formed here; the confidence head does not train); SpecForge's Domino
also trains row B-1, which serving never proposes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import TargetHead
from ..model.geometry import block_attention_mask, block_inputs, block_positions
from .objective import depth_weights
from ..scoring.scorer import draft_labels


def slot_weights(proposals: int, gamma: float) -> torch.Tensor:
    """exp(-j / gamma) for the draft slots j = 0 .. proposals-1."""
    return depth_weights(proposals + 1, gamma)


def block_loss(drafter, head: TargetHead, input_ids: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """The weighted slot cross-entropy of the blocks at `anchors` (sorted, each >= 0 and <= T-2) of one
    sequence; `weights` [P] are `slot_weights` on the drafter's device."""
    B = drafter.config.block_size
    P = len(drafter.draft_rows(B))
    tokens, labels, valid = block_inputs(input_ids, anchors, B, drafter.mask_token_id, P)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)  # the true token before each slot
    C = int(anchors.max())
    out = drafter(
        hidden[:C][None].to(drafter.fc.weight.dtype),
        head.embed_tokens(tokens).flatten(0, 1)[None].to(drafter.fc.weight.dtype),
        block_positions(anchors, B, C)[None],
        block_attention_mask(anchors, B, C),
    ).view(anchors.numel(), B, -1)
    if drafter.vocab_ids is not None:
        labels, valid = draft_labels(labels, valid, drafter.vocab_ids)
    features = drafter.slot_features(out, previous, head.embed_tokens)
    logits = (features @ drafter.head_weight(head.lm_head.weight).T).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(anchors.numel(), P)
    w = weights[None, :] * valid
    return (ce * w).sum() / w.sum()


def family_sequence_loss(drafter, head: TargetHead, input_ids: torch.Tensor, hidden: torch.Tensor, prompt_len: int,
                         blocks_per_sequence: int, weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`block_loss` at `blocks_per_sequence` anchors of the completion drawn with `generator` (never
    the global RNG), as `objective.sequence_loss` draws them."""
    T = input_ids.numel()
    n_anchors = min(blocks_per_sequence, T - 1 - prompt_len)
    anchors = prompt_len + torch.randperm(T - 1 - prompt_len, generator=generator)[:n_anchors]
    return block_loss(drafter, head, input_ids, hidden, anchors.sort().values.to(input_ids.device), weights)
