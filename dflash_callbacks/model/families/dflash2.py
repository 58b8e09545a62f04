"""DFlash 2: DFlash with a local convolution around every sublayer and a candidate selector.

The backbone is DFlash's (`model.drafter`), each layer wrapped in two grouped dynamic depthwise
causal convolutions (`BlockConv`), one around the attention, one around the MLP:

    h = input_layernorm(x)
    x = x + conv_out(attention(conv_in(h)))        conv_in, conv_out: taps from h itself
    h = post_attention_layernorm(x)
    x = x + conv_out'(mlp(conv_in'(h)))

A convolution of K taps over channel groups of size g: row t of a block becomes
sum_{tap < K, tap <= t} y[t - tap] * (base[tap] + delta[t, tap, group]), where `base` [K, H] is
learned per channel and delta [K, H/g] is projected from the sublayer's normed input h at row t
(`kernel_projection`, one projection giving both sides' deltas). Taps never reach across the start
of a block: at serving, the query block (the bonus token, then the mask tokens); in training, each
block of `block_size` rows of the packed sequence. With base[0] = 1 and the rest 0 (the fresh
init) every convolution is the identity, and the drafter is DFlash.

The selector (`CandidateSelector`) re-ranks the top-K tokens of each slot's LM-head logits
(`selector_top_k`; values times `output_multiplier`, then soft-capped at `final_logit_softcapping`,
as vLLM does) by the token proposed before it:
score(c | prev) = unary[c] + <predecessor_codebook[prev] * W_h h, successor_codebook[c]>. Serving
walks the block greedily (slot 0's predecessor is the anchor, slot i's the token chosen at i - 1)
or samples softmax(score / T) over the K candidates (`dflash2_selector`).

Configs: z-lab's published layout (a Qwen3 config, `architectures: ["DFlash2DraftModel"]`, the
family's fields nested in `dflash_config`, what `write_config` writes), and speculators 0.9.0's flat
`speculators_model_type: dflash2` (no multiplier, softcap or embedding scale; sliding layers
bidirectional unless `sliding_window_non_causal` says otherwise). Tensors: the published names
(`layers.N.attention_conv.{base_kernel, kernel_projection.weight}`, `layers.N.mlp_conv.*`,
`candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...checks import check_int, check_number, problems_of
from ...kernels.candidate_ddtree import candidate_ddtree_streaks
from ..config import DrafterConfig, from_speculators
from ..drafter import DFlashDecoderLayer, DFlashDrafter
from .dflash2_selector import CandidateSelector, SelectorStats, selector_stats, serving_unary

SELECTOR_FIELDS = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")
"""The family's fields every config of it names."""
SERVING_FIELDS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
"""The family's fields a z-lab config may name (speculators 0.9.0 writes none of them)."""


@dataclass(frozen=True)
class Settings:
    """What a DFlash 2 drafter adds to the backbone's config."""

    conv_group_size: int  # channels sharing one dynamic kernel
    conv_kernel_size: int  # taps of each convolution
    selector_rank: int  # width of the selector's codebooks
    selector_top_k: int  # K: LM-head candidates the selector re-ranks
    output_multiplier: float = 1.0  # scales the K candidates' logits
    final_logit_softcapping: float | None = None  # tanh(v / cap) * cap on them; None: none
    input_embedding_scale: float | None = None  # scales the block's token embeddings; None: 1

    def __post_init__(self) -> None:
        problems = problems_of(
            *(lambda name=name: check_int(f"field {name!r}", getattr(self, name), 1) for name in SELECTOR_FIELDS),
            lambda: check_number("field 'output_multiplier'", self.output_multiplier, above=0),
            lambda: check_number("field 'final_logit_softcapping'", self.final_logit_softcapping, above=0,
                                 optional=True),
            lambda: check_number("field 'input_embedding_scale'", self.input_embedding_scale, optional=True),
        )
        if problems:
            raise ValueError("\n".join(problems))


