"""DSpark (DeepSeek's DeepSpec; speculators `speculators_model_type: dspark`): the DFlash backbone, a
Markov head and a confidence head.

Configs, one set of fields in two layouts (docs/formats.md):
- speculators' folder: `speculators_model_type: dspark`, the Qwen3 config nested in
  `transformer_layer_config`, `aux_hidden_state_layer_ids` = target layer ids + 1, and flat
  `sample_from_anchor`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov` (absent ones take speculators' defaults: true, 256, vanilla, true, true);
- DeepSpec's (`architectures: ["Qwen3DSparkModel"]`): a flat Qwen3 config with `block_size`,
  `mask_token_id`, `target_layer_ids` and the same head fields (absent: DeepSpec's meaning, no head);
  it also stores the target's `embed_tokens` / `lm_head`, checked against the target as speculators'
  stored head is (`DFlashDrafter.head_problems`).

Block: with `sample_from_anchor` (the default) every row drafts, row k the token at a + k + 1 (B
proposals; the anchor's own slot drafts the first); without it, DFlash's layout (rows 1 .. B-1, row
k the token at a + k). The Markov head (`vanilla`: markov_w1 [V, r] embeds the token before the slot,
markov_w2 [V', r] maps it to a logit bias) makes a slot's logits

    z = lm_head(h) + markov_w2(markov_w1[prev]) = [h ; markov_w1[prev]] @ [lm_head ; markov_w2]^T,

prev the token before the slot (the anchor for the first): linear in one wider feature, so the
streaming LM-head statistics score it exactly (`slot_features`, `head_weight`). The confidence head
is a Linear(H (+ r), 1) on [h ; markov_w1[prev]] (or h): a logit of the chance the slot is accepted.
DeepSpec's evaluation cuts the proposal before the first slot whose sigmoid(confidence) is below a
threshold (`confidence_cut`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ...checks import is_int
from ..config import from_speculators
from ..drafter import DFlashDrafter

MARKOV_HEAD_TYPES = ("vanilla",)
"""Markov heads scored here; speculators and DeepSpec also define 'gated' and 'rnn' (refused)."""
SPECULATORS_DEFAULTS = {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
                        "enable_confidence_head": True, "confidence_head_with_markov": True}
"""speculators' DSparkSpeculatorConfig defaults, for a field its folder leaves out."""
FLAT_DEFAULTS = {"sample_from_anchor": True, "markov_rank": 0, "markov_head_type": "vanilla",
                 "enable_confidence_head": False, "confidence_head_with_markov": False}
"""A flat (DeepSpec) config's meaning of an absent field: no Markov head, no confidence head."""


@dataclass(frozen=True)
class Settings:
    sample_from_anchor: bool = True  # row 0 (the anchor's slot) drafts: B proposals per block
    markov_rank: int = 0  # 0: no Markov head
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False  # the confidence head also reads markov_w1[prev]

    def __post_init__(self) -> None:
        problems = [f"field {f.name!r} must be true or false; got {getattr(self, f.name)!r}" for f in fields(self)
                    if f.type == "bool" and not isinstance(getattr(self, f.name), bool)]
        if not is_int(self.markov_rank) or self.markov_rank < 0:
            problems.append(f"field 'markov_rank' must be an integer >= 0 (0: no Markov head); got {self.markov_rank!r}")
        elif self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            problems.append(f"field 'markov_head_type' is {self.markov_head_type!r}: this library scores the "
                            f"{' and '.join(map(repr, MARKOV_HEAD_TYPES))} Markov head; its numbers would be another "
                            "model's")
        elif self.confidence_head_with_markov is True and self.enable_confidence_head is True and not self.markov_rank:
            problems.append("field 'confidence_head_with_markov' is true but markov_rank is 0: the confidence head "
                            "reads the Markov embedding, which a drafter without a Markov head lacks")
        if problems:
            raise ValueError("; ".join(problems))


def read_config(raw: dict[str, Any]) -> tuple[dict[str, Any], Settings]:
    """The backbone in the published layout, and the DSpark fields (read from the top level or
    `dflash_config`, taken out of both)."""
    speculators = "speculators_model_type" in raw or "transformer_layer_config" in raw
    if speculators and raw.get("speculators_model_type") != "dspark":
        raise ValueError(f"field 'speculators_model_type' is {raw.get('speculators_model_type')!r}: a speculators "
                         "folder names its drafter family there ('dspark' for a DSpark drafter)")
    defaults = SPECULATORS_DEFAULTS if speculators else FLAT_DEFAULTS
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    values = {}
    for name, default in defaults.items():
        top, inner = raw.pop(name, None), dflash.pop(name, None)
        values[name] = default if inner is None and top is None else inner if inner is not None else top
    settings = Settings(**values)
    return (from_speculators(raw) if speculators else raw), settings


def write_config(settings: Settings, out: dict[str, Any]) -> None:
    """Every DSpark field at the top level (DeepSpec's placement; vLLM reads `sample_from_anchor` there)."""
    out.update({f.name: getattr(settings, f.name) for f in fields(settings)})


