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
(the default): `is_causal` or `dflash_config.causal` when the config sets them (every layer);
else speculators' `sliding_window_non_causal` for sliding layers; else causal for sliding
layers and bidirectional for full layers; the window counted back from each query. It is
vLLM's rule for a config in the published layout; for a speculators folder vLLM differs
("vllm" below). The other rules (`ScoringConfig.attention`) score a drafter the way a given
stack runs it; three name a stack and read the config as it does:

- "vllm": as vLLM resolves the config (docs/numbers.md cites the code): a speculators DFlash
  (or DFlash 2) folder is mapped to `dflash_config.causal = not sliding_window_non_causal`
  (absent: true, so bidirectional), which overrides EVERY layer, full layers included;
  otherwise `is_causal` / `dflash_config.causal` override every layer, else sliding layers
  are causal and full ones bidirectional; the window counted back from each query. A layer that
  declares no window (a full layer) is built with `per_layer_sliding_window=None`, and vLLM's
  `Attention` then takes the engine's model-level window, `cache_config.sliding_window`: the
  target's window where every target layer slides (`vllm_model_window`; the toy target's 64), else
  none. `resolve_attention(..., target_window=)` gives it to those layers.
- "vllm-as-written": "vllm" without the engine's window: the config as written (vLLM on a target without
  a model-level window). Scored beside "vllm" where the target has one (`ScoringConfig.rules`), so a
  report says what the window costs.
- "sglang": as SGLang resolves it: an explicit `is_causal` for every layer (SGLang reads no
  `dflash_config.causal` and no `sliding_window_non_causal`), else sliding layers causal
  and full ones bidirectional; the window counted back from each query. SGLang builds a full
  layer with no window (`sliding_window_size=-1`), whatever the target's: the config as written.
- "trained": the pattern the checkpoint's trainer trained it under: the family's own where it
  names one (JetSpec: every layer causal in the block, `families.jetspec.trained_attention`); else a
  speculators folder under speculators' mask (the window anchored at the block's anchor; sliding layers causal
  unless `sliding_window_non_causal`; full layers bidirectional), any other under
  SpecForge's training mask (sliding layers causal with the window counted back from each
  query over the context only, the block whole; full layers bidirectional).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import families
from .config import DrafterConfig

RULES = {
    "auto": "as vLLM serves the drafter on a target without a model-level window (the config as written): the config's is_causal or dflash_config.causal; else speculators' "
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
    "vllm": "as vLLM resolves the config: a speculators folder's sliding_window_non_causal (absent: true) sets "
            "every layer, full layers included; else is_causal / dflash_config.causal every layer; else sliding "
            "layers causal, full layers bidirectional; the window counted back from each query, and a layer "
            "without a window of its own given the target's model-level window (vLLM's cache_config.sliding_window)",
    "vllm-as-written": "as vllm, but a layer without a window of its own keeps none: the config as written, which "
                       "vLLM serves where the target has no model-level window (scored beside vllm by default where "
                       "the target has one, ScoringConfig.score_as_written)",
    "sglang": "as SGLang resolves the config: is_causal every layer; else sliding layers causal, full layers "
              "bidirectional; the window counted back from each query",
    "trained": "as the checkpoint's trainer trained it: the family's own pattern where it names one (JetSpec: every "
               "layer causal in the block); else speculators' mask for a speculators folder (anchored-causal, "
               "or anchored-bidirectional with sliding_window_non_causal), else SpecForge's training mask (sliding "
               "layers causal, the window over the context only, the block whole)",
}
"""The attention rules a drafter can be scored under, with what each means."""


@dataclass(frozen=True)
class LayerAttention:
    """One layer's pattern inside the block. `window`: keys of a sliding layer beyond it are
    hidden (None: none hidden); `anchored`: the window counts back from the block's anchor,
    not from each query; `context_only`: a window counted from each query hides context keys
    only, never the block's own (SpecForge's training mask)."""

    causal: bool = False
    window: int | None = None
    anchored: bool = False
    context_only: bool = False

    def __str__(self) -> str:
        inside = "causal" if self.causal else "bidirectional"
        if self.window is None:
            return inside
        where = "anchor" if self.anchored else "query" + (", over the context only" if self.context_only else "")
        return f"{inside}, window {self.window} from the {where}"


