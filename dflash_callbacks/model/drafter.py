"""The DFlash drafter: a small block-diffusion model conditioned on target hidden states.

Architecture (the published one, written from its description):

    ctx   = hidden_norm(fc(concat of target hidden states at target_layer_ids))   [b, C, H]
    x     = noise embedding of the block: embed([anchor, MASK, ..., MASK])        [b, Q, H]
    every layer (Qwen3-style pre-norm):
        h = input_layernorm(x)
        q = q_norm(q_proj(h))                        queries from the block only
        k = k_norm(k_proj([ctx ; h])), v = v_proj([ctx ; h])
                                                     keys/values: context then block
        RoPE at the context positions and the block positions
        x = x + o_proj(attention(q, k, v, mask))
        x = x + mlp(post_attention_layernorm(x))
    out   = norm(x)                                                                [b, Q, H]

The context enters every layer un-normed (only `hidden_norm` after `fc`), the block
through the layer's `input_layernorm`. What each layer sees inside the block (causal or
bidirectional, and a sliding layer's window) is its `LayerAttention` (`model.attention`):
by default as vLLM serves the drafter, or under another rule passed as `attention=`.

The drafter has no embedding and no LM head: the target's are used (see TargetHead). A
folder that stores them (speculators) has them checked against the target's
(`head_problems`), never used in their place. A pruned draft vocabulary
(`config.draft_vocab_size`, the tensor `d2t`: draft index i is target id i + d2t[i]) draws
its logits from the target's LM head rows of `vocab_ids`.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from ..kernels.ddtree import ddtree_streaks_from_stats
from ..kernels.head_stats import HeadStats, head_stats, head_stats_tempered
from .attention import LayerAttention, resolve_attention
from .block_attention import BlockMasks, additive, block_attention, block_masks
from .config import DrafterConfig
from .families import family_named

STORED_HEAD = ("embed_tokens.weight", "lm_head.weight", "t2d")
"""Tensors a speculators folder stores beside the drafter's own: the target's embedding and
(draft-vocabulary rows of the) LM head, and the target -> draft vocabulary mask."""


def qwen3_config(config: DrafterConfig) -> Qwen3Config:
    """A transformers Qwen3Config for the parts reused from transformers (RMSNorm, MLP, RoPE)."""
    return Qwen3Config(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=dict(config.rope_parameters),
        vocab_size=config.vocab_size,
    )


class RotaryEmbedding(nn.Module):
    """cos/sin for positions. The frequencies come from transformers' RoPE code (every
    rope_type it knows) and are held outside the module's buffers, so they stay fp32
    when the drafter is cast to bf16 and are never part of a state dict."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        with torch.device("cpu"):  # also when the drafter is built on the meta device
            rope = Qwen3RotaryEmbedding(qwen3_config(config))
        self.inv_freq = rope.inv_freq.detach().clone().float()  # a plain tensor, not a buffer
        self.attention_scaling = rope.attention_scaling

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def as_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (True = attend) or additive float mask -> additive float mask."""
    return additive(mask, dtype) if mask.dtype == torch.bool else mask.to(dtype)


class Context(NamedTuple):
    """The drafter's context input: hidden_norm(fc(target features)) [b, C, H] and its RoPE."""

    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class DFlashAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        H, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, context: "Context"):
        """Keys and values of the context; they do not depend on the block."""
        return self._kv(context.hidden, context.cos, context.sin)

    def forward(self, x, context, rope_block, mask):
        """x [b, Q, H] (normed block); context: a `Context` (projected here) or this
        layer's precomputed (keys, values). mask: additive [b|1, 1|heads, Q, C+Q] or None,
        one attention over [context ; block]; or `BlockMasks`: x holds b blocks of Q
        queries each, attending to [0, a_i) and to themselves (`block_attention`)."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_block)
        k_ctx, v_ctx = self.context_kv(context) if isinstance(context, Context) else context
        k_blk, v_blk = self._kv(x, *rope_block)
        if isinstance(mask, BlockMasks):
            out = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask)
        else:
            k = torch.cat([k_ctx.expand(b, -1, -1, -1), k_blk], dim=2)
            v = torch.cat([v_ctx.expand(b, -1, -1, -1), v_blk], dim=2)
            # on the CPU, the math kernel: the fused one rounds by the CPU's vector width (AVX2 or AVX-512),
            # enough to move a logit 2e-5 off the trainers' own numbers on one machine and not another
            with sdpa_kernel(SDPBackend.MATH) if q.device.type == "cpu" else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(qwen3_config(config))
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, rope_block, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The DFlash drafter. `state_dict()` keys are the published ones
    (`fc.weight`, `hidden_norm.weight`, `layers.{i}.…`, `norm.weight`, and `d2t` for a
    pruned draft vocabulary). `attention`: each layer's pattern as vLLM serves it, what
    `forward` and `decode_blocks` apply unless given another.

    It is the backbone of every family (`model.families`); a family's drafter subclasses it and
    overrides the family contract below (`draft_rows`, `slot_features`, `head_weight`, `slot_stats`,
    `ddtree_streaks`, `ddtree_refusal`, `confidence_refusal`), which the scorer calls, and where its
    layers read the target otherwise, `layer_contexts` and `input_weight`."""

    family = "dflash"  # the family this class implements (model.families)
    decoder_layer: type[nn.Module] = DFlashDecoderLayer  # the class of each layer

    def __init__(self, config: DrafterConfig):
        super().__init__()
        if config.family != self.family:
            raise ValueError(f"a {family_named(config.family).title} config builds a {config.family} drafter, not a "
                             f"{type(self).__name__}: use dflash_callbacks.build_drafter(config)")
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.num_target_features, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        if config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.attention = resolve_attention(config)
        self.stored_head: dict[str, torch.Tensor] = {}  # what a folder stored of the target's head (checked, not used)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """The target ids of a pruned draft vocabulary, ascending (int64 [draft_vocab_size]);
        None when the drafter drafts over the whole vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def head_problems(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> list[str]:
        """What of the head this drafter's folder stored (`stored_head`) differs from the target's
        embedding and LM head (the LM head's `vocab_ids` rows for a pruned vocabulary), compared
        exactly in the stored dtype, one line per tensor; empty when it all agrees or none was stored."""
        ids = self.vocab_ids
        targets = {"embed_tokens.weight": (embed_weight, None), "lm_head.weight": (lm_head_weight, ids)}
        problems = []
        for name, (target, rows) in targets.items():
            stored = self.stored_head.get(name)
            if stored is None:
                continue
            expected = (target.shape[0] if rows is None else rows.numel(), target.shape[1])
            if tuple(stored.shape) != expected:
                problems.append(f"the drafter's stored {name} has shape {list(stored.shape)}, the target's "
                                f"{'rows of its vocabulary ' if rows is not None else ''}{list(expected)}: it was made "
                                "for another target")
                continue
            differing = 0
            for start in range(0, expected[0], 8192):  # row chunks: no second copy of a large head at once
                stop = min(start + 8192, expected[0])
                want = target[start:stop] if rows is None else target[rows[start:stop].to(target.device)]
                differing += int((want.to(stored.dtype).cpu() != stored[start:stop]).any(dim=-1).sum())
            if differing:
                problems.append(f"the drafter's stored {name} differs from the target's in {differing} of "
                                f"{expected[0]} rows: it was trained against another target; score it with that one")
        return problems

    def reset_parameters(self, std: float | None = None) -> None:
        """Linear weights ~ N(0, initializer_range), biases and norms as in a fresh Qwen3."""
        std = self.config.extra.get("initializer_range", 0.02) if std is None else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        target_hidden: torch.Tensor,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attention: list[LayerAttention] | None = None,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Normed hidden states of the block positions.

        target_hidden   [b, C, n_layers*H]  target features of the context
        noise_embedding [b, Q, H]           target embeddings of the block tokens
        position_ids    [b|1, C+Q]          positions of the context, then of the block
        attention_mask  [b|1, 1|heads, Q, C+Q] (or [Q, C+Q]) boolean (True = attend) or
                        additive float; None: the queries are one block, which sees the
                        whole context and itself.
        attention       each layer's pattern (default `self.attention`), applied on top of
                        the mask: a causal layer hides a block key from a query at an earlier
                        position; a window counts back from each query's position, or, anchored,
                        from its block's anchor (the smallest position of a block key it sees).
        block_size      the queries are blocks of this many consecutive rows (default the config's),
                        for a family whose layers mix the rows of a block (DFlash 2's convolution);
                        DFlash's layers do not read it.
        Returns [b, Q, H].
        """
        C = target_hidden.shape[1]
        if position_ids.shape[-1] != C + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids has length {position_ids.shape[-1]}; expected context + block = "
                f"{C} + {noise_embedding.shape[1]}"
            )
        # each layer projects the context inside its own forward (so per-layer FSDP
        # sharding, which gathers a layer's weights around its forward, works)
        contexts = self.layer_contexts(target_hidden, position_ids[..., :C])
        b, Q = noise_embedding.shape[:2]
        position_ids = position_ids.expand(b, C + Q)
        rope_block = self.rotary_emb(position_ids[:, C:], noise_embedding.dtype)
        masks = self._layer_masks(attention_mask, position_ids, C, Q, noise_embedding.dtype, attention or self.attention)
        return self._layers(noise_embedding, contexts, rope_block, masks, block_size or self.config.block_size)

    @property
    def input_weight(self) -> torch.Tensor:
        """The weight the target's hidden states meet first (`fc`'s; a family without `fc` names its
        own): the drafter's inputs take its dtype and device."""
        return self.fc.weight

    def check_target_hidden(self, target_hidden: torch.Tensor) -> None:
        if target_hidden.shape[-1] != self.config.num_target_features:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features; this drafter expects "
                f"{len(self.config.target_layer_ids)} layers x {self.config.hidden_size} = "
                f"{self.config.num_target_features}"
            )

    def context(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> Context:
        """hidden_norm(fc(target_hidden)) and its RoPE at `position_ids` [b|1, C]."""
        self.check_target_hidden(target_hidden)
        ctx = self.hidden_norm(self.fc(target_hidden))
        return Context(ctx, *self.rotary_emb(position_ids.expand(ctx.shape[0], -1), ctx.dtype))

    def layer_contexts(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Context]:
        """The context each layer attends to, one `Context` per layer. DFlash: one `context` for all; a
        family that mixes the target's layers per draft layer (DFlare) gives each its own."""
        return [self.context(target_hidden, position_ids)] * len(self.layers)

    def encode_context(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> list:
        """Per layer, the keys and values of the context (projected, k-normed, rotated).
        Blocks decoded against it share it, so the scorer computes it once per task and
        layer (inference only: it calls the layers' projections outside their forward)."""
        contexts = self.layer_contexts(target_hidden, position_ids)
        return [layer.self_attn.context_kv(context) for layer, context in zip(self.layers, contexts, strict=True)]

    @torch.no_grad()
    def decode_blocks(self, context: list, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                      attention: list[LayerAttention] | None = None) -> torch.Tensor:
        """Blocks decoded side by side against the per-layer context keys and values of
        `encode_context` (inference only): block i, at positions a_i .. a_i+B-1, sees
        the context [0, a_i) and itself (`block_attention`), as each layer's pattern
        (`attention`, default `self.attention`) allows.

        context         per layer (keys, values) [1, kv_heads, C, head_dim], C >= max anchor
        noise_embedding [n, B, H]  target embeddings of the block tokens
        anchors         [n]
        Returns [n, B, H].
        """
        B, C = noise_embedding.shape[1], context[0][0].shape[2]
        positions = anchors[:, None] + torch.arange(B, device=anchors.device)
        rope_block = self.rotary_emb(positions, noise_embedding.dtype)
        attention = attention or self.attention
        masks = {p: block_masks(anchors, B, C, p, noise_embedding.dtype) for p in set(attention)}
        return self._layers(noise_embedding, context, rope_block, [masks[p] for p in attention], B)

    def _layers(self, x, per_layer_context, rope_block, masks: list, block_size: int) -> torch.Tensor:
        """The layers and the final norm over x [b, Q, H], blocks of `block_size` rows (unread here)."""
        for layer, context, mask in zip(self.layers, per_layer_context, masks, strict=True):
            x = layer(x, context, rope_block, mask)
        return self.norm(x)

    def _layer_masks(self, attention_mask, position_ids, C, Q, dtype, attention: list[LayerAttention]) -> list:
        """Per layer, the additive mask [b|1, 1|heads, Q, C+Q] (or None: all visible): the
        given mask, and what the layer's pattern hides."""
        base = None
        if attention_mask is not None:
            if attention_mask.shape[-2:] != (Q, C + Q):
                raise ValueError(
                    f"attention_mask ends in {tuple(attention_mask.shape[-2:])}; expected (block {Q}, context+block {C + Q})"
                )
            base = as_additive_mask(attention_mask, dtype)
            while base.dim() < 4:
                base = base.unsqueeze(0)
        q_pos, k_pos = position_ids[:, C:, None], position_ids[:, None, :]  # [b, Q, 1], [b, 1, C+Q]
        masks = {}
        for pattern in set(attention):
            rules = []  # [b, Q, C+Q] bool each, True = the pattern lets the query see the key
            if pattern.causal:
                rules.append(k_pos <= q_pos)
            if pattern.window is not None and pattern.anchored:
                rules.append(k_pos >= self._block_anchors(base, position_ids[:, C:]) - pattern.window)
            elif pattern.window is not None:
                in_block = torch.arange(C + Q, device=q_pos.device) >= C  # the block's own keys: [C+Q]
                rules.append((q_pos - k_pos < pattern.window) | (in_block & pattern.context_only))
            if not rules:
                masks[pattern] = base
                continue
            hidden = additive(torch.stack(rules).all(dim=0).unsqueeze(1), dtype)  # [b, 1, Q, C+Q]
            masks[pattern] = hidden if base is None else base + hidden
        return [masks[p] for p in attention]

    @staticmethod
    def _block_anchors(base, block_positions: torch.Tensor) -> torch.Tensor:
        """[b, Q, 1]: each query's anchor, the smallest position of a block key it sees (all
        the block's without a mask)."""
        if base is None:
            return block_positions.amin(dim=-1, keepdim=True)[:, None, :].expand(-1, block_positions.shape[1], 1)
        sees = base[:, 0, :, -block_positions.shape[1]:] == 0  # [b|1, Q, Q]
        big = torch.iinfo(block_positions.dtype).max
        return torch.where(sees, block_positions[:, None, :], big).amin(dim=-1, keepdim=True)

    # ------------------------------------------------------------------ the family contract (scoring)
    def draft_rows(self, block_size: int) -> range:
        """The rows of a decoded block of `block_size` that draft, in order: the i-th drafts the token at
        anchor + 1 + i. DFlash: row 0 holds the anchor, rows 1 .. B-1 draft."""
        return range(1, block_size)

    def slot_features(self, hidden: torch.Tensor, previous: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """[n, P, H'] what the head (`head_weight`) reads at each draft slot, teacher-forced: `hidden`
        [n, B, H] the decoded blocks, `previous` [n, P] the true token before each slot (the anchor,
        then the labels: target ids), `embed` the target's embedding. DFlash: the draft rows."""
        rows = self.draft_rows(hidden.shape[1])
        return hidden[:, rows.start : rows.stop]

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[V', H'] what the slot features are scored against: the target's LM head (the rows of a pruned
        draft vocabulary, `vocab_ids`)."""
        ids = self.vocab_ids
        return lm_head_weight if ids is None else lm_head_weight[ids.to(lm_head_weight.device)]

    def slot_stats(self, features: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, previous: torch.Tensor,
                   top_n: int, backend: str = "auto", chunk_size: int | None = None,
                   temperature: float | None = None) -> HeadStats:
        """The statistics of the drafter's distribution at each draft slot that the methods read
        (`kernels.head_stats.HeadStats`, one row per slot, [n * P]: the label's log-prob, rank and order,
        the top-N log-probs), teacher-forced: `features` [n, P, H'] (`slot_features` of n blocks),
        `labels` [n, P] (ids of `weight`'s rows), `previous` [n, P] the true token before each slot.
        DFlash: the fused LM-head statistics, never materialising [n * P, V]; with `temperature`, also the
        label's log-prob under softmax(logits / T) (`head_stats_tempered`: a draft sampled at T)."""
        if temperature is not None:
            return head_stats_tempered(features.flatten(0, 1), weight, labels.flatten(), top_n, temperature,
                                       backend=backend, chunk_size=chunk_size)
        return head_stats(features.flatten(0, 1), weight, labels.flatten(), top_n, backend=backend,
                          chunk_size=chunk_size)

    ddtree_refusal: str | None = None
    """Why DDTree can not be scored for this family (None: `ddtree_streaks` scores it exactly)."""

    confidence_refusal: str | None = "it has no confidence head"
    """Why this drafter's block can not be cut by a confidence threshold (`ScoringConfig.confidence_threshold`;
    None: `confidence_logits(hidden, previous)` gives the logit of each draft slot's confidence, DSpark's head)."""

    def ddtree_streaks(self, stats: HeadStats, valid: torch.Tensor, budgets: list[int]) -> dict[int, torch.Tensor]:
        """DDTree streak per anchor for each node budget ({N: int64 [n]}) from `slot_stats`' statistics
        viewed as [n, P] (valid [n, P]). DFlash: slots are independent given the context, so the closed
        form over the top-N log-probs of each depth is exact (`kernels.ddtree`)."""
        return ddtree_streaks_from_stats(stats, valid, budgets)

    @classmethod
    def from_state_dict(cls, config: DrafterConfig, state_dict, *, dtype=None, device=None) -> "DFlashDrafter":
        """A drafter holding exactly `state_dict` (published keys; those of `STORED_HEAD` go to
        `stored_head`, to be checked against the target's). Missing, unexpected or mis-shaped
        tensors raise one error listing each with expected and found shape; a draft
        vocabulary map that is not ascending target ids, or disagrees with `t2d`, is refused."""
        own, stored = split_stored_head(state_dict)
        with torch.device("meta"):
            model = cls(config)
        V, H = config.vocab_size, config.hidden_size
        heads = {"embed_tokens.weight": (V, H), "lm_head.weight": (config.draft_vocab_size or V, H), "t2d": (V,)}
        check_state_dict({**model.state_dict(), **{k: torch.empty(heads[k], device="meta") for k in stored}},
                         {**own, **stored})
        check_vocab_map(config, own.get("d2t"), stored.get("t2d"))
        model.load_state_dict(own, strict=True, assign=True)
        model.stored_head = stored
        return model.to(device=device, dtype=dtype).eval()  # a dtype cast leaves d2t (integer) alone


def build_drafter(config: DrafterConfig) -> DFlashDrafter:
    """A fresh drafter of `config`'s family (`model.families`), initialised as a fresh Qwen3."""
    return drafter_class(config)(config)


def drafter_class(config: DrafterConfig) -> type[DFlashDrafter]:
    """The drafter class of `config`'s family."""
    return family_named(config.family).load().Drafter


def split_stored_head(state: dict) -> tuple[dict, dict]:
    """(the drafter's own entries, those of `STORED_HEAD`) of a state dict, or of any mapping
    keyed by tensor name (shapes, for a check without the tensors)."""
    own = {k: v for k, v in state.items() if k not in STORED_HEAD}
    return own, {k: v for k, v in state.items() if k in STORED_HEAD}


def check_vocab_map(config: DrafterConfig, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> None:
    """A pruned draft vocabulary (`d2t`: draft index i is target id i + d2t[i]) names distinct
    target ids in ascending order (so ties between draft logits go to the lower target id, as
    over the whole vocabulary), all below vocab_size; a stored `t2d` marks exactly those ids."""
    vocab_ids = None
    if d2t is not None:
        if d2t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tensor 'd2t' is {d2t.dtype}; integer offsets (int64) were expected")
        vocab_ids = torch.arange(d2t.numel()) + d2t.long().cpu()
        if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= config.vocab_size or not bool(
            (vocab_ids[1:] > vocab_ids[:-1]).all()
        ):
            raise ValueError(f"tensor 'd2t' does not map the draft vocabulary to ascending target ids below "
                             f"{config.vocab_size} (draft index i is target id i + d2t[i])")
    if t2d is not None:
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (config.vocab_size,):
            raise ValueError(f"tensor 't2d' is {t2d.dtype} {list(t2d.shape)}; a bool [{config.vocab_size}] mask of "
                             "the target ids in the draft vocabulary was expected")
        marked = t2d.cpu().nonzero().flatten()
        expected = torch.arange(config.vocab_size) if vocab_ids is None else vocab_ids
        if not torch.equal(marked, expected):
            raise ValueError(f"tensors 't2d' and 'd2t' disagree: t2d marks {marked.numel()} target ids, d2t maps the "
                             f"draft vocabulary to {expected.numel()} others")


def check_state_dict(expected: dict, found: dict) -> None:
    problems = []
    for key, tensor in expected.items():
        if key not in found:
            problems.append(f"missing tensor {key!r} (expected shape {list(tensor.shape)})")
        elif tuple(found[key].shape) != tuple(tensor.shape):
            problems.append(
                f"tensor {key!r} has shape {list(found[key].shape)}; expected {list(tensor.shape)}"
            )
    problems += [f"unexpected tensor {key!r} (shape {list(found[key].shape)})" for key in found if key not in expected]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError("drafter weights do not match the config:\n  " + "\n  ".join(shown))
