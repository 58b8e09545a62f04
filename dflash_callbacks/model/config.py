"""The drafter's configuration, parsed from the published `config.json` layout.

Published DFlash drafters are `model_type: qwen3` configs with a `dflash_config`
section. Fields have been seen in more than one place (`block_size` at the top level
or inside `dflash_config`, `rope_theta` or `rope_parameters`); `DrafterConfig.from_dict`
accepts every placement and `to_dict` writes the published one back. A speculators
config (`speculators_model_type: dflash`, the model nested in `transformer_layer_config`,
`aux_hidden_state_layer_ids` = target layer ids + 1) is mapped onto the same fields.

Every drafter family (`model.families`: DFlash, DFlash 2, DSpark, Domino) has this backbone; a
family's own fields (DFlash 2's convolution and selector, DSpark's Markov head, ...) are read by
its module into `DrafterConfig.family_config`, and written back by it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import is_int
from . import families

LAYER_TYPES = ("full_attention", "sliding_attention")
UNIMPLEMENTED = {  # field: (what it does in the code that reads it, the values that change nothing)
    "input_embedding_scale": ("scales the block's embeddings", (None, 1)),
    "output_multiplier": ("scales the draft logits", (None, 1)),
    "final_logit_softcapping": ("soft-caps the draft logits", (None, 0)),
    "logit_scale": ("scales the draft logits (vLLM)", (None, 1)),
    "shift_label": ("shifts each drafted position's label by one (SpecForge, speculators)", (None, False)),
    "sample_from_anchor": ("drafts a token from the anchor's own slot, B per block (speculators)", (None, False)),
    "is_neox_style": ("rotates interleaved RoPE pairs (vLLM, SGLang)", (None, True)),
    "rope_is_neox_style": ("rotates interleaved RoPE pairs (SGLang)", (None, True)),
    "attention_sink_bias": ("adds a per-head attention sink (vLLM)", (None, False)),
    "add_swa_attention_sink_bias": ("adds a per-head attention sink (vLLM)", (None, False)),
    "use_swa": ("makes every layer a sliding layer (vLLM)", (None, False)),
    "swa_window_size": ("sets the sliding window of the layers (vLLM)", (None,)),
    "use_aux_hidden_state": ("feeds the target's hidden states without the fc projection (vLLM)", (None, True)),
}
"""Settings that published DFlash code reads (from dflash_config or the top level) and no family's
module takes out of a config before the backbone is read (`model.families`): a config giving one
a value that changes the computation is refused, since its numbers would be another model's.
(SpecForge's `projector_type` names a family: `families.identify` reads it.)"""
SPECULATORS_FIELDS = ("block_size", "mask_token_id", "draft_vocab_size", "sliding_window_non_causal",
                      "target_hidden_size", *UNIMPLEMENTED)
"""Top-level fields of a speculators DFlash config that describe the drafter (the rest is
its proposal and verifier bookkeeping, or training-only settings)."""
SPECULATORS_MARK = "converted_from_speculators"
"""The key a config read from a speculators folder is written back with (true), so that its copies (snapshots)
are served as that folder is (`model.attention`'s "vllm" and "trained" rules)."""
QWEN3_MAX_WINDOW_LAYERS = 28
"""transformers' Qwen3Config default: without layer_types, layers from this index on slide."""


def is_neutral(value: Any, neutral: tuple) -> bool:
    """Whether `value` is one of `neutral` (null, or a value of the same kind: 1.0 is 1, true is not)."""
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool)
                                for n in neutral if n is not None)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids the published code derives when a config does not list them:
    evenly spread over target layers 1 .. num_target_layers - 3 (one layer: the middle)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    vocab_size: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    max_position_embeddings: int = 40960
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    num_target_layers: int | None = None
    causal: bool | None = None  # is_causal / dflash_config.causal: every layer causal in the block (None: unset)
    sliding_window_non_causal: bool | None = None  # speculators: sliding layers bidirectional in the block
    draft_vocab_size: int | None = None  # a pruned draft vocabulary (tensor d2t), below vocab_size; None: the whole
    family: str = "dflash"  # the drafter family (model.families): what reads the config, lays out and scores the block
    family_config: Any = None  # the family's own settings (its module's Settings, frozen), None for DFlash
    extra: dict[str, Any] = field(default_factory=dict)  # other keys of config.json, written back unchanged
    # how serving stacks read the config's attention (model.attention's "vllm", "sglang" and "trained" rules):
    speculators: bool = field(default=False, compare=False)  # read from a speculators folder
    is_causal: bool | None = field(default=None, compare=False)  # the top-level is_causal alone (SGLang reads it)

    def __post_init__(self) -> None:
        settings = getattr(families.family_named(self.family).load(), "Settings", None)
        if not (self.family_config is None if settings is None else isinstance(self.family_config, settings)):
            raise ValueError(f"a {self.family} drafter's family_config must be "
                             f"{'None' if settings is None else settings.__name__}; got {self.family_config!r}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"field {name!r} must be a positive integer; got {value!r}")
        if not is_int(self.mask_token_id):
            raise ValueError(f"field 'mask_token_id' must be an integer; got {self.mask_token_id!r}")
        if not isinstance(self.target_layer_ids, list) or not all(
            is_int(i) and i >= 0 for i in self.target_layer_ids
        ):
            raise ValueError(f"field 'target_layer_ids' must be a list of integers >= 0; got {self.target_layer_ids!r}")
        if self.sliding_window is not None and (not is_int(self.sliding_window) or self.sliding_window < 1):
            raise ValueError(f"field 'sliding_window' must be a positive integer or null; got {self.sliding_window!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"field 'rms_norm_eps' must be a number between 0 and 1; got {eps!r}")
        if not isinstance(self.attention_bias, bool):
            raise ValueError(f"field 'attention_bias' must be true or false; got {self.attention_bias!r}")
        if not isinstance(self.hidden_act, str):
            raise ValueError(f"field 'hidden_act' must be an activation name such as 'silu'; got {self.hidden_act!r}")
        for name in ("causal", "sliding_window_non_causal"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"field {name!r} must be true, false or null; got {getattr(self, name)!r}")
        if self.draft_vocab_size is not None and (
            not is_int(self.draft_vocab_size) or not 1 <= self.draft_vocab_size < self.vocab_size
        ):
            raise ValueError(f"field 'draft_vocab_size' must be an integer from 1 to vocab_size - 1 "
                             f"({self.vocab_size - 1}), or null for the whole vocabulary; got {self.draft_vocab_size!r}")
        if self.num_target_layers is not None and (not is_int(self.num_target_layers) or self.num_target_layers < 1):
            raise ValueError(f"field 'num_target_layers' must be a positive integer or null; got {self.num_target_layers!r}")
        theta = self.rope_parameters.get("rope_theta") if isinstance(self.rope_parameters, dict) else None
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ValueError(f"field 'rope_theta' (or rope_parameters.rope_theta) must be a positive number; got {theta!r}")
        if not isinstance(self.layer_types, list):
            raise ValueError(f"field 'layer_types' must be a list; got {self.layer_types!r}")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] is {kind!r}; expected one of {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} names a layer the target lacks: "
                             f"num_target_layers is {self.num_target_layers} (ids 0 to {self.num_target_layers - 1})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_target_features(self) -> int:
        """Width of the drafter's context input: one target hidden state per layer id."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DrafterConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"a drafter config is a JSON object; got {type(raw).__name__}")
        family = families.identify(raw)
        speculators = "speculators_model_type" in raw or "transformer_layer_config" in raw
        raw, family_config = family.load().read_config(copy.deepcopy(raw))  # the backbone, in the published layout
        d = copy.deepcopy(raw)
        dflash = d.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"field 'dflash_config' must be an object; got {dflash!r}")

        def take(name: str, default: Any = KeyError) -> Any:
            # dflash_config wins over the top level where both are present.
            if name in dflash:
                d.pop(name, None)
                return dflash.pop(name)
            if name in d:
                return d.pop(name)
            if default is KeyError:
                raise ValueError(f"no field {name!r} (looked at the top level and in dflash_config); is this a "
                                 "DFlash drafter config?")
            return default

        for name, (effect, neutral) in UNIMPLEMENTED.items():
            value = dflash.get(name, d.get(name))
            if not is_neutral(value, neutral):
                raise ValueError(f"field {name!r} is {value!r}: it {effect}, which this drafter does not implement "
                                 f"(it scores as if {name} were {neutral[-1]!r}); its numbers would be another model's")
        # vLLM reads is_causal first, then dflash_config.causal
        causal = {"is_causal": d.pop("is_causal", None), "dflash_config.causal": dflash.pop("causal", None)}
        for name, value in causal.items():
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"field {name!r} must be true, false or null; got {value!r}")
        is_causal = causal["is_causal"]
        causal = causal["dflash_config.causal"] if causal["is_causal"] is None else causal["is_causal"]
        non_causal = take("sliding_window_non_causal", None)
        draft_vocab = take("draft_vocab_size", None)
        target_hidden = take("target_hidden_size", None)
        num_layers = take("num_hidden_layers")
        num_target_layers = take("num_target_layers", None)
        layer_ids = take("target_layer_ids", None)
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError("drafter config has neither target_layer_ids nor num_target_layers")
            for name, value in (("num_target_layers", num_target_layers), ("num_hidden_layers", num_layers)):
                if not is_int(value) or value < 1:
                    raise ValueError(f"field {name!r} must be a positive integer; got {value!r}")
            layer_ids = build_target_layer_ids(num_target_layers, num_layers)
        mask_token_id = take("mask_token_id")
        block_size = take("block_size")

        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"field 'rope_parameters' must be an object; got {rope!r}")
        rope = dict(rope)
        if "rope_theta" in d:
            rope.setdefault("rope_theta", d.pop("rope_theta"))
        rope.setdefault("rope_theta", 1e6)
        rope.setdefault("rope_type", rope.pop("type", "default"))

        sliding_window = d.pop("sliding_window", None)
        layer_types = d.pop("layer_types", None)
        use_sliding_window = d.pop("use_sliding_window", None)
        if use_sliding_window is False:  # transformers' Qwen3Config then has no window on any layer
            if isinstance(layer_types, list) and "sliding_attention" in layer_types:
                raise ValueError("use_sliding_window is false but layer_types lists sliding_attention layers: "
                                 "set use_sliding_window true (sliding_window applies) or make them full_attention")
            sliding_window = None
        if not layer_types and use_sliding_window and sliding_window is not None and isinstance(num_layers, int):
            first = d.get("max_window_layers")  # derived as transformers' Qwen3Config does
            first = QWEN3_MAX_WINDOW_LAYERS if first is None else first
            if not is_int(first):
                raise ValueError(f"field 'max_window_layers' must be an integer; got {first!r}")
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]

        hidden = take("hidden_size")
        heads = take("num_attention_heads")
        if not is_int(heads) or heads < 1:
            raise ValueError(f"field 'num_attention_heads' must be a positive integer; got {heads!r}")
        if not isinstance(hidden, int):
            raise ValueError(f"field 'hidden_size' must be a positive integer; got {hidden!r}")
        if target_hidden not in (None, hidden):
            raise ValueError(f"field 'target_hidden_size' is {target_hidden!r}: a target {target_hidden} wide feeds the "
                             f"fc projection, which this drafter does not implement (its fc takes layers x hidden_size "
                             f"{hidden}); its numbers would be another model's")
        vocab = take("vocab_size")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=take("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=d.pop("num_key_value_heads", heads),
            head_dim=d.pop("head_dim", None) or hidden // heads,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(layer_ids) if isinstance(layer_ids, (list, tuple)) else layer_ids,
            vocab_size=vocab,
            rms_norm_eps=d.pop("rms_norm_eps", 1e-6),
            attention_bias=d.pop("attention_bias", False),
            hidden_act=d.pop("hidden_act", "silu"),
            layer_types=[] if layer_types is None else layer_types,
            sliding_window=sliding_window,
            max_position_embeddings=d.pop("max_position_embeddings", 40960),
            rope_parameters=rope,
            num_target_layers=num_target_layers,
            causal=causal,
            sliding_window_non_causal=non_causal,
            draft_vocab_size=None if draft_vocab == vocab else draft_vocab,
            family=family.name,
            family_config=family_config,
        )
        if dflash:
            d["dflash_config"] = dflash  # unknown dflash_config keys survive a round trip
        speculators = d.pop(SPECULATORS_MARK, False) is True or speculators
        cfg.extra, cfg.speculators, cfg.is_causal = d, speculators, is_causal
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "DrafterConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no drafter config at {path}: a drafter folder holds config.json and *.safetensors")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deeply for the parser
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        except ValueError as e:
            raise ValueError(f"drafter config {path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The published layout: model_type qwen3, block_size at the top level,
        mask_token_id and target_layer_ids inside dflash_config."""
        out = copy.deepcopy(self.extra)
        dflash = dict(out.pop("dflash_config", {}))
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        family = families.family_named(self.family)
        out.update(
            architectures=out.get("architectures", [family.architectures[0]]),
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            hidden_act=self.hidden_act,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            use_sliding_window="sliding_attention" in self.layer_types,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            dflash_config=dflash,
        )
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.speculators:  # served as the speculators folder it was read from (model.attention's "vllm")
            out[SPECULATORS_MARK] = True
        for name, value in (("is_causal", self.causal), ("sliding_window_non_causal", self.sliding_window_non_causal),
                            ("draft_vocab_size", self.draft_vocab_size)):
            if value is not None:
                out[name] = value
        family.load().write_config(self.family_config, out)
        return out


def from_speculators(raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators config of the DFlash backbone (`DFlashSpeculatorConfig`, and the families built on
    it, whose module takes its own fields out first) as the published layout:
    the model of `transformer_layer_config` at the top level, `aux_hidden_state_layer_ids`
    (indices into the target's hidden states, the embedding output being 0) less one as
    `target_layer_ids`, and the drafter's own fields beside them."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"field 'transformer_layer_config' must be an object (the drafter's Qwen3 config); got {layer!r}")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(is_int(i) and i >= 1 for i in aux):
        raise ValueError(f"field 'aux_hidden_state_layer_ids' must be a non-empty list of integers >= 1 (hidden-state "
                         f"indices; 0, the embedding output, is no target layer); got {aux!r}")
    flat = {k: v for k, v in layer.items() if k not in ("dflash_config", "block_size", "mask_token_id")}
    flat.update({k: raw[k] for k in ("architectures", *SPECULATORS_FIELDS) if k in raw})
    flat["dflash_config"] = {"target_layer_ids": [i - 1 for i in aux]}
    return flat