def vllm_model_window(target_config: dict) -> int | None:
    """The window vLLM's engine gives every drafter layer that declares none (`cache_config.sliding_window`,
    docs/numbers.md cites the code), from the target's config.json (its `text_config` where it has one): the
    target's `sliding_window` when its `layer_types` are absent or all sliding, else None; None too for a
    window of 0 or null, and for a Qwen-style `use_sliding_window: false` (transformers then drops the window).
    Layer types a Qwen config leaves out are derived as transformers does (sliding from `max_window_layers`
    on). vLLM started with `--disable-sliding-window` applies none; this library does not see that flag."""
    text = target_config.get("text_config") if isinstance(target_config.get("text_config"), dict) else target_config
    window = text.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or text.get("use_sliding_window") is False:
        return None
    layer_types = text.get("layer_types")
    layers = text.get("num_hidden_layers")
    if layer_types is None and "use_sliding_window" in text and isinstance(layers, int):
        first = text.get("max_window_layers", 28)  # transformers' Qwen2/Qwen3 configs derive the layer types
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is not None and not all(kind == "sliding_attention" for kind in layer_types):
        return None
    return window


def resolve_attention(config: DrafterConfig, rule: str = "auto", target_window: int | None = None) -> list[LayerAttention]:
    """The pattern of every layer of a drafter of `config` under `rule` (one of RULES); under "vllm", a layer
    without a window of its own takes `target_window` (the engine's, `vllm_model_window`)."""
    if rule not in RULES:
        raise ValueError(f"attention rule {rule!r} is not one of {list(RULES)}")
    if rule == "trained":
        return _trained(config)
    if rule == "vllm-as-written":
        return resolve_attention(config, "vllm")
    override = {"vllm": vllm_causal(config), "sglang": config.is_causal, "auto": config.causal}.get(rule)
    out = []
    for kind in config.layer_types:
        sliding = kind == "sliding_attention"
        window = config.sliding_window if sliding and rule != "no-window" else None
        if window is None and rule == "vllm":
            window = target_window
        if override is not None:
            causal = override
        elif rule == "auto" and sliding and config.sliding_window_non_causal is not None:
            causal = not config.sliding_window_non_causal
        elif rule in ("auto", "vllm", "sglang"):
            causal = sliding
        else:
            causal = sliding and rule in ("causal", "anchored-causal")
        out.append(LayerAttention(causal, window, window is not None and rule.startswith("anchored")))
    return out


VLLM_SPECULATORS_FAMILIES = ("dflash", "dflash2")
"""The families whose speculators folders vLLM maps with `update_dflash` (the causal override); DSpark's
`update_dspark` sets no causal key (docs/numbers.md)."""


def vllm_causal(config: DrafterConfig) -> bool | None:
    """What vLLM sets every layer's causality to (None: per layer type): for a speculators DFlash folder
    `not sliding_window_non_causal`, absent counting as true; else `is_causal` / `dflash_config.causal`."""
    if config.speculators and config.family in VLLM_SPECULATORS_FAMILIES:
        return not (True if config.sliding_window_non_causal is None else config.sliding_window_non_causal)
    return config.causal


def _family_hook(config: DrafterConfig, name: str):
    """The family module's `name` (`model.families`: trained_attention, attention_note), None without one."""
    return getattr(families.family_named(config.family).load(), name, None)


def training_attention(config: DrafterConfig) -> list[LayerAttention] | None:
    """The pattern a drafter of `config` trains under in this library's objective: its family's own trained
    pattern where the family names one (JetSpec: block-causal), else None (the drafter's default, `auto`)."""
    own = _family_hook(config, "trained_attention")
    return None if own is None else own(config)


def attention_note(config: DrafterConfig, rules: list[str]) -> str | None:
    """The family's one line, before scoring, when the checkpoint will be served otherwise than its trainer
    meant (JetSpec's three spellings of causality), naming the rule that scores each; `rules` the rules the run
    scores. None when the family has nothing to say."""
    note = _family_hook(config, "attention_note")
    return None if note is None else note(config, rules)


def _trained(config: DrafterConfig) -> list[LayerAttention]:
    """The trainer's own pattern (module doc): the family's where it names one (`trained_attention`), else
    speculators' anchored mask for its folders, else SpecForge's."""
    own = training_attention(config)
    if own is not None:
        return own
    out = []
    for kind in config.layer_types:
        sliding = kind == "sliding_attention"
        window = config.sliding_window if sliding else None
        if config.speculators:
            causal = sliding and not config.sliding_window_non_causal
            out.append(LayerAttention(causal, window, anchored=window is not None))
        else:
            out.append(LayerAttention(sliding, window, context_only=window is not None))
    return out


def describe(attention: list[LayerAttention]) -> list[str]:
    """One line per layer, as a report records it."""
    return [str(layer) for layer in attention]