def read_config(raw: dict[str, Any]) -> tuple[dict[str, Any], Settings]:
    """(the backbone in the published layout, the family's Settings) of a z-lab or a speculators config."""
    if "speculators_model_type" in raw or "transformer_layer_config" in raw:
        kind = raw.get("speculators_model_type")
        if kind != "dflash2":
            raise ValueError(f"field 'speculators_model_type' is {kind!r}: a speculators folder names its drafter "
                             "family there ('dflash2' for a DFlash 2 drafter)")
        own = {name: raw.pop(name) for name in (*SELECTOR_FIELDS, *SERVING_FIELDS) if name in raw}
        raw.setdefault("sliding_window_non_causal", True)  # speculators' default for this family
        return from_speculators(raw), _settings(own)
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    own = {}
    for name in (*SELECTOR_FIELDS, *SERVING_FIELDS):  # dflash_config wins over the top level, as for the backbone
        if name in nested:
            raw.pop(name, None)
            own[name] = nested.pop(name)
        elif name in raw:
            own[name] = raw.pop(name)
    return raw, _settings(own)


def _settings(own: dict[str, Any]) -> Settings:
    missing = [name for name in SELECTOR_FIELDS if name not in own]
    if missing:
        raise ValueError(f"no field {', '.join(map(repr, missing))} (looked at the top level and in dflash_config): "
                         f"a DFlash 2 config names its convolution and selector ({', '.join(SELECTOR_FIELDS)})")
    if own.get("output_multiplier") is None:
        own["output_multiplier"] = 1.0
    if own.get("final_logit_softcapping") == 0:  # vLLM: 0 or null, no softcap
        own["final_logit_softcapping"] = None
    return Settings(**own)


def write_config(settings: Settings, out: dict[str, Any]) -> None:
    """The family's fields into `out`'s dflash_config, as z-lab publishes them (with block_size)."""
    nested = out.setdefault("dflash_config", {})
    nested.update(block_size=out["block_size"], conv_group_size=settings.conv_group_size,
                  conv_kernel_size=settings.conv_kernel_size, selector_rank=settings.selector_rank,
                  selector_top_k=settings.selector_top_k, output_multiplier=settings.output_multiplier,
                  final_logit_softcapping=settings.final_logit_softcapping)
    if settings.input_embedding_scale is not None:
        nested["input_embedding_scale"] = settings.input_embedding_scale


def check_config(config: DrafterConfig) -> None:
    """What a DFlash 2 drafter of `config` needs of the backbone; every problem at once, one line each."""
    settings, problems = config.family_config, []
    if config.hidden_size % settings.conv_group_size:
        problems.append(f"field 'conv_group_size' ({settings.conv_group_size}) must divide hidden_size "
                        f"({config.hidden_size})")
    if settings.selector_top_k > config.vocab_size:
        problems.append(f"field 'selector_top_k' ({settings.selector_top_k}) exceeds vocab_size ({config.vocab_size})")
    if config.draft_vocab_size is not None:
        problems.append(f"field 'draft_vocab_size' is {config.draft_vocab_size}: a DFlash 2 drafter drafts over the "
                        f"whole vocabulary ({config.vocab_size}), its selector's codebooks are indexed by target ids")
    if problems:
        raise ValueError("\n".join(problems))


