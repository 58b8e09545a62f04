"""DFlare (Tencent AngelSlim, `QwenDFlareDraftModel`): DFlash without `fc`. Each draft layer reads the
target through its own mix of the target layers and its own context projections:

    ctx_l = hidden_norm(sum_t softmax(layer_fusion_weights[l])_t * target_hidden[..., t])   [b, C, H]
    in layer l: k = k_norm([k_proj_target(ctx_l) ; k_proj(h)]), v = [v_proj_target(ctx_l) ; v_proj(h)]

(`layer_fusion_weights` [draft layers, target layers], pre-softmax; `hidden_norm` shared; t runs over
the target layers of `target_layer_ids`, each `hidden_size` wide, so the target's hidden size is the
drafter's). Everything else is DFlash's: the block (row 0 the anchor, row i >= 1 the token at a + i),
bidirectional inside it as the trainer's BlockMask and `spec_generate` run it, the argmax draft (never
tempered), independent slots (DDTree's closed form is exact).

RoPE: AngelSlim builds the drafter in bfloat16 (`create_draft_model`), which rounds the rotary
frequencies transformers keeps as a buffer (`inv_freq`) to bfloat16; its training and `spec_generate`
rotate with those rounded frequencies (cos/sin then computed in float32), and so does DFlare here. The
exact frequencies move the fixture's logits by 3.4e-3 at positions 3 .. 18; the phase error grows with
the position (a server that computes exact frequencies serves another model at long contexts).

Config: AngelSlim's `save_pretrained` folder, a flat Qwen3 config with `architectures:
["QwenDFlareDraftModel"]`, `block_size` at the top level and `mask_token_id`, `target_layer_ids` in
`dflash_config`; the training script's fields (`num_anchors`, `loss_decay_gamma`, `attention_backend`,
`aux_hidden_states_layer_ids`, ...) are kept and written back. Tensors: the backbone's without
`fc.weight`, plus `layer_fusion_weights` and `layers.N.self_attn.{k,v}_proj_target.weight`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..drafter import Context, DFlashAttention, DFlashDecoderLayer, DFlashDrafter, apply_rope

Settings = None  # DFlare has no fields beyond the backbone's


def read_config(raw: dict[str, Any]) -> tuple[dict[str, Any], None]:
    """`raw` as it is (the published layout); the training script's `aux_hidden_states_layer_ids`, the layers
    its target wrapper captures, must be the drafter's `target_layer_ids` (the script sets them so)."""
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    ids, aux = dflash.get("target_layer_ids", raw.get("target_layer_ids")), raw.get("aux_hidden_states_layer_ids")
    if aux is not None and ids is not None and aux != ids:
        raise ValueError(f"field 'aux_hidden_states_layer_ids' is {aux!r} but target_layer_ids is {ids!r}: the layers "
                         "AngelSlim's trainer captured are not the ones the drafter reads; the config contradicts itself")
    return raw, None


def write_config(settings: None, out: dict[str, Any]) -> None:
    """Nothing to add to the published layout (`architectures` is kept, QwenDFlareDraftModel when none)."""


class DFlareAttention(DFlashAttention):
    """DFlash's attention with the context's own key and value projections."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        width = self.n_kv_heads * self.head_dim
        self.k_proj_target = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.v_proj_target = nn.Linear(config.hidden_size, width, bias=config.attention_bias)

    def context_kv(self, context: Context):
        """Keys (through the shared k_norm, rotated) and values of the layer's own context."""
        b, n, _ = context.hidden.shape
        k = self.k_norm(self.k_proj_target(context.hidden).view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj_target(context.hidden).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, context.cos, context.sin), v


class DFlareDecoderLayer(DFlashDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DFlareAttention(config, layer_idx)


class Drafter(DFlashDrafter):
    """A DFlare drafter: `layer_fusion_weights`, `hidden_norm`, the layers (with `k_proj_target`,
    `v_proj_target`) and `norm`; no `fc`."""

    family = "dflare"
    decoder_layer = DFlareDecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.rotary_emb.inv_freq = self.rotary_emb.inv_freq.to(torch.bfloat16).float()  # AngelSlim's (module doc)
        del self.fc
        self.layer_fusion_weights = nn.Parameter(torch.empty(config.num_hidden_layers, len(config.target_layer_ids)))
        self.reset_parameters()

    @property
    def input_weight(self) -> torch.Tensor:
        return self.layer_fusion_weights

    def reset_parameters(self, std: float | None = None) -> None:
        """The backbone's initialisation; each draft layer's mix leaning on one target layer (logit 2, the others
        0): draft layer l on target layer floor(l * T / L)."""
        super().reset_parameters(std)
        weights = getattr(self, "layer_fusion_weights", None)
        if weights is None or weights.is_meta:
            return
        layers, targets = weights.shape
        with torch.no_grad():
            weights.zero_()
            for layer in range(layers):
                weights[layer, min(targets - 1, layer * targets // layers)] = 2.0

    def fusion_probs(self) -> torch.Tensor:
        """[draft layers, target layers]: each draft layer's softmax mix of the target layers."""
        return torch.softmax(self.layer_fusion_weights, dim=1)

    def layer_contexts(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Context]:
        """Per draft layer, hidden_norm of its mix of the target layers, with the context's RoPE."""
        self.check_target_hidden(target_hidden)
        b, n, _ = target_hidden.shape
        per_layer = target_hidden.view(b, n, len(self.config.target_layer_ids), self.config.hidden_size)
        fused = self.hidden_norm(torch.einsum("bnth,lt->bnlh", per_layer, self.fusion_probs().to(per_layer.dtype)))
        cos, sin = self.rotary_emb(position_ids.expand(b, -1), fused.dtype)
        return [Context(fused[:, :, layer], cos, sin) for layer in range(len(self.layers))]
