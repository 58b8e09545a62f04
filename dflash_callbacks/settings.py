"""Settings: one frozen dataclass per concept, each field with its help, validated once.

- `scoring.config.ScoringConfig`: what a scoring run computes and how;
- `EvalSettings`: an evaluation of a training run (the cache, target and baseline, the cadence, the runner, ...);
- `StopSettings`: the stop's rule.

Every entry point takes the same names for the same settings (`settings_from`, with a field's aliases,
e.g. Lightning's `every_n_train_steps` for `every_n_steps`; a name that is none of them is refused
naming the closest). The YAML schemas and the CLI flags (`add_arguments`) are derived from the fields; the
adapters take a settings object (`settings=`) or its fields as keywords, typed for a type checker by
`EvalFields` / `LightningEvalFields` / `StopFields` (tests hold them to the fields: nothing is written twice
unchecked). A settings object crosses a process or
run.json as one dict (`to_dict`) and is rebuilt once on the far side (`from_dict`).

No torch here: a command's `--help` and its refusals answer before torch loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from typing_extensions import TypedDict, dataclass_transform

from .checks import check_bool, check_choice, check_int, check_number, problems_of
from .scoring.config import ScoringConfig
from .scoring.methods import Monitor

RUNNERS = ("thread", "process", "external")
BUSY_POLICIES = ("skip", "queue")
ON_ERROR = ("warn", "raise")
ACTIONS = ("stop", "warn")
CONFIDENCE = 0.95
"""The level of the intervals every report carries (`scoring.intervals`)."""
DEFAULT_MIN_RATIO = 0.9
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
LIGHTNING_NAMES = {"every_n_steps": "every_n_train_steps"}  # Lightning's spelling (ModelCheckpoint's); both taken


def setting(default: Any = MISSING, *, help: str, factory: Any = MISSING, aliases: tuple[str, ...] = (),
            flag: bool = True) -> Any:
    """A settings field: its default (or `factory`), its help (one sentence: the docs, the docstrings and
    the CLI show it), other names it is accepted under, and whether a CLI shows it as a flag."""
    return field(default=default, default_factory=factory, metadata={"help": help, "aliases": aliases, "flag": flag})


def fields_of(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def aliases(cls: type) -> dict[str, str]:
    """Every other name a field of `cls` is accepted under -> the field's name."""
    return {alias: f.name for f in fields_of(cls) for alias in f.metadata.get("aliases", ())}


def settings_from(cls: type, given: Mapping[str, Any], owner: str):
    """`cls(**given)`, a field given under one of its aliases taken as the field; a name that is not a
    field (nor an alias) is refused naming the closest, and a field given twice (under two names) too."""
    names, alias = [f.name for f in fields_of(cls)], aliases(cls)
    kwargs: dict[str, Any] = {}
    for key, value in given.items():
        name = alias.get(key, key)
        if name not in names:
            close = difflib.get_close_matches(key, names + list(alias), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; it takes {', '.join(names)}"
            raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}{hint}")
        if name in kwargs:
            raise TypeError(f"{owner}() got {name!r} twice ({', '.join(k for k in given if alias.get(k, k) == name)}): "
                            "they are one setting")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:  # named as the caller spelled it
        message = str(e)
        for key in given:
            if key in alias:
                message = re.sub(rf"\b{alias[key]}\b", key, message)
        raise ValueError(message) from None


def to_dict(settings) -> dict[str, Any]:
    """Plain JSON values (paths as strings, nested settings as dicts)."""
    def plain(value):
        if dataclasses.is_dataclass(value):
            return to_dict(value)
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, tuple):
            return list(value)
        return value
    return {f.name: plain(getattr(settings, f.name)) for f in fields_of(settings)}


