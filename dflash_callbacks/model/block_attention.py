"""Attention of many blocks decoded side by side, in two exact parts (the scorer's path).

Block i (anchor a_i, queries at positions a_i .. a_i+B-1) attends to the context keys
[0, a_i) and to its own B keys. As one masked attention over [context ; every block]
(`DFlashAttention` with a dense mask, what training uses) the block part is an
[n*B, n*B] matrix of which only the n diagonal [B, B] blocks are kept. Here the two
parts are computed apart, each with its log-sum-exp:

    context  queries [1, heads, n*B, d] against keys [0, C), a per-block prefix mask
    blocks   queries [n, heads, B, d] against their own keys [n, kv_heads, B, d]

and merged exactly: the context holds the share w = e^lse_c / (e^lse_c + e^lse_b)
= sigmoid(lse_c - lse_b) of each query's softmax mass, so
    out = (1 - w) * out_b + w * out_c.
A layer's `LayerAttention` shapes both masks: a causal layer hides a block's later keys
from each query; a sliding window hides keys at positions <= q_pos - window in both parts
(in the context part only, `context_only`), or, anchored, context keys before a_i - window.

The merge runs in fp32, or in the inputs' dtype when it is wider (float64 stays exact).
Inference only: the log-sum-exp of the fused CPU kernel carries no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import LayerAttention


class BlockMasks(NamedTuple):
    """The masks of `block_attention` for one layer pattern."""

    context: torch.Tensor  # additive [n*B, C]: block i sees keys [0, a_i) (and its window)
    sees_context: torch.Tensor  # bool [n*B]: the query sees at least one context key
    block: torch.Tensor | None  # additive [B, B] within a block (causal, sliding window), or None: all visible


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (True = attend) -> additive float mask (0 or -inf)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def block_masks(anchors: torch.Tensor, block_size: int, context_len: int, attention: LayerAttention, dtype) -> BlockMasks:
    """Masks of the blocks at `anchors` [n] against context keys [0, context_len), for a
    layer of pattern `attention`."""
    n, B, window = anchors.numel(), block_size, attention.window
    offsets = torch.arange(B, device=anchors.device)
    k_pos = torch.arange(context_len, device=anchors.device)
    visible = k_pos < anchors[:, None, None]  # [n, 1, C]: block i sees keys [0, a_i)
    sees_context = (anchors[:, None] > 0).expand(n, B)  # its nearest context key is a_i - 1
    inside = None  # [B, B] bool: the block keys each query sees (None: all)
    if window is not None and attention.anchored:  # context keys [a_i - window, a_i); the block whole
        visible = visible & (k_pos >= anchors[:, None, None] - window)
    elif window is not None:  # keys at positions <= q_pos - window are hidden
        visible = visible & (anchors[:, None, None] + offsets[:, None] - k_pos < window)  # [n, B, C]
        sees_context = sees_context & (offsets + 1 < window)
        inside = None if attention.context_only else offsets[:, None] - offsets < window
    if attention.causal:  # query j sees block keys 0 .. j
        causal = offsets[:, None] >= offsets
        inside = causal if inside is None else inside & causal
    context = additive(visible, dtype).expand(n, B, context_len).reshape(n * B, context_len)
    return BlockMasks(context, sees_context.reshape(n * B), None if inside is None else additive(inside, dtype))


def attention_with_lse(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v and its log-sum-exp [.., heads, L] (fp32).
    q [b, heads, L, d]; k, v [b, kv_heads, S, d] (grouped-query heads); mask additive,
    broadcast to [b, heads, L, S] or None. A query that sees no key gets output 0 (and
    an lse that means nothing)."""
    if q.device.type == "cpu":  # PyTorch's fused CPU flash attention, which returns the lse
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
    return attention_with_lse_math(q, k, v, mask)


def attention_with_lse_math(q, k, v, mask):
    """`attention_with_lse` in plain torch ops, on every device; the scores [b, heads,
    L, S] are materialised once, in fp32 (float64 for float64 inputs)."""
    group, work = q.shape[1] // k.shape[1], merge_dtype(q.dtype)
    k, v = (t.repeat_interleave(group, dim=1).to(work) for t in (k, v))
    scores = torch.matmul(q.to(work), k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores.add_(mask)
    lse = scores.logsumexp(dim=-1)
    probs = scores.sub_(lse[..., None]).exp_().nan_to_num_(0.0)  # a query that sees no key: 0
    return torch.matmul(probs, v).to(q.dtype), lse


def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, masks: BlockMasks) -> torch.Tensor:
    """Attention of n blocks of B queries each: q [n, heads, B, d]; context keys and
    values [1, kv_heads, C, d]; block keys and values [n, kv_heads, B, d].
    Returns [n, heads, B, d] in the dtype of q."""
    n, heads, B, d = q.shape
    # the block part: scores [n, heads, B, B], small (plain ops beat the fused kernel here)
    out, lse = attention_with_lse_math(q, k_blk, v_blk, masks.block)  # every query sees itself
    if k_ctx.shape[2] == 0:  # no context key at all (the CPU kernel does not take an empty one)
        return out
    q_ctx = q.transpose(1, 2).reshape(1, n * B, heads, d).transpose(1, 2)  # [1, heads, n*B, d]
    out_ctx, lse_ctx = attention_with_lse(q_ctx, k_ctx, v_ctx, masks.context)
    out_ctx = out_ctx[0].view(heads, n, B, d).transpose(0, 1)
    lse_ctx = lse_ctx[0].view(heads, n, B).transpose(0, 1)
    # the context's share of each query's softmax mass: e^lse_ctx / (e^lse_ctx + e^lse)
    work = merge_dtype(q.dtype)
    share = torch.sigmoid(lse_ctx.to(work) - lse.to(work)).masked_fill_(~masks.sees_context.view(n, 1, B), 0.0)
    return torch.lerp(out.to(work), out_ctx.to(work), share[..., None]).to(q.dtype)


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)
