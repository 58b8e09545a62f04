"""The demo's settings (`conf/demo.yaml` over the callbacks' defaults, any key overridden as
`key=value`) and their checks: every problem at once, one line each, before anything is built,
imported (no torch, no Lightning) or written (`check_demo`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..callbacks.schema import EvalConfig, StopConfig
from ..checks import check_choice, check_int, check_number, problems_of
from ..config_files import CONF_DIR, load_config
from ..scoring.methods import unscored_monitor
from ..settings import EvalSettings, StopSettings, settings_from, split_monitor

DEMO_YAML = CONF_DIR / "demo.yaml"
WANDB_MODES = ("offline", "online", "disabled")
TRAINING_PROMPT_LEN = 64  # tokens of each chat request in the toy drafter's training data (demos.toy.world)


@dataclass
class TrainConfig:
    """A drafter training recipe on the toy world (the demo's: deliberately weak)."""

    max_steps: int = 600
    lr: float = 3e-4
    layers: int = 1
    block_size: int = 8
    blocks_per_sequence: int = 16
    batch_size: int = 4
    sequences: int = 256  # training sequences (target continuations of stdlib snippets)
    seq_len: int = 160
    seed: int = 0


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    wandb: str = "offline"  # offline | online | disabled
    wandb_project: str = "dflash-callbacks-demo"
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    stop: StopConfig = field(default_factory=StopConfig)


def demo_config(overrides: list[str] | tuple = ()) -> DemoConfig:
    """conf/demo.yaml over the defaults, then `key=value` overrides."""
    return load_config(DemoConfig, DEMO_YAML, overrides)


def config_keys(config: object = None, prefix: str = "") -> list[tuple[str, object]]:
    """Every key of a (nested) config dataclass with its value, for `demo --help`."""
    config = DemoConfig() if config is None else config
    keys = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append((f"{prefix}{f.name}", value))
    return keys


def check_demo(cfg: DemoConfig) -> None:
    """Every problem of the demo's settings at once, one line each, before anything is built or
    written: the recipe, the W&B mode, the callbacks' arguments (their constructors' checks), the
    monitor against the methods scored, and the folders given in place of `toy`."""
    train = cfg.train
    problems = problems_of(
        lambda: check_choice("wandb", cfg.wandb, WANDB_MODES),
        lambda: check_int("train.max_steps", train.max_steps, 1),
        lambda: check_number("train.lr", train.lr, above=0),
        lambda: check_int("train.layers", train.layers, 1),
        lambda: check_int("train.block_size", train.block_size, 2),
        lambda: check_int("train.blocks_per_sequence", train.blocks_per_sequence, 1),
        lambda: check_int("train.batch_size", train.batch_size, 1),
        lambda: check_int("train.sequences", train.sequences, 1),
        lambda: check_int("train.seq_len", train.seq_len, TRAINING_PROMPT_LEN + 1),
        lambda: check_int("train.seed", train.seed, 0),
    )
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        problems.append(f"out {cfg.out} is a file: give the folder the demo writes into")
    for key in ("cache", "target", "baseline"):
        value = getattr(cfg.eval, key)
        if value not in (None, "toy") and not Path(value).exists():
            problems.append(f"eval.{key} {value} does not exist: give a folder, or toy for the toy world's")
    if cfg.eval.runner == "external":
        problems.append("eval.runner='external' scores nothing without a `dflash-callbacks watch`, and the demo starts "
                        "none: use thread or process")
    evaluation = stop = None
    try:  # the callbacks' own checks, without building them (no Lightning, no torch yet)
        evaluation = settings_from(EvalSettings, {k: v for k, v in dataclasses.asdict(cfg.eval).items()
                                                  if k not in ("drafter", "drafter_config")}, "eval")
    except (ValueError, TypeError) as e:
        problems += [f"eval: {line}" for line in str(e).splitlines()]
    try:
        stop = StopSettings(**{k: v for k, v in dataclasses.asdict(cfg.stop).items() if k not in ("enabled", "eval_callback")})
    except (ValueError, TypeError) as e:
        problems += [f"stop: {line}" for line in str(e).splitlines()]
    if evaluation is not None and stop is not None and cfg.stop.enabled:
        speedup, monitor = split_monitor(stop.monitor)  # METHOD/AGGREGATE or speedup/METHOD/AGGREGATE
        line = unscored_monitor(monitor, evaluation.scoring.methods, "stop.monitor", "eval.scoring")
        problems += [line] if line else []
        if speedup and not evaluation.scoring.costs:
            problems.append(f"stop.monitor={stop.monitor!r} is a predicted speed-up, but eval.scoring has no costs to "
                            "predict it from: set eval.scoring.costs (`dflash-callbacks profile --out PATH`), or "
                            f"monitor tau: {str(monitor)!r}")
    if problems:
        raise ValueError("\n".join(problems))
