"""Block geometry, shared by training and scoring.

For a sequence tok[0..T) with prompt length P, an anchor a (P <= a <= T-2) gets the
block [tok[a], MASK x (B-1)] at positions a..a+B-1. The block sees the target context
[0, a) (never position a itself) and, bidirectionally, its own B positions; its labels
are tok[a+1 .. a+B-1], invalid past the end of the sequence. Many blocks are decoded
side by side in one forward: the context is [0, C) with C = the largest anchor, and
the block mask keeps every block to its own part of it and to itself.
"""

from __future__ import annotations

import torch


def anchor_range(prompt_len: int, num_tokens: int, window: int | None = None) -> range:
    """Valid anchors P .. T-2, cut to the first `window` tokens of the completion."""
    last = num_tokens - 2
    if window is not None:
        last = min(last, prompt_len + window - 1)
    return range(prompt_len, last + 1)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 proposals: int | None = None):
    """Block tokens [n, B], labels [n, P] (0 where invalid) and valid [n, P]: the tokens at a+1 .. a+P,
    P = `proposals` (default B-1: DFlash's layout, rows 1 .. B-1 draft; a family's `draft_rows`)."""
    proposals = block_size - 1 if proposals is None else proposals
    label_positions = anchors[:, None] + torch.arange(1, proposals + 1, device=input_ids.device)  # [n, P]
    valid = label_positions < input_ids.numel()
    labels = torch.where(valid, input_ids[label_positions.clamp(max=input_ids.numel() - 1)], 0)
    tokens = torch.full((anchors.numel(), block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    tokens[:, 0] = input_ids[anchors]
    return tokens, labels, valid


def block_positions(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[C + n*B]: the context's positions 0..C-1, then each block's a..a+B-1."""
    offsets = torch.arange(block_size, device=anchors.device)
    return torch.cat([torch.arange(context_len, device=anchors.device), (anchors[:, None] + offsets).flatten()])


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[n*B, C + n*B] boolean, True = attend: block i sees keys [0, a_i) and itself."""
    n = anchors.numel()
    query_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    key_pos = torch.arange(context_len, device=anchors.device)
    sees_context = key_pos[None, :] < anchors[query_block][:, None]  # [Q, C]
    sees_block = query_block[:, None] == query_block[None, :]  # [Q, Q]
    return torch.cat([sees_context, sees_block], dim=1)
