"""The drafters' training objective, in plain PyTorch (no framework), for every family: what the
demo, the toy baseline and the examples train with, and the reference a user can hold their own
training step against. `demos.training.DFlashTrainingModule` is the same objective as a
LightningModule.

Per sequence (target tokens and hidden states from a cache-format folder), draw
`blocks_per_sequence` random anchors inside the completion. Each block is the anchor token
followed by B-1 mask tokens; it sees the target context before its anchor and itself, never
another block (the scorer's block mask); inside the block each layer attends as
`model.attention.training_attention` says (the family's own trained pattern where it names one,
JetSpec's block-causal one; else `auto`). The loss is the teacher-forced cross-entropy of each
draft slot's distribution over the family's own layout (`Drafter.draft_rows`: DFlash's rows
1 .. B-1, the token at a + d at depth d; DSpark's anchor-first rows, B of them), the token before
each slot the true one (the anchor, then the labels), slot j of P weighted exp(-j/gamma) (gamma 7
for B = 16, 4 for B = 8: `slot_weights`), averaged over valid labels. A slot's logits are
`slot_features @ head_weight^T` (DFlash: the LM head on the draft rows; DSpark adds its Markov head,
Domino its GRU correction). A family may add a term of its own (`FAMILY_TERMS`): DFlash 2 its
selector's cross-entropy over each slot's K candidates given the true token before it
(`model.families.dflash2.Drafter.selector_loss`), with the same weights.

The trainers add terms this objective leaves out: DSpark's trainers a distance to the verifier's
distribution and the confidence head's calibration (a cache holds no verifier distribution, so
neither can be formed here, and the confidence head does not train); SpecForge's Domino also trains
row B-1, which serving never proposes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..cache.format import HiddenStateCache
from ..model import DFlashDrafter, TargetHead
from ..model.attention import training_attention
from ..model.geometry import block_attention_mask, block_inputs, block_positions
from ..scoring.scorer import draft_labels


def default_gamma(block_size: int) -> float:
    """7 for B = 16 and 4 for B = 8 (the published settings), linear in between."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(1.0, 0.4375 * block_size))


def depth_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(d-1)/gamma) for d = 1..B-1: DFlash's B-1 draft slots (`slot_weights(B - 1, gamma)`)."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def slot_weights(proposals: int, gamma: float) -> torch.Tensor:
    """exp(-j / gamma) for the draft slots j = 0 .. proposals-1 of a family's block (`proposals` =
    len(drafter.draft_rows(B)): B - 1 for DFlash, DFlash 2 and Domino, B for DSpark's anchor-first block)."""
    return depth_weights(proposals + 1, gamma)


def drafter_weights(drafter: DFlashDrafter, gamma: float | None = None) -> torch.Tensor:
    """`slot_weights` of `drafter`'s block (gamma: `default_gamma` of its block size when None)."""
    B = drafter.config.block_size
    return slot_weights(len(drafter.draft_rows(B)), default_gamma(B) if gamma is None else gamma)


class CacheSequences(Dataset):
    """Every task of a cache-format folder as {"input_ids", "hidden", "prompt_len"}."""

    def __init__(self, path: str | os.PathLike):
        self.cache = HiddenStateCache(path)
        self.names = [n for n in self.cache.task_names if self.cache.entry(n)["num_tokens"] - self.cache.entry(n)["prompt_len"] >= 2]
        if not self.names:
            raise ValueError(f"no sequence in {path} has a completion of at least 2 tokens")

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> dict:
        task = self.cache.task(self.names[i])
        return {"input_ids": task.input_ids, "hidden": task.hidden, "prompt_len": task.prompt_len}


def collate_sequences(items: list[dict]) -> list[dict]:
    return items  # sequences differ in length; the step loops over them


def selector_term(drafter, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  previous: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """DFlash 2: the selector's cross-entropy over each slot's K candidates given the true token before it."""
    return drafter.selector_loss(features, logits, labels, previous, weights)


FAMILY_TERMS = {"dflash2": selector_term}
"""What a family adds to the slot cross-entropy: family name -> term(drafter, features [n, P, H'], logits
[n, P, V'] fp32, labels [n, P], previous [n, P], weights [n, P]) -> a scalar."""


def block_loss(drafter: DFlashDrafter, head: TargetHead, input_ids: torch.Tensor, hidden: torch.Tensor,
               anchors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted slot cross-entropy (and the family's own term) of the blocks at `anchors` (sorted, each
    >= 1 and <= T-2) of one sequence; `weights` [P] are `slot_weights` on the drafter's device."""
    B = drafter.config.block_size
    P = len(drafter.draft_rows(B))
    if weights.numel() != P:
        raise ValueError(f"weights has {weights.numel()} entries, but a {drafter.family} drafter's block of {B} "
                         f"proposes {P} tokens: pass slot_weights({P}, gamma) (or drafter_weights(drafter))")
    tokens, labels, valid = block_inputs(input_ids, anchors, B, drafter.mask_token_id, P)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)  # the true token before each slot
    C = int(anchors.max())
    out = drafter(
        hidden[:C][None].to(drafter.input_weight.dtype),
        head.embed_tokens(tokens).flatten(0, 1)[None].to(drafter.input_weight.dtype),
        block_positions(anchors, B, C)[None],
        block_attention_mask(anchors, B, C),
        attention=training_attention(drafter.config),
    ).view(anchors.numel(), B, -1)
    if drafter.vocab_ids is not None:
        labels, valid = draft_labels(labels, valid, drafter.vocab_ids)
    features = drafter.slot_features(out, previous, head.embed_tokens)
    logits = F.linear(features, drafter.head_weight(head.lm_head.weight)).float()  # DFlash: head.lm_head(rows)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(anchors.numel(), P)
    w = weights[None, :] * valid
    loss = (ce * w).sum() / w.sum()
    term = FAMILY_TERMS.get(drafter.family)
    return loss if term is None else loss + term(drafter, features, logits, labels, previous, w)


def sequence_loss(drafter: DFlashDrafter, head: TargetHead, input_ids: torch.Tensor, hidden: torch.Tensor,
                  prompt_len: int, blocks_per_sequence: int, weights: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
    """`block_loss` of one sequence at `blocks_per_sequence` anchors of the completion drawn with `generator`
    (never the global RNG); `weights` are `slot_weights` of the drafter's block (DFlash: `depth_weights(B, gamma)`)
    on the drafter's device."""
    T = input_ids.numel()
    n_anchors = min(blocks_per_sequence, T - 1 - prompt_len)
    anchors = prompt_len + torch.randperm(T - 1 - prompt_len, generator=generator)[:n_anchors]
    return block_loss(drafter, head, input_ids, hidden, anchors.sort().values.to(input_ids.device), weights)
