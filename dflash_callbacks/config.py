"""Structured configs (dataclasses) for OmegaConf: the two callbacks and the scorer.

    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", ["eval.cache=...", "stop.patience=5"])
    trainer = L.Trainer(callbacks=build_callbacks(cfg), ...)

`EvalConfig` and `StopConfig` are derived from the callbacks' signatures: one field per
constructor argument, with the signature's default, so a default is written once. The
YAML in conf/ and the README's tables are held to them by tests. Unknown keys, wrong
types and overrides that are not `key=value` are refused naming the key and the file, or
the override it came from (a list given a scalar says how to write the list); impossible
values by the callbacks' own validation, when the config is built, before any training
starts. A user's config object is copied, never changed.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .callbacks import DrafterEvalCallback, TrailingBaselineStop
from .paths import CONF_DIR  # noqa: F401  (re-exported: the shipped YAML)
from .scoring.config import ScoringConfig


def signature_schema(cls: type, name: str, yaml_types: dict[str, Any], first: tuple = ()) -> type:
    """A dataclass with one field per argument of `cls.__init__`: the signature's default
    (MISSING where there is none), and its type, or `yaml_types[arg]` where OmegaConf can
    not hold the signature's type (paths, callables, config objects)."""
    hints = typing.get_type_hints(cls.__init__)
    fields = list(first)
    for arg in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        kind = yaml_types.get(arg.name, hints[arg.name])
        if arg.default is inspect.Parameter.empty:
            fields.append((arg.name, kind, field(default=MISSING)))
        elif arg.default is None and dataclasses.is_dataclass(kind):
            fields.append((arg.name, kind, field(default_factory=kind)))
        else:
            fields.append((arg.name, kind, field(default=arg.default)))
    return dataclasses.make_dataclass(name, fields)


EvalConfig = signature_schema(DrafterEvalCallback, "EvalConfig", {
    "cache": str, "target": str, "baseline": str | None, "drafter": str, "drafter_config": str | None,
    "scoring": ScoringConfig, "dirpath": str | None, "baseline_cache_dir": str | None,
})
EvalConfig.__doc__ = "Arguments of DrafterEvalCallback (its signature's defaults)."
StopConfig = signature_schema(TrailingBaselineStop, "StopConfig", {}, first=(("enabled", bool, field(default=True)),))
StopConfig.__doc__ = "Arguments of TrailingBaselineStop (its signature's defaults); `enabled: false` leaves it out."


@dataclass
class CallbacksConfig:
    eval: EvalConfig = field(default_factory=EvalConfig)
    stop: StopConfig = field(default_factory=StopConfig)


def parse_overrides(overrides: list[str] | tuple) -> DictConfig:
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r} is not key=value (e.g. train.max_steps=300)")
    return OmegaConf.from_dotlist(list(overrides))


def is_list_key(schema: type, key: str) -> bool:
    """Whether the dotted `key` of the dataclass `schema` holds a list (or None or a list)."""
    kind: Any = schema
    for part in key.split("."):
        kind = typing.get_type_hints(kind).get(part) if dataclasses.is_dataclass(kind) else None
    return list in (typing.get_origin(kind), *map(typing.get_origin, typing.get_args(kind)))


@contextmanager
def naming(schema: type, where: str, item: str | None = None):
    """OmegaConf's errors as one ValueError naming the key and where it came from: the file
    (`where`), or the command-line override `item`."""
    try:
        yield
    except OmegaConfBaseException as e:
        key, message = getattr(e, "full_key", None), str(e).splitlines()[0]
        if item is not None:
            key, _, value = item.partition("=")
            if is_list_key(schema, key) and not value.lstrip().startswith("["):
                message = f"{key.split('.')[-1]} is a list: write {key}=[{value}]"
            raise ValueError(f"override {item!r}: {message}") from None
        raise ValueError(f"config key {key!r}{where}: {message}" if key else f"invalid config{where}: {message}") from None


def load_config(schema: type, path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> Any:
    """`schema` defaults, then the YAML file, then `key=value` overrides; returns the
    instantiated dataclass. Errors name the offending key and the file, or the override."""
    where = f" in {path}" if path is not None else ""
    with naming(schema, where):
        cfg = OmegaConf.structured(schema)
        if path is not None:
            loaded = OmegaConf.load(path)
            if not isinstance(loaded, DictConfig):
                raise ValueError(f"config file {path} must hold a mapping of keys to values, not a list")
            cfg = OmegaConf.merge(cfg, loaded)
    parse_overrides(overrides)
    for item in overrides:  # one at a time, so that an error names its override
        with naming(schema, where, item):
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
    with naming(schema, where):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ValueError(f"config{where} leaves required keys unset: {missing} (set them with key=value)")
        return OmegaConf.to_object(cfg)


def build_eval_callback(cfg: EvalConfig) -> DrafterEvalCallback:
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(EvalConfig)}
    return DrafterEvalCallback(**kwargs)


def build_stop_callback(cfg: StopConfig) -> TrailingBaselineStop | None:
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(StopConfig) if f.name != "enabled"}
    return TrailingBaselineStop(**kwargs) if cfg.enabled else None


def build_callbacks(cfg: CallbacksConfig) -> list:
    stop = build_stop_callback(cfg.stop)
    return [build_eval_callback(cfg.eval)] + ([stop] if stop is not None else [])