# ------------------------------------------------------------------ the CLI from the fields
def add_arguments(parser, cls: type, *, exclude: Iterable[str] = (), prefix: str = "",
                  types: Mapping[str, Any] | None = None) -> None:
    """One `--flag` per field of `cls` (not in `exclude`, nor marked flag=False; its aliases are flags too), its
    help the field's with its default; a flag not given leaves the field out (`argparse.SUPPRESS`), so a config
    file or the default fills it. `types` converts a field's text (default: by the field's type: int, float,
    str, a path, a bool (--x when it is off by default, --no-x when on), a comma-separated list)."""
    hints = typing.get_type_hints(cls)
    for f in fields_of(cls):
        if f.name in exclude or not f.metadata.get("flag", True):
            continue
        kind = (types or {}).get(f.name) or _flag_type(hints[f.name])
        default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING
                                                              else None)
        shown = "" if default in (None, [], ()) else f" (default {_show(default)})"
        names = ["--" + (prefix + name).replace("_", "-") for name in (f.name, *f.metadata.get("aliases", ()))]
        options = dict(dest=prefix + f.name, default=argparse.SUPPRESS, help=f.metadata["help"] + shown)
        if kind is bool:  # a flag turns on what is off by default (--release-memory), or off what is on (--no-x)
            if default:
                names = ["--no-" + name[2:] for name in names]
            parser.add_argument(*names, action="store_false" if default else "store_true", **options)
        else:
            parser.add_argument(*names, type=kind, **options)


