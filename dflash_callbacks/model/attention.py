"""What each drafter layer attends to inside a block: the attention pattern.

A block at anchor a (queries at positions a .. a+B-1) always sees the context [0, a) and
itself; codebases differ on two things, per layer:

- inside the block: bidirectional (every query sees all B block keys) or causal (query
  a+j sees block keys a .. a+j);
- a sliding layer's window of w keys: counted back from each query (keys at positions
  <= q - w hidden: vLLM, SGLang, SpecForge's training mask), or anchored at the block's
  anchor (context keys before a - w hidden, block keys all kept: speculators' training
  mask), or not applied (z-lab's HF code and SpecForge's `spec_generate`, whose sdpa and
  eager functions ignore the window).

`resolve_attention(config, rule)` gives one `LayerAttention` per layer. The rule "auto"
chooses as vLLM serves a drafter: `is_causal` or `dflash_config.causal` when the config
sets them (every layer); else speculators' `sliding_window_non_causal` for sliding layers;
else causal for sliding layers and bidirectional for full layers; the window counted back
from each query. The other rules (`ScoringConfig.attention`) score a drafter the way a
given stack runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DrafterConfig

RULES = {
    "auto": "as vLLM serves the drafter: the config's is_causal or dflash_config.causal; else speculators' "
            "sliding_window_non_causal for sliding layers; else sliding layers causal, full layers bidirectional; "
            "the window counted back from each query",
    "causal": "sliding layers causal, full layers bidirectional; the window counted back from each query "
              "(SGLang; SpecForge's training mask)",
    "bidirectional": "every layer bidirectional; the window counted back from each query "
                     "(this library before scorer version 3)",
    "anchored-causal": "sliding layers causal, the window anchored at the block's anchor; full layers "
                       "bidirectional (speculators' training mask)",
    "anchored-bidirectional": "every layer bidirectional, the window anchored at the block's anchor "
                              "(speculators' training mask with sliding_window_non_causal)",
    "no-window": "every layer bidirectional, the sliding window not applied (z-lab's HF code and SpecForge's "
                 "spec_generate under sdpa or eager)",
}
"""The attention rules a drafter can be scored under, with what each means."""


@dataclass(frozen=True)
class LayerAttention:
    """One layer's pattern inside the block. `window`: keys of a sliding layer beyond it are
    hidden (None: none hidden); `anchored`: the window counts back from the block's anchor,
    not from each query."""

    causal: bool = False
    window: int | None = None
    anchored: bool = False

    def __str__(self) -> str:
        inside = "causal" if self.causal else "bidirectional"
        if self.window is None:
            return inside
        return f"{inside}, window {self.window} from the " + ("anchor" if self.anchored else "query")


def resolve_attention(config: DrafterConfig, rule: str = "auto") -> list[LayerAttention]:
    """The pattern of every layer of a drafter of `config` under `rule` (one of RULES)."""
    if rule not in RULES:
        raise ValueError(f"attention rule {rule!r} is not one of {list(RULES)}")
    out = []
    for kind in config.layer_types:
        sliding = kind == "sliding_attention"
        window = config.sliding_window if sliding and rule != "no-window" else None
        if rule == "auto":
            if config.causal is not None:
                causal = config.causal
            elif sliding and config.sliding_window_non_causal is not None:
                causal = not config.sliding_window_non_causal
            else:
                causal = sliding
        else:
            causal = sliding and rule in ("causal", "anchored-causal")
        out.append(LayerAttention(causal, window, window is not None and rule.startswith("anchored")))
    return out


def describe(attention: list[LayerAttention]) -> list[str]:
    """One line per layer, as a report records it."""
    return [str(layer) for layer in attention]
