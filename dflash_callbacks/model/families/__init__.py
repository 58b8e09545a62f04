"""Drafter families: what a drafter checkpoint is. DFlash (v1), DFlash 2, DSpark, Domino, JetSpec, DFlare.

A family says three things, and every method of `scoring/` follows from them:
- which configs and checkpoint layouts it reads (`identify` picks the family of a config.json; the
  family's module reads its own fields, `read_config` / `write_config`);
- how its block is laid out: which rows of a decoded block draft, each predicting the token at
  anchor + 1 + i (`Drafter.draft_rows`);
- the drafter's distribution at each draft slot conditioned on the TRUE tokens before it
  (teacher-forced along the cached answer: `Drafter.slot_stats`). A streak continues only while
  every earlier proposal equalled the true token, so the proposal at slot j given the true token at
  j - 1 is exactly what serving proposes there. DFlash ignores the predecessor; DFlash 2's selector,
  DSpark's Markov head and Domino's GRU use it.

This module is the registry: static facts per family, and its implementing module, imported when a
config of that family is read. A config no family reads is refused in one line naming the field and
the families known.

A family's module holds `read_config`, `write_config`, `Settings` (None: no fields of its own) and
`Drafter`; and, where the family says more than the backbone does, `trained_attention(config)` (the
pattern its trainer trains every layer under: `model.attention`'s "trained") and `attention_note(config,
rules)` (one line a run is told before scoring when the checkpoint will be served otherwise than it was
trained). The generic code asks the family for these; a family without them is the backbone's.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # the name reports and errors use
    title: str  # how people write it
    architectures: tuple[str, ...]  # config.json `architectures` values of its published checkpoints
    speculators_type: str | None  # speculators' `speculators_model_type`
    projector_type: str | None  # SpecForge's `dflash_config.projector_type`
    module: str  # the module that implements it (read_config, write_config, Settings, Drafter)
    marks: tuple[tuple[str, Any], ...] = ()  # (config field, value) pairs that name it whatever the architecture

    def load(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.module}")

    def __str__(self) -> str:
        return self.name


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("dflash", "DFlash", ("DFlashDraftModel",), "dflash", "dflash", "dflash"),
    Family("dflash2", "DFlash 2", ("DFlash2DraftModel",), "dflash2", None, "dflash2"),
    Family("dspark", "DSpark", ("DSparkDraftModel", "Qwen3DSparkModel"), "dspark", None, "dspark"),
    Family("domino", "Domino", ("DominoDraftModel",), None, "domino", "domino"),
    Family("jetspec", "JetSpec", ("Qwen3DFlashDraftModel",), None, None, "jetspec",
           marks=(("dflash_config.causal_head", True),)),
    Family("dflare", "DFlare", ("QwenDFlareDraftModel",), None, None, "dflare"),
)}
"""Every family this library scores, by name."""


def known() -> str:
    """The families, as an error names them: "dflash (DFlash), dflash2 (DFlash 2), ..."."""
    return ", ".join(f"{f.name} ({f.title})" for f in FAMILIES.values())


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"no drafter family {name!r}; the families are {known()}")
    return FAMILIES[name]


def _implemented(family: Family) -> bool:
    return importlib.util.find_spec(f"{__name__}.{family.module}") is not None


def _field(raw: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of a raw config ("dflash_config.causal_head"), None where absent."""
    value: Any = raw
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def identify(raw: dict[str, Any]) -> Family:
    """The family of a raw config.json, from each field that names one: speculators'
    `speculators_model_type`, SpecForge's `projector_type` ('dflash' names none), a family's `marks`
    (JetSpec's reference: `dflash_config.causal_head: true`), `architectures` (none of them: DFlash, the
    published layout before families). ValueError in one line naming the field, when it names no
    family or another than a field before it, and the families known."""
    named: list[tuple[str, Any, Family]] = []
    kind = raw.get("speculators_model_type")
    if kind is not None:
        by_type = {f.speculators_type: f for f in FAMILIES.values() if f.speculators_type}
        if kind not in by_type:
            raise ValueError(f"field 'speculators_model_type' is {kind!r}: not a drafter family this library scores; "
                             f"it scores {', '.join(sorted(by_type))} ({known()})")
        named.append(("speculators_model_type", kind, by_type[kind]))
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    projector = dflash.get("projector_type", raw.get("projector_type"))
    if projector not in (None, "dflash"):
        by_projector = {f.projector_type: f for f in FAMILIES.values() if f.projector_type}
        if projector not in by_projector:
            raise ValueError(f"field 'projector_type' is {projector!r}: no drafter family this library scores has "
                             f"that head; the projector types it reads are {sorted(by_projector)} ({known()})")
        named.append(("projector_type", projector, by_projector[projector]))
    for family in FAMILIES.values():
        named += [(path, value, family) for path, value in family.marks
                  if _field(raw, path) == value and isinstance(_field(raw, path), type(value))]
    architectures = raw.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ValueError(f"field 'architectures' must be a list of names; got {architectures!r}")
        found = [f for f in FAMILIES.values() if set(f.architectures) & set(architectures)]
        if not found:
            names = sorted(a for f in FAMILIES.values() for a in f.architectures)
            raise ValueError(f"field 'architectures' is {architectures}: not a drafter family this library scores; "
                             f"the architectures it reads are {names} ({known()})")
        if not named or found[0] is not FAMILIES["dflash"]:  # DFlashDraftModel: the name other heads kept too
            named.append(("architectures", architectures, found[0]))
    if not named:
        return FAMILIES["dflash"]
    field, value, family = named[0]
    for other, other_value, other_family in named[1:]:
        if other_family is not family:
            raise ValueError(f"field {other!r} is {other_value!r}, a {other_family.title} drafter, but field {field!r} "
                             f"is {value!r}, a {family.title} one: the config contradicts itself")
    return _check(family, field, value)


def _check(family: Family, field: str, value: Any) -> Family:
    if not _implemented(family):
        raise ValueError(f"field {field!r} is {value!r}: a {family.title} drafter, which this version of the library "
                         "does not score yet")
    return family