def block_conv(y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The convolution of the module doc: y [b, Q, H] (blocks of `block_size` consecutive rows),
    delta [b, Q, K, G] (per row, tap and channel group), base [K, H]. Returns [b, Q, H]."""
    b, q, hidden = y.shape
    taps, groups = delta.shape[-2:]
    shape = (b, q // block_size, block_size, groups, hidden // groups)
    rows = y.reshape(shape)
    delta = delta.reshape(*shape[:3], taps, groups, 1)
    base = base.to(y.dtype).view(taps, groups, hidden // groups)
    out = rows * (base[0] + delta[..., 0, :, :])
    for tap in range(1, min(taps, block_size)):  # a tap beyond the block's start reads zeros
        shifted = F.pad(rows[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        out = out + shifted * (base[tap] + delta[..., tap, :, :])
    return out.reshape(b, q, hidden)


class BlockConv(nn.Module):
    """One sublayer's pair of convolutions: `prepare` its normed input, `finish` its output."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.num_groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input side, output side]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def reset_parameters(self) -> None:
        """The identity on both sides (tap 0 = 1, no dynamic part)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolved input, the output side's delta) of the normed input h [b, Q, H]."""
        delta = self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.num_groups))
        return block_conv(h, delta[..., 0, :, :], self.base_kernel[0], block_size), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block_size: int) -> torch.Tensor:
        return block_conv(y, delta, self.base_kernel[1], block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        settings = config.family_config
        self.attention_conv = BlockConv(config.hidden_size, settings.conv_kernel_size, settings.conv_group_size)
        self.mlp_conv = BlockConv(config.hidden_size, settings.conv_kernel_size, settings.conv_group_size)

    def forward(self, x, context, rope_block, mask, block_size: int):
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), block_size)
        x = x + self.attention_conv.finish(self.self_attn(h, context, rope_block, mask), delta, block_size)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_size)
        return x + self.mlp_conv.finish(self.mlp(h), delta, block_size)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 drafter: DFlash's interface (`forward` takes `block_size`, the rows of each
    block of a packed sequence, default the config's), its layers convolved, and the selector."""

    family = "dflash2"
    decoder_layer = DFlash2DecoderLayer

    def __init__(self, config: DrafterConfig):
        if config.family == self.family:
            check_config(config)
        super().__init__(config)
        settings = config.family_config
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, settings.selector_rank)
        self.candidate_selector.reset_parameters(self._init_std())

    @property
    def settings(self) -> Settings:
        return self.config.family_config

    def _init_std(self, std: float | None = None) -> float:
        return self.config.extra.get("initializer_range", 0.02) if std is None else std

    def reset_parameters(self, std: float | None = None) -> None:
        """The backbone as DFlash's, every convolution the identity, the selector ~ N(0, std)."""
        super().reset_parameters(std)
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        if hasattr(self, "candidate_selector"):  # not yet built while DFlashDrafter.__init__ runs
            self.candidate_selector.reset_parameters(self._init_std(std))

    def _layers(self, x, per_layer_context, rope_block, masks: list, block_size: int) -> torch.Tensor:
        if x.shape[1] % block_size:
            raise ValueError(f"the drafter got {x.shape[1]} block rows, not whole blocks of block_size {block_size}: "
                             "pass the block size the rows were packed with (block_size=)")
        scale = self.settings.input_embedding_scale
        if scale is not None:
            x = x * scale
        for layer, context, mask in zip(self.layers, per_layer_context, masks, strict=True):
            x = layer(x, context, rope_block, mask, block_size)
        return self.norm(x)

    # ------------------------------------------------------------------ the family contract (scoring)
    def slot_stats(self, features: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, previous: torch.Tensor,
                   top_n: int, backend: str = "auto", chunk_size: int | None = None) -> SelectorStats:
        """The selector's distribution over each slot's K candidates given the true token before it
        (`dflash2_selector.selector_stats`): HeadStats' five fields, then the candidates and the
        edge log-probs DDTree reads. A label that is not a candidate has log-prob -inf."""
        return selector_stats(self.candidate_selector, self.settings, features, weight, labels, previous, top_n,
                              backend, chunk_size)

    def ddtree_streaks(self, stats: SelectorStats, valid: torch.Tensor, budgets: list[int]) -> dict[int, torch.Tensor]:
        """Exact DDTree over the candidate tree (`kernels.candidate_ddtree`): each node's children are
        its slot's K candidates, scored given the node's own token."""
        n, depth = valid.shape
        k = self.settings.selector_top_k
        return candidate_ddtree_streaks(stats.edge_logprobs.view(n, depth, k, k), stats.label_index.view(n, depth),
                                        valid, budgets)

    # ------------------------------------------------------------------ training
    def selector_loss(self, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, previous: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """The selector's teacher-forced cross-entropy over each slot's K candidates, where the label is
        one of them (the serving candidate set, nothing injected), weighted by `weights` [n, P] and
        averaged over their weight there (0 when no label is a candidate). hidden [n, P, H] and logits
        [n, P, V] (fp32) of the draft rows, labels and previous [n, P] the true token at and before
        each slot. Differentiable in the hidden states, the logits (the unary part) and the selector."""
        ids = logits.detach().topk(self.settings.selector_top_k, dim=-1).indices  # ties: torch's order
        unary = serving_unary(logits.gather(-1, ids), self.settings)
        scores = self.candidate_selector.scores(unary, hidden, ids, previous[..., None])[..., 0, :]  # [n, P, K]
        match = ids == labels[..., None]
        ce = F.cross_entropy(scores.flatten(0, 1), match.int().argmax(-1).flatten(), reduction="none")
        weights = weights * match.any(-1)
        return (ce.view_as(weights) * weights).sum() / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


Drafter = DFlash2Drafter  # the family's drafter (model.families)