def given_arguments(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` whose flags were given (`add_arguments`)."""
    return {f.name: getattr(args, prefix + f.name) for f in fields_of(cls) if hasattr(args, prefix + f.name)}


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def name_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _flag_type(hint: Any):
    """How a flag's text becomes a field of type `hint` (an optional one: as its type)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is list:
        return int_list if typing.get_args(hint) == (int,) else name_list
    return hint if hint in (int, float, str, bool, Path) else str


# ------------------------------------------------------------------ path fields
if TYPE_CHECKING:
    class PathField:
        """A path setting as a type checker sees it: given as a str or an os.PathLike (`__set__`, what a
        dataclass's __init__ takes), read as a Path (`__get__`: `__post_init__` made it one). At run time it
        is `Path` itself (the CLI flags and the YAML schemas read the field's type)."""

        @overload
        def __get__(self, obj: None, owner: Any) -> PathField: ...
        @overload
        def __get__(self, obj: object, owner: Any) -> Path: ...
        def __get__(self, obj: object, owner: Any) -> Any: ...
        def __set__(self, obj: object, value: str | os.PathLike[str]) -> None: ...

    class OptionalPathField:
        """`PathField`, or None."""

        @overload
        def __get__(self, obj: None, owner: Any) -> OptionalPathField: ...
        @overload
        def __get__(self, obj: object, owner: Any) -> Path | None: ...
        def __get__(self, obj: object, owner: Any) -> Any: ...
        def __set__(self, obj: object, value: str | os.PathLike[str] | None) -> None: ...
else:
    PathField = Path
    OptionalPathField = Path | None


def path_field(*, default: Any = MISSING) -> Any:
    """A `frozen_settings` field of type PathField or OptionalPathField with a default: `field(default=...)`,
    typed Any so that a type checker takes e.g. `out: OptionalPathField = path_field(default=None)`."""
    return field(default=default)


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(field, path_field))
def frozen_settings(cls: type[_T]) -> type[_T]:
    """`@dataclass(frozen=True)`, which a type checker reads through PEP 681: there a required PathField (no
    default) is a descriptor too, given as a str, read as a Path (under a plain `@dataclass` mypy reads it
    as a plain attribute of type PathField)."""
    return dataclass(frozen=True)(cls)


def _path(name: str, value: Any, optional: bool = False) -> Path | None:
    if optional and value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike); got {type(value).__name__}")
    return Path(value)


def normalise_paths(settings: Any, required: Iterable[str], optional: Iterable[str]) -> None:
    """Make each named field of the frozen dataclass `settings` a Path (an optional one: or None); a value
    that is not a path raises TypeError naming the field."""
    for names, is_optional in ((required, False), (optional, True)):
        for name in names:
            object.__setattr__(settings, name, _path(name, getattr(settings, name), optional=is_optional))


# ------------------------------------------------------------------ the evaluation
def scoring_config(scoring: Any, device: str | None) -> ScoringConfig:
    """The caller's scoring config (a ScoringConfig, a mapping of its fields, an OmegaConf DictConfig, or
    None), copied, never changed, with `device` applied and `costs` made absolute (a watcher started in another
    folder reads the path run.json records)."""
    if type(scoring).__name__ == "DictConfig":
        from omegaconf import OmegaConf

        missing = sorted(OmegaConf.missing_keys(scoring))  # '???': named as unset, not checked as a value
        if missing:
            raise ValueError(f"scoring leaves required keys unset (???): {missing}")
        scoring = OmegaConf.to_container(scoring, resolve=True)
    if isinstance(scoring, ScoringConfig):
        config = scoring
    elif isinstance(scoring, Mapping) or scoring is None:
        config = ScoringConfig.from_dict(dict(scoring or {}))
    else:
        raise TypeError(f"scoring must be a ScoringConfig, a dict (or DictConfig) of its fields or None; "
                        f"got {type(scoring).__name__}")
    changes = {} if device is None else {"device": device}
    if config.costs is not None:
        changes["costs"] = os.path.abspath(config.costs)
    return dataclasses.replace(config, **changes)  # a copy, its lists too


@dataclass(frozen=True)
class EvalSettings:
    """How a training run is evaluated: every setting an adapter (Lightning, the plain loop, the
    transformers Trainer) or `watch --checkpoints` takes, besides where the drafter is."""

    POSITIONAL = 3  # cache, target and baseline may be given by position

    cache: PathField = setting(help="hidden-state cache folder (`dflash-callbacks extract`)")
    target: PathField = setting(help="the target's folder; only its embed_tokens and lm_head are read")
    baseline: OptionalPathField = setting(None, help="a published drafter folder (scored once, cached) or a saved report "
                                               "JSON; None: no baseline")
    every_n_steps: int = setting(500, help="snapshot cadence in optimizer steps (>= 1)",
                                 aliases=("every_n_train_steps",))
    scoring: ScoringConfig = setting(factory=ScoringConfig, flag=False,
                                     help="a ScoringConfig or a dict (or OmegaConf DictConfig) of its fields (copied, "
                                          "never changed)")
    runner: str = setting("thread", help=f"where scoring runs: {' | '.join(RUNNERS)}")
    device: str | None = setting(None, help="where scoring runs ('auto': cuda when available); overrides "
                                            "scoring.device")
    busy: str = setting("skip", help="'skip' (no new snapshot while one is pending) or 'queue' (up to max_pending)")
    max_pending: int = setting(1, help="snapshots pending at once with busy='queue' (>= 1)")
    keep_last: int = setting(2, help="snapshots kept on disk (0: none written; runner 'thread' only)")
    on_error: str = setting("warn", help="'warn' (training goes on) or 'raise'")
    wait_on_end: bool = setting(True, help="score and log the last step before training returns")
    dirpath: OptionalPathField = setting(None, help="the folder that holds this evaluation's runs, one subfolder per run "
                                              "(default: the loop's, e.g. <default_root_dir>/<name>)")
    baseline_cache_dir: OptionalPathField = setting(None, help="where baseline reports are cached across runs (default: "
                                                         "$XDG_CACHE_HOME/dflash_callbacks/baselines, ~/.cache/... "
                                                         "without it)")
    wait_timeout: float = setting(3600.0, help="seconds the end of training waits for pending reports (> 0); what "
                                               "is still pending then is recorded as an error")
    name: str = setting("dflash", help="the metric prefix and the default folder name (unique among a run's "
                                       "evaluations)")
    verbose: bool = setting(True, help="a one-line summary per report, and the last report's table at the end")
    sync_every_n_steps: int = setting(1, help="on several processes, every this many steps rank 0's news (the "
                                              "means, a stop) reach every rank (>= 1)")

    def __post_init__(self) -> None:
        """Every bad value at once, one line each (a path of the wrong type raises TypeError at once)."""
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen: normalised once, here)
        normalise_paths(self, ("cache", "target"), ("baseline", "dirpath", "baseline_cache_dir"))
        put("scoring", scoring_config(self.scoring, self.device))
        problems = problems_of(
            lambda: check_int("every_n_steps", self.every_n_steps, 1),
            lambda: check_choice("runner", self.runner, RUNNERS),
            lambda: self.device is None or isinstance(self.device, str) or _bad(f"device must be a string or None; "
                                                                              f"got {self.device!r}"),
            lambda: check_choice("busy", self.busy, BUSY_POLICIES),
            lambda: check_int("max_pending", self.max_pending, 1),
            lambda: check_int("keep_last", self.keep_last, 0),
            lambda: self.keep_last != 0 or self.runner == "thread" or _bad(
                f"runner={self.runner!r} reads snapshots from disk, so keep_last must be >= 1"),
            lambda: check_choice("on_error", self.on_error, ON_ERROR),
            lambda: check_bool("wait_on_end", self.wait_on_end),
            lambda: self.dirpath is None or not self.dirpath.exists() or self.dirpath.is_dir() or _bad(
                f"dirpath {self.dirpath} is a file: give the folder that holds this evaluator's runs (it is made if "
                "it does not exist)"),
            lambda: check_number("wait_timeout", self.wait_timeout, above=0),
            lambda: (isinstance(self.name, str) and NAME.match(self.name)) or _bad(
                f"name must be letters, digits, '_', '-' or '.', starting with a letter or digit; got {self.name!r}"),
            lambda: check_bool("verbose", self.verbose),
            lambda: check_int("sync_every_n_steps", self.sync_every_n_steps, 1),
        )
        if problems:
            raise ValueError("\n".join(problems))
        for name in ("every_n_steps", "max_pending", "keep_last", "sync_every_n_steps"):
            put(name, int(getattr(self, name)))
        put("wait_timeout", float(self.wait_timeout))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EvalSettings:
        return settings_from(cls, raw, cls.__name__)


def _bad(message: str):
    raise ValueError(message)


# ------------------------------------------------------------------ the stop
@dataclass(frozen=True)
class StopSettings:
    """When training stops: the drafter trails the baseline on `monitor` for `patience` reports in a row."""

    POSITIONAL = 1  # the monitor may be given by position

    monitor: str = setting("ddtree@8/live", help="METHOD/AGGREGATE: METHOD is vanilla, ddtree@N or top@K; AGGREGATE "
                                                 "is live or dense (its tau); speedup/METHOD/AGGREGATE: its predicted "
                                                 "speed-up (needs scoring.costs)")
    min_ratio: float | None = setting(None, help="ours / baseline must be >= min_ratio (> 0, e.g. 0.9); with neither "
                                                 f"min_ratio nor min_delta, {DEFAULT_MIN_RATIO}")
    min_delta: float | None = setting(None, help="ours - baseline must be >= min_delta (e.g. -0.5); give at most one "
                                                 "of min_ratio and min_delta")
    patience: int = setting(3, help="consecutive trailing reports (>= 1) before acting; a report at or above the "
                                    "threshold resets the count")
    grace_steps: int = setting(0, help="reports before this step are recorded (and feed the projection) but never "
                                       "decided on")
    projection: bool = setting(False, help="stop a trailing run only when a+b*log(step), fitted to the last reports, "
                                           "stays below the threshold at the last step")
    projection_window: int = setting(5, help="how many of the latest reports the projection fits (>= 3)")
    action: str = setting("stop", help="'stop' stops training; 'warn' only warns with the reason")
    verbose: bool = setting(True, help="a status line for every report that does not stop training")
    confidence: float | None = setting(CONFIDENCE, flag=False,
                                       help=f"{CONFIDENCE} (judge on the intervals the reports carry: a report trails "
                                            "only when the whole interval of the ratio (delta) is below the "
                                            "threshold) or None (the point values alone)")

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        problems = problems_of(
            lambda: _monitor(self.monitor),
            lambda: self.min_ratio is None or self.min_delta is None or _bad(
                f"give one of `min_ratio` or `min_delta`, not both (got {self.min_ratio} and {self.min_delta})"),
            lambda: self.min_delta is None or not str(self.monitor).startswith(SPEEDUP) or _bad(
                f"a speed-up monitor ({self.monitor}) is judged on its ratio to the baseline's speed-up: give "
                f"min_ratio, not min_delta (got {self.min_delta})"),
            lambda: check_number("`min_ratio`", self.min_ratio, above=0, optional=True),
            lambda: check_number("`min_delta`", self.min_delta, optional=True),
            lambda: check_int("`patience`", self.patience, 1),
            lambda: check_int("`grace_steps`", self.grace_steps, 0),
            lambda: check_bool("`projection`", self.projection),
            lambda: check_int("`projection_window`", self.projection_window, 3),
            lambda: check_choice("`action`", self.action, ACTIONS),
            lambda: check_bool("`verbose`", self.verbose),
            lambda: self.confidence is None or self.confidence == CONFIDENCE or _bad(
                f"`confidence` must be {CONFIDENCE} (the intervals the reports carry) or None (the point values "
                f"alone); got {self.confidence!r}"),
        )
        if problems:
            raise ValueError("\n".join(problems))
        speedup, monitor = split_monitor(self.monitor)
        put("monitor", (SPEEDUP if speedup else "") + str(monitor))
        if self.min_ratio is None and self.min_delta is None:
            put("min_ratio", DEFAULT_MIN_RATIO)
        for name in ("min_ratio", "min_delta"):
            if getattr(self, name) is not None:
                put(name, float(getattr(self, name)))
        for name in ("patience", "grace_steps", "projection_window"):
            put(name, int(getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


SPEEDUP = "speedup/"
"""A monitor's prefix that makes the stop judge the predicted speed-up (`scoring.costs`), not tau."""


def split_monitor(text: Any) -> tuple[bool, Monitor]:
    """(is it a speed-up monitor, its METHOD/AGGREGATE) of `METHOD/AGGREGATE` (tau) or
    `speedup/METHOD/AGGREGATE` (the predicted speed-up, with scoring.costs); ValueError naming both forms."""
    speedup = isinstance(text, str) and text.startswith(SPEEDUP)
    try:
        return speedup, Monitor.parse(text[len(SPEEDUP):] if speedup else text)
    except ValueError as e:
        raise ValueError(f"{e} (or speedup/METHOD/AGGREGATE, e.g. 'speedup/ddtree@8/live', for the predicted "
                         "speed-up with scoring.costs)") from None


def _monitor(text: Any) -> None:
    try:
        split_monitor(text)
    except ValueError as e:
        raise ValueError(f"`monitor`: {e}") from None


# ------------------------------------------------------------------ the adapters' keywords, as a type checker sees them
class EvalFields(TypedDict, total=False):
    """The fields of `EvalSettings` an adapter takes as keywords (cache, target and baseline come by
    position or name before them): a misspelled or mistyped one is a type checker's error."""

    every_n_steps: int
    scoring: ScoringConfig | Mapping[str, Any] | None
    runner: Literal["thread", "process", "external"]
    device: str | None
    busy: Literal["skip", "queue"]
    max_pending: int
    keep_last: int
    on_error: Literal["warn", "raise"]
    wait_on_end: bool
    dirpath: str | os.PathLike[str] | None
    baseline_cache_dir: str | os.PathLike[str] | None
    wait_timeout: float
    name: str
    verbose: bool
    sync_every_n_steps: int


class LightningEvalFields(EvalFields, total=False):
    """`EvalFields`, and every_n_steps under Lightning's own spelling (`ModelCheckpoint`'s) too."""

    every_n_train_steps: int


class StopFields(TypedDict, total=False):
    """The fields of `StopSettings` a stop takes as keywords."""

    monitor: str
    min_ratio: float | None
    min_delta: float | None
    patience: int
    grace_steps: int
    projection: bool
    projection_window: int
    action: Literal["stop", "warn"]
    verbose: bool
    confidence: float | None


def eval_settings(settings: EvalSettings | None, positional: Mapping[str, Any], fields: Mapping[str, Any],
                  owner: str) -> EvalSettings:
    """What an adapter was given: an `EvalSettings` (`settings=`), or its fields: cache, target and baseline
    (`positional`, None where not given) and the others as keywords."""
    given = {k: v for k, v in positional.items() if v is not None}
    if settings is not None:
        if not isinstance(settings, EvalSettings):
            raise TypeError(f"{owner}(settings=...) takes an EvalSettings; got {type(settings).__name__}")
        if given or fields:
            raise TypeError(f"{owner}() takes settings=EvalSettings(...) or its fields, not both")
        return settings
    return settings_from(EvalSettings, {**given, **fields}, owner)


def stop_settings(settings: StopSettings | str | None, fields: Mapping[str, Any], owner: str) -> StopSettings:
    """What a stop was given: a `StopSettings`, or its fields (the monitor also by position)."""
    if isinstance(settings, StopSettings):
        if fields:
            raise TypeError(f"{owner}() takes a StopSettings or its fields, not both")
        return settings
    if settings is not None and not isinstance(settings, str):
        raise TypeError(f"{owner}() takes a StopSettings, or the monitor by position; got {type(settings).__name__}")
    if settings is not None and "monitor" in fields:
        raise TypeError(f"{owner}() got monitor by position and by name")
    return settings_from(StopSettings, {**({"monitor": settings} if settings is not None else {}), **fields}, owner)
