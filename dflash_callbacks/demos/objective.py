"""The published DFlash training objective, in plain PyTorch (no framework): what the demo, the
toy baseline and the examples train with, and the reference a user can hold their own training
step against. `dflash_callbacks.training.DFlashTrainingModule` is the same objective as a
LightningModule.

Per sequence (target tokens and hidden states from a cache-format folder), draw
`blocks_per_sequence` random anchors inside the completion. Each block is the anchor
token followed by B-1 mask tokens; it sees the target context before its anchor and
itself, never another block (the scorer's block mask). The loss is the cross-entropy
at block positions d = 1..B-1 against the target's tokens tok[a+d], weighted by
exp(-(d-1)/gamma) (gamma 7 for B = 16, 4 for B = 8), averaged over valid labels. A DFlash 2
drafter adds its selector's loss (`model.families.dflash2.Drafter.selector_loss`): the
cross-entropy over each slot's K candidates given the true token before it, where the label is
one of them, with the same weights.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..cache.format import HiddenStateCache
from ..model import DFlashDrafter, TargetHead
from ..model.geometry import block_attention_mask, block_inputs, block_positions


def default_gamma(block_size: int) -> float:
    """7 for B = 16 and 4 for B = 8 (the published settings), linear in between."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(1.0, 0.4375 * block_size))


def depth_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(d-1)/gamma) for d = 1..B-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


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


def sequence_loss(drafter: DFlashDrafter, head: TargetHead, input_ids: torch.Tensor, hidden: torch.Tensor,
                  prompt_len: int, blocks_per_sequence: int, weights: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
    """The weighted block cross-entropy of one sequence, at `blocks_per_sequence` anchors drawn
    with `generator` (never the global RNG); `weights` are `depth_weights` on the drafter's device."""
    B, T = drafter.config.block_size, input_ids.numel()
    n_anchors = min(blocks_per_sequence, T - 1 - prompt_len)
    anchors = prompt_len + torch.randperm(T - 1 - prompt_len, generator=generator)[:n_anchors]
    anchors = anchors.sort().values.to(input_ids.device)
    tokens, labels, valid = block_inputs(input_ids, anchors, B, drafter.mask_token_id)
    C = int(anchors.max())
    positions = block_positions(anchors, B, C)
    out = drafter(
        hidden[:C][None].to(drafter.fc.weight.dtype),
        head.embed_tokens(tokens).flatten(0, 1)[None],
        positions[None],
        block_attention_mask(anchors, B, C),
    )
    drafts = out.view(n_anchors, B, -1)[:, 1:]
    logits = head.lm_head(drafts).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n_anchors, B - 1)
    w = weights[None, :] * valid
    loss = (ce * w).sum() / w.sum()
    if drafter.family == "dflash2":  # and its selector's, given the true token before each slot
        previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
        loss = loss + drafter.selector_loss(drafts, logits, labels, previous, w)
    return loss
