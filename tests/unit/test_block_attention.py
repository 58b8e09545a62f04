"""The scorer's two-part block attention against the one masked attention it replaces.

Tolerances. fp32: both compute the same softmax-weighted sums, in a different order
(one softmax over [context ; all blocks] against two softmaxes merged by their
log-sum-exp), so they agree to a few fp32 ulps of the O(1) outputs: 2e-6 is about 17
ulps at 1.0; the largest difference seen over these cases is 8e-7. bf16: the inputs
are bf16; the kernels accumulate in fp32 but round probabilities and outputs to bf16
(the two-part path rounds each part's output and then the merged one), so each path
is a few bf16 ulps (2^-8 relative) off the exact result. Both are checked against
fp64 on the same bf16 inputs within 2^-6 absolute plus 2^-6 relative (about 2 ulps at
1.0); the largest errors seen are 8.5e-3 (two parts) and 7.7e-3 (one part).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_callbacks import DFlashDrafter
from dflash_callbacks.model import block_attention as ba
from dflash_callbacks.model.attention import RULES, LayerAttention, resolve_attention
from dflash_callbacks.model.geometry import block_attention_mask, block_positions
from synthetic import drafter_config

HEADS, KV_HEADS, D = 4, 2, 8
FULL = LayerAttention()

CASES = {  # name: (block size, anchors, context length, the layer's pattern)
    "B=2": (2, [3, 4, 9], 9, FULL),
    "one block": (4, [5], 5, FULL),
    "many blocks": (6, list(range(7, 47)), 46, FULL),
    "near the start": (4, [0, 1, 2], 2, FULL),
    "only anchor 0": (3, [0], 0, FULL),
    "window < block": (6, [0, 1, 5, 11, 12], 12, LayerAttention(window=3)),
    "window 1": (4, [0, 2, 8], 8, LayerAttention(window=1)),
    "window > block": (4, [3, 10, 20, 21], 21, LayerAttention(window=7)),
    "context past the last anchor": (5, [2, 6, 7], 15, FULL),
    "causal, no window": (6, list(range(7, 30)), 29, LayerAttention(causal=True)),
    "causal, window < block": (6, [0, 1, 5, 11, 12], 12, LayerAttention(True, 3)),
    "causal, window > block": (4, [3, 10, 20, 21], 21, LayerAttention(True, 7)),
    "anchored, window < block": (6, [0, 1, 5, 11, 12], 12, LayerAttention(False, 3, anchored=True)),
    "anchored causal, window 1": (4, [0, 2, 8], 8, LayerAttention(True, 1, anchored=True)),
    "anchored causal, window > block": (4, [3, 10, 20, 21], 21, LayerAttention(True, 7, anchored=True)),
}


def inputs(B, anchors, C, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(anchors)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return randn(n, HEADS, B, D), randn(1, KV_HEADS, C, D), randn(1, KV_HEADS, C, D), randn(n, KV_HEADS, B, D), randn(n, KV_HEADS, B, D)


def one_part(q, k_ctx, v_ctx, k_blk, v_blk, anchors, pattern, math_dtype=None):
    """What DFlashAttention does with a dense block mask: one masked SDPA over
    [context ; every block] (in `math_dtype` when given, by explicit softmax), the
    pattern's rules written out on positions."""
    n, _, B, _ = q.shape
    C = k_ctx.shape[2]
    flat = lambda t: t.transpose(0, 1).reshape(1, t.shape[1], n * B, D)  # noqa: E731
    k, v = torch.cat([k_ctx, flat(k_blk)], dim=2), torch.cat([v_ctx, flat(v_blk)], dim=2)
    visible = block_attention_mask(anchors, B, C)
    positions = block_positions(anchors, B, C)
    q_pos, k_pos = positions[C:, None], positions[None, :]
    if pattern.causal:
        visible &= k_pos <= q_pos
    if pattern.window is not None and pattern.anchored:
        visible &= k_pos >= anchors.repeat_interleave(B)[:, None] - pattern.window
    elif pattern.window is not None:
        visible &= q_pos - k_pos < pattern.window
    if math_dtype is None:
        out = F.scaled_dot_product_attention(flat(q), k, v, attn_mask=visible, enable_gqa=True)
    else:
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1).to(math_dtype) for t in (k, v))
        scores = (flat(q).to(math_dtype) @ k.transpose(-1, -2)) * D**-0.5
        out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    return out[0].view(HEADS, n, B, D).transpose(0, 1)


def two_part(q, k_ctx, v_ctx, k_blk, v_blk, anchors, pattern):
    masks = ba.block_masks(anchors, q.shape[2], k_ctx.shape[2], pattern, q.dtype)
    return ba.block_attention(q, k_ctx, v_ctx, k_blk, v_blk, masks)


