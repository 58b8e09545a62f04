"""Structured configs (dataclasses) for OmegaConf: the two callbacks and the scorer.

    cfg = load_config(CallbacksConfig, "my.yaml", ["eval.every_n_train_steps=200", "stop.patience=5"])
    trainer = L.Trainer(callbacks=build_callbacks(cfg), ...)

Unknown keys and wrong types are refused by OmegaConf with the key's full name;
impossible values by the callbacks' own validation, when `load_config` instantiates
the dataclasses, before any training starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .paths import CONF_DIR  # noqa: F401  (re-exported)
from .scoring.config import ScoringConfig



@dataclass
class EvalConfig:
    """Arguments of DrafterEvalCallback."""

    cache: str = MISSING
    target: str = MISSING
    baseline: str | None = None
    every_n_train_steps: int = 500
    drafter: str = "drafter"
    drafter_config: str | None = None
    runner: str = "thread"
    device: str | None = None
    busy: str = "skip"
    max_pending: int = 1
    keep_last: int = 2
    on_error: str = "warn"
    wait_on_end: bool = True
    dirpath: str | None = None
    baseline_cache_dir: str | None = None
    wait_timeout: float = 3600.0
    verbose: bool = True
    scoring: ScoringConfig = field(default_factory=ScoringConfig)


@dataclass
class StopConfig:
    """Arguments of TrailingBaselineStop (`enabled: false` leaves it out)."""

    enabled: bool = True
    monitor: str = "ddtree@8/live"
    min_ratio: float | None = 0.9
    min_delta: float | None = None
    patience: int = 3
    grace_steps: int = 0
    projection: bool = False
    projection_window: int = 5
    action: str = "stop"
    sync_every_n_steps: int = 1
    verbose: bool = True


@dataclass
class CallbacksConfig:
    eval: EvalConfig = field(default_factory=EvalConfig)
    stop: StopConfig = field(default_factory=StopConfig)


def load_config(schema: type, path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> Any:
    """`schema` defaults, then the YAML file, then `key=value` overrides; returns the
    instantiated dataclass. Errors name the offending key and the file."""
    try:
        cfg = OmegaConf.structured(schema)
        if path is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ValueError(f"config {path or schema.__name__} leaves required keys unset: {missing}")
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        where = f" (from {path})" if path is not None else ""
        raise ValueError(f"invalid config{where}: {str(e).splitlines()[0]}") from None


def build_eval_callback(cfg: EvalConfig):
    from .callbacks import DrafterEvalCallback

    kwargs = {k: getattr(cfg, k) for k in EvalConfig.__dataclass_fields__}
    return DrafterEvalCallback(**kwargs)


def build_stop_callback(cfg: StopConfig):
    from .callbacks import TrailingBaselineStop

    kwargs = {k: getattr(cfg, k) for k in StopConfig.__dataclass_fields__ if k != "enabled"}
    return TrailingBaselineStop(**kwargs) if cfg.enabled else None


def build_callbacks(cfg: CallbacksConfig) -> list:
    stop = build_stop_callback(cfg.stop)
    return [build_eval_callback(cfg.eval)] + ([stop] if stop is not None else [])