class MarkovHead(nn.Module):
    """markov_w1: embedding of the previous token (target ids) [V, r]; markov_w2: rank -> draft vocabulary."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)


class Drafter(DFlashDrafter):
    """A DSpark drafter: the backbone's tensors plus `markov_head.markov_w{1,2}.weight` and
    `confidence_head.proj.{weight,bias}` (speculators' and DeepSpec's names)."""

    family = "dspark"

    def __init__(self, config):
        super().__init__(config)
        settings: Settings = config.family_config
        self.settings = settings
        rank, H = settings.markov_rank, config.hidden_size
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size or config.vocab_size, rank) \
            if rank else None
        self.confidence_head = ConfidenceHead(H + (rank if settings.confidence_head_with_markov else 0)) \
            if settings.enable_confidence_head else None
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        """The backbone's initialisation, and the Markov embedding ~ N(0, initializer_range)."""
        super().reset_parameters(std)
        if getattr(self, "markov_head", None) is not None:
            std = self.config.extra.get("initializer_range", 0.02) if std is None else std
            nn.init.normal_(self.markov_head.markov_w1.weight, std=std)

    # ------------------------------------------------------------------ the family contract (scoring)
    def draft_rows(self, block_size: int) -> range:
        """sample_from_anchor: every row, row k drafting a + k + 1; else DFlash's rows 1 .. B-1."""
        return range(0 if self.settings.sample_from_anchor else 1, block_size)

    def slot_features(self, hidden: torch.Tensor, previous: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """[n, P, H + r]: each draft row's hidden state and markov_w1 of the token before its slot
        (`previous`, target ids; the anchor for the first slot); [n, P, H] without a Markov head."""
        rows = super().slot_features(hidden, previous, embed)
        if self.markov_head is None:
            return rows
        return torch.cat([rows, self.markov_head.markov_w1(previous).to(rows.dtype)], dim=-1)

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[V', H + r]: the LM head's (draft-vocabulary) rows beside markov_w2's."""
        weight = super().head_weight(lm_head_weight)
        if self.markov_head is None:
            return weight
        return torch.cat([weight, self.markov_head.markov_w2.weight.to(weight.dtype)], dim=1)

    @property
    def ddtree_refusal(self) -> str | None:
        if self.markov_head is None:
            return None  # the slots are independent given the context: DFlash's closed form is exact
        return ("DSpark's Markov head makes each slot's distribution depend on the token drafted before it, so every "
                "node of a DDTree tree would need its own full-vocabulary head pass")

    def ddtree_streaks(self, stats, valid: torch.Tensor, budgets: list[int]) -> dict[int, torch.Tensor]:
        if self.ddtree_refusal is not None:
            raise ValueError(self.ddtree_refusal)
        return super().ddtree_streaks(stats, valid, budgets)

    # ------------------------------------------------------------------ the confidence head
    @property
    def confidence_refusal(self) -> str | None:
        return None if self.confidence_head is not None else "it has no confidence head (enable_confidence_head is false)"

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[n, P] fp32: the confidence head's logit at each draft slot (pre-sigmoid), the token
        before each slot given by `previous` [n, P] (teacher-forced: the anchor then the true tokens;
        served: the anchor then the proposals). ValueError for a drafter without the head."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head is false)")
        rows = hidden[:, self.draft_rows(hidden.shape[1])]
        if self.settings.confidence_head_with_markov:
            rows = torch.cat([rows, self.markov_head.markov_w1(previous).to(rows.dtype)], dim=-1)
        return self.confidence_head.proj(rows).squeeze(-1).float()


def confidence_cut(confidence_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """int64 [n]: how many slots DeepSpec's evaluation proposes, per anchor, from the confidence
    logits [n, P]: the proposal is cut before the first slot whose sigmoid(logit) is below `threshold`
    (all P slots when none is, and for a threshold <= 0).

    Teacher-forced logits (`Drafter.confidence_logits` with the true tokens as predecessors) read
    what serving reads at every slot up to the first miss, so min(vanilla streak, cut) is exactly the
    number of proposals a served, confidence-cut block gets accepted; the cut itself past the first
    miss is the teacher-forced one (serving's predecessors there are the wrong proposals)."""
    if threshold <= 0:
        return torch.full(confidence_logits.shape[:1], confidence_logits.shape[1], dtype=torch.long,
                          device=confidence_logits.device)
    return (confidence_logits.sigmoid() >= threshold).long().cumprod(dim=1).sum(dim=1)


def cut_reach(cut: torch.Tensor, proposals: int) -> list[float]:
    """For depth d = 1 .. proposals: the share of anchors whose confidence cut (`confidence_cut`)
    proposes at least d slots."""
    depths = torch.arange(1, proposals + 1, device=cut.device)
    return (cut[None, :] >= depths[:, None]).double().mean(dim=1).tolist()
