"""Domino (SpecForge `projector_type: domino`): the DFlash backbone and a prefix-GRU logit correction.

Config: SpecForge's export (a flat Qwen3 config, `architectures: ["DominoDraftModel"]`) whose
`dflash_config` holds, beside the backbone's mask_token_id and target_layer_ids, `projector_type:
domino`, `pure_draft_prefix_len` (default 0), `emb_dim`, `gru_hidden_dim` and `shift_label` (default
false) (docs/formats.md).

Block, with `shift_label` (the shipped configs): row k drafts the token at a + k + 1, and serving
(`spec_generate`) takes B - 1 proposals from rows 0 .. B-2 (row B-1 is trained, never proposed); without
it, DFlash's layout (rows 1 .. B-1, row k the token at a + k). Either way the j-th draft slot sees a GRU
(torch's, no biases) run over the target's embeddings of the block's tokens up to the one before the
slot: the anchor, then the earlier proposals (teacher-forced: the true tokens). Slots j >=
`pure_draft_prefix_len` get

    z = lm_head(h) + W2 silu(W1 [h ; g]) = [h ; silu(W1 [h ; g])] @ [lm_head ; W2]^T

(embed_proj = Linear W1 -> SiLU -> Linear W2, no biases), the others lm_head(h): linear in one wider
feature (zeros where uncorrected), so the streaming LM-head statistics score it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...checks import is_int
from ..drafter import DFlashDrafter

FIELDS = ("pure_draft_prefix_len", "emb_dim", "gru_hidden_dim", "shift_label")
"""Domino's fields of `dflash_config` (beside `projector_type`)."""


@dataclass(frozen=True)
class Settings:
    emb_dim: int  # width of embed_proj's middle
    gru_hidden_dim: int
    pure_draft_prefix_len: int = 0  # draft slots before this one keep the base logits
    shift_label: bool = False  # row k drafts a + k + 1 (B - 1 proposals from rows 0 .. B-2)

    def __post_init__(self) -> None:
        problems = [f"field {name!r} must be a positive integer; got {getattr(self, name)!r}"
                    for name in ("emb_dim", "gru_hidden_dim") if not is_int(getattr(self, name)) or getattr(self, name) < 1]
        if not is_int(self.pure_draft_prefix_len) or self.pure_draft_prefix_len < 0:
            problems.append(f"field 'pure_draft_prefix_len' must be an integer >= 0; got {self.pure_draft_prefix_len!r}")
        if not isinstance(self.shift_label, bool):
            problems.append(f"field 'shift_label' must be true or false; got {self.shift_label!r}")
        if problems:
            raise ValueError("; ".join(problems))


def read_config(raw: dict[str, Any]) -> tuple[dict[str, Any], Settings]:
    """The backbone in the published layout and Domino's fields, taken out of `dflash_config` (or
    the top level, where SpecForge's shipped configs repeat `emb_dim`; dflash_config wins)."""
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"field 'dflash_config' must be an object holding Domino's fields {list(FIELDS)}; "
                         f"got {dflash!r}")
    if raw.get("draft_vocab_size") not in (None, raw.get("vocab_size")):
        raise ValueError(f"field 'draft_vocab_size' is {raw['draft_vocab_size']!r}: a Domino drafter drafts over the "
                         "whole vocabulary (its embed_proj has vocab_size rows); no pruned vocabulary is defined for it")
    dflash.pop("projector_type", None)
    raw.pop("projector_type", None)
    values = {}
    for name in FIELDS:
        top, inner = raw.pop(name, None), dflash.pop(name, None)
        if inner is not None or top is not None:
            values[name] = inner if inner is not None else top
    missing = [name for name in ("emb_dim", "gru_hidden_dim") if name not in values]
    if missing:
        raise ValueError(f"no field {' or '.join(map(repr, missing))} in dflash_config: a Domino config names the width "
                         "of its GRU (gru_hidden_dim) and of embed_proj (emb_dim)")
    return raw, Settings(**values)


def write_config(settings: Settings, out: dict[str, Any]) -> None:
    """Domino's fields inside `dflash_config`, with `projector_type: domino`."""
    out["dflash_config"].update(projector_type="domino", **{name: getattr(settings, name) for name in FIELDS})


class Drafter(DFlashDrafter):
    """A Domino drafter: the backbone's tensors plus `prefix_gru.weight_{ih,hh}_l0` and
    `embed_proj.{0,2}.weight` (SpecForge's names)."""

    family = "domino"

    def __init__(self, config):
        super().__init__(config)
        settings: Settings = config.family_config
        self.settings = settings
        H = config.hidden_size
        self.prefix_gru = nn.GRU(H, settings.gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(H + settings.gru_hidden_dim, settings.emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(settings.emb_dim, config.vocab_size, bias=False))
        self.reset_parameters()  # the Linears of embed_proj; the GRU keeps torch's initialisation

    # ------------------------------------------------------------------ the family contract (scoring)
    def draft_rows(self, block_size: int) -> range:
        """shift_label: rows 0 .. B-2, row k drafting a + k + 1; else DFlash's rows 1 .. B-1."""
        return range(0, block_size - 1) if self.settings.shift_label else range(1, block_size)

    def slot_features(self, hidden: torch.Tensor, previous: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """[n, P, H + emb_dim]: each draft row's hidden state h and silu(W1 [h ; g]), g the GRU's state
        after the target embeddings of `previous` up to the slot's own (the anchor, then the true
        tokens); zeros for the slots before `pure_draft_prefix_len`."""
        rows = hidden[:, self.draft_rows(hidden.shape[1])]
        return self.row_features(rows, previous, embed)

    def row_features(self, rows: torch.Tensor, previous: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """`slot_features` of the given rows [n, P, H], slot j reading previous[:, :j+1] [n, P]."""
        states = self.prefix_gru(embed(previous).to(rows.dtype))[0]  # [n, P, G]
        correction = F.silu(self.embed_proj[0](torch.cat([rows, states], dim=-1)))
        plain = torch.arange(rows.shape[1], device=rows.device) < self.settings.pure_draft_prefix_len
        return torch.cat([rows, correction.masked_fill(plain[None, :, None], 0)], dim=-1)

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[V, H + emb_dim]: the LM head's rows beside embed_proj's last Linear."""
        return torch.cat([lm_head_weight, self.embed_proj[2].weight.to(lm_head_weight.dtype)], dim=1)

    ddtree_refusal = ("Domino's GRU makes each slot's distribution depend on the tokens drafted before it, so every "
                      "node of a DDTree tree would need its own GRU step and full-vocabulary head pass")

    def ddtree_streaks(self, stats, valid: torch.Tensor, budgets: list[int]) -> dict[int, torch.Tensor]:
        raise ValueError(self.ddtree_refusal)
