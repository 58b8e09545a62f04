"""The YAML a user reads, copies and edits (`conf/`), and its loader. No framework here: the
Lightning adapter's schema (`callbacks.schema`), the demo's and the CLI's use it.

    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", ["eval.cache=...", "stop.patience=5"])

Where the shipped YAML lives: the top-level `conf/` of a source checkout (an editable install reads it
in place), or `dflash_callbacks/conf/` inside an installed wheel (the build maps the same folder there;
see pyproject.toml). One copy either way.

A schema is a dataclass; `schema_of` makes one from a settings class (`settings.py`), so a field and its
default are written once. Unknown keys, wrong types and overrides that are not `key=value` are refused
naming the key and the file, or the override it came from (a list given a scalar says how to write the
list), all at once, one line each, with the values the settings themselves refuse. A user's config object
is copied, never changed.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"
TASKS_DIR = CONF_DIR / "tasks"


def schema_of(settings: type, name: str, *, rename: dict[str, str] | None = None, first: tuple = (),
              last: tuple = ()) -> type:
    """A YAML schema (a dataclass OmegaConf holds) with one field per field of `settings` (named as `rename`
    says), its default (MISSING where there is none) and its type (a path is a string): `first`, the
    settings' fields, then `last` ((name, type, field) each)."""
    rename, fields = rename or {}, list(first)
    hints = typing.get_type_hints(settings)
    for f in dataclasses.fields(settings):
        kind = hints[f.name]
        if Path in typing.get_args(kind) or kind is Path:
            kind = str | None if type(None) in typing.get_args(kind) else str
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            default = field(default=MISSING)
        fields.append((rename.get(f.name, f.name), kind, default))
    schema = dataclasses.make_dataclass(name, fields + list(last))
    schema.__doc__ = f"The YAML of {settings.__name__} (its fields and defaults)."
    return schema


def field_type(schema: type, key: str) -> Any:
    """The type of the dotted `key` of the dataclass `schema` (None for a key it lacks)."""
    kind: Any = schema
    for part in key.split("."):
        kind = typing.get_type_hints(kind).get(part) if dataclasses.is_dataclass(kind) else None
    return kind


def is_list_key(schema: type, key: str) -> bool:
    """Whether the dotted `key` of the dataclass `schema` holds a list (or None or a list)."""
    kind = field_type(schema, key)
    return list in (typing.get_origin(kind), *map(typing.get_origin, typing.get_args(kind)))


def settings(tree: dict, schema: type, prefix: str = ""):
    """(dotted key, value) of each setting of a YAML mapping: a mapping under a key that holds a
    config section is walked into; anything else is one setting."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dataclasses.is_dataclass(field_type(schema, dotted)):
            yield from settings(value, schema, f"{dotted}.")
        else:
            yield dotted, value


def nested(key: str, value: Any) -> dict:
    """{"a": {"b": value}} for the dotted key "a.b"."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(schema: type, path: str | os.PathLike | None = None, overrides: list[str] | tuple = (),
                values: dict | None = None) -> Any:
    """`schema` defaults, then the YAML file, then `key=value` overrides, then `values` (typed
    settings: a CLI's flags); returns the instantiated dataclass. Every problem is named at once,
    one line each, in one ValueError: a setting OmegaConf refuses names its key and the file, or
    its override; then each value the dataclasses' own checks refuse."""
    where = f" in {path}" if path is not None else ""
    cfg = OmegaConf.structured(schema)
    problems: list[str] = []
    refused: set[str] = set()  # keys whose setting was refused: not also named as unset

    def merge(key: str, setting: dict | DictConfig, source: str, as_list: str | None) -> None:
        """Merge one setting; a refused one is a problem naming `source` (`as_list`: how the
        setting is written as a list, for a list key given something else)."""
        nonlocal cfg
        try:
            cfg = OmegaConf.merge(cfg, setting)
        except (OmegaConfBaseException, TypeError) as e:
            message = str(e).splitlines()[0]
            if isinstance(e, TypeError):  # OmegaConf's "Cannot merge incompatible container types"
                message = f"{key} takes {'a list' if is_list_key(schema, key) else 'a value'}, not a mapping"
            elif as_list is not None and is_list_key(schema, key):
                message = f"{key.split('.')[-1]} is a list: write {as_list}"
            problems.append(f"{source}: {message}")
            refused.add(key)

    if path is not None:
        try:
            loaded = OmegaConf.load(path)
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(loaded, DictConfig):
            raise ValueError(f"config file {path} must hold a mapping of keys to values, not a list")
        for key, value in settings(OmegaConf.to_container(loaded, resolve=False), schema):
            merge(key, nested(key, value), f"config key {key!r}{where}",
                  None if isinstance(value, (list, dict)) else f"{key.split('.')[-1]}: [{value}]")
    for item in overrides:  # one at a time, so that a problem names its override
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            problems.append(f"override {item!r} is not key=value (e.g. train.max_steps=300)")
            continue
        key, _, value = item.partition("=")
        merge(key, OmegaConf.from_dotlist([item]), f"override {item!r}",
              None if value.lstrip().startswith("[") else f"{key}=[{value}]")
    for key, value in (values or {}).items():
        merge(key, nested(key, value), f"{key}={value!r}", None)
    try:
        unset = set(OmegaConf.missing_keys(cfg))
        if unset - refused:
            problems.append(f"config{where} leaves required keys unset: {sorted(unset - refused)} (set them with key=value)")
        if not unset:
            config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation of a key that does not exist
        key = getattr(e, "full_key", None)
        problems.append(f"config key {key!r}{where}: {str(e).splitlines()[0]}" if key
                        else f"invalid config{where}: {str(e).splitlines()[0]}")
    except ValueError as e:  # the dataclasses' own checks (ScoringConfig's: every bad value, one line each)
        problems += str(e).splitlines()
    if problems:
        raise ValueError("\n".join(problems))
    return config