@pytest.fixture(params=["fused", "math"])
def backend(request, monkeypatch):
    """The fused CPU kernel, and the plain-torch one that other devices use."""
    if request.param == "math":
        monkeypatch.setattr(ba, "attention_with_lse", ba.attention_with_lse_math)
    return request.param


@pytest.mark.parametrize("case", CASES)
def test_two_parts_equal_one_masked_attention_fp32(case, backend):
    B, anchors, C, window = CASES[case]
    anchors = torch.tensor(anchors)
    x = inputs(B, anchors, C, torch.float32)
    new, old = two_part(*x, anchors, window), one_part(*x, anchors, window)
    assert new.shape == old.shape and new.dtype == torch.float32
    torch.testing.assert_close(new, old, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("case", ["B=2", "many blocks", "near the start", "window < block", "causal, window < block",
                                  "anchored causal, window > block"])
def test_two_parts_in_bf16_stay_within_bf16_rounding(case, backend):
    B, anchors, C, window = CASES[case]
    anchors = torch.tensor(anchors)
    x = inputs(B, anchors, C, torch.bfloat16, seed=1)
    exact = one_part(*x, anchors, window, math_dtype=torch.float64)
    new, old = two_part(*x, anchors, window), one_part(*x, anchors, window)
    assert new.dtype == torch.bfloat16
    torch.testing.assert_close(old.double(), exact, atol=2**-6, rtol=2**-6)
    torch.testing.assert_close(new.double(), exact, atol=2**-6, rtol=2**-6)


def test_fused_and_math_kernels_agree_with_lse():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 4, 10, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g)
    mask = ba.additive(torch.rand(10, 7, generator=g) < 0.7, torch.float32)
    mask[4] = float("-inf")  # a query that sees nothing: output 0
    out, lse = ba.attention_with_lse(q, k, v, mask)
    out_m, lse_m = ba.attention_with_lse_math(q, k, v, mask)
    torch.testing.assert_close(out, out_m, atol=2e-6, rtol=2e-6)
    assert not out[:, :, 4].any() and not out_m[:, :, 4].any()
    seen = torch.arange(10) != 4
    torch.testing.assert_close(lse[..., seen], lse_m[..., seen], atol=2e-6, rtol=2e-6)
    expected = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 8**-0.5 + mask).logsumexp(-1)
    torch.testing.assert_close(lse[..., seen], expected[..., seen], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("window", [None, 2, 9])
def test_decode_blocks_equals_forward_with_the_block_mask(window, rule, backend):
    """The drafter end to end, the scorer's path against the training path (one forward over
    many blocks with the block mask, as DFlashTrainingModule runs it): sliding and full layers,
    anchors from 0, under every attention rule."""
    torch.manual_seed(3)
    layer_types = ["sliding_attention", "full_attention"] if window else []
    drafter = DFlashDrafter(drafter_config(layer_types=layer_types, sliding_window=window)).eval()
    drafter.reset_parameters(std=0.3)
    attention = resolve_attention(drafter.config, rule)
    B, anchors = drafter.block_size, torch.tensor([0, 1, 4, 5, 6, 13])
    C = int(anchors.max())
    hidden = torch.randn(1, C, drafter.config.num_target_features)
    noise = torch.randn(len(anchors), B, drafter.config.hidden_size)
    with torch.no_grad():
        old = drafter(hidden, noise.flatten(0, 1)[None], block_positions(anchors, B, C)[None],
                      block_attention_mask(anchors, B, C), attention=attention)
        new = drafter.decode_blocks(drafter.encode_context(hidden, torch.arange(C)[None]), noise, anchors, attention)
        alone = [drafter(hidden[:, :a], noise[i : i + 1], torch.arange(a + B)[None], attention=attention)
                 for i, a in enumerate(anchors.tolist())]  # one block, no mask: as the live loop runs it
    torch.testing.assert_close(new, old.view(len(anchors), B, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_float64_decodes_exactly_as_the_dense_forward():
    """A float64 drafter: the merge runs in float64 (it used to fail on torch.lerp's dtype)."""
    torch.manual_seed(4)
    drafter = DFlashDrafter(drafter_config(sliding_window=3)).double().eval()
    drafter.reset_parameters(std=0.3)
    B, anchors = drafter.block_size, torch.tensor([0, 2, 7, 11])
    C = int(anchors.max())
    hidden = torch.randn(1, C, drafter.config.num_target_features, dtype=torch.float64)
    noise = torch.randn(len(anchors), B, drafter.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        new = drafter.decode_blocks(drafter.encode_context(hidden, torch.arange(C)[None]), noise, anchors)
        old = drafter(hidden, noise.flatten(0, 1)[None], block_positions(anchors, B, C)[None],
                      block_attention_mask(anchors, B, C))
    assert new.dtype == torch.float64
    torch.testing.assert_close(new, old.view(len(anchors), B, -1), atol=1e-12, rtol=1e-12)
