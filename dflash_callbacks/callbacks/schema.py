"""The Lightning adapter's YAML (`conf/callbacks.yaml`): structured configs for OmegaConf, made from the
settings' fields (`config_files.schema_of`), and the callbacks built from them (Lightning is imported
when one is built, not to read a file).

    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", ["eval.cache=...", "stop.patience=5"])
    trainer = L.Trainer(callbacks=build_callbacks(cfg), ...)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config_files import schema_of
from ..settings import LIGHTNING_NAMES, EvalSettings, StopSettings

EvalConfig = schema_of(EvalSettings, "EvalConfig", rename=LIGHTNING_NAMES, last=(
    ("drafter", str, field(default="drafter")), ("drafter_config", str | None, field(default=None))))
EvalConfig.__doc__ = "Arguments of DrafterEvalCallback (EvalSettings' fields, and where the drafter is)."
StopConfig = schema_of(StopSettings, "StopConfig", first=(("enabled", bool, field(default=True)),),
                       last=(("eval_callback", str | None, field(default=None)),))
StopConfig.__doc__ = "Arguments of TrailingBaselineStop (StopSettings' fields); `enabled: false` leaves it out."


@dataclass
class CallbacksConfig:
    eval: EvalConfig = field(default_factory=EvalConfig)
    stop: StopConfig = field(default_factory=StopConfig)


def build_eval_callback(cfg: EvalConfig):
    from .eval_callback import DrafterEvalCallback

    return DrafterEvalCallback(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(EvalConfig)})


def build_stop_callback(cfg: StopConfig):
    from .stopping import TrailingBaselineStop

    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(StopConfig) if f.name != "enabled"}
    return TrailingBaselineStop(**kwargs) if cfg.enabled else None


def build_callbacks(cfg: CallbacksConfig) -> list:
    stop = build_stop_callback(cfg.stop)
    return [build_eval_callback(cfg.eval)] + ([stop] if stop is not None else [])
