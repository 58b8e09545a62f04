"""`WatchSettings`: everything a `CheckpointWatcher` is given, one frozen object; `watch --checkpoints`
fills it from its flags (`cli.watch.checkpoint_settings`, every problem at once, before torch loads), and
a program may build one itself. No torch here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..scoring.config import ScoringConfig
from ..settings import OptionalPathField, PathField, StopSettings, frozen_settings, normalise_paths, path_field

DEFAULTS: dict[str, Any] = {  # the settings only `watch --checkpoints` takes, and their defaults
    "out": None, "state_key": None, "state_file": "training_state.pt", "drafter_config": None, "step_pattern": None,
    "settle_seconds": 30.0, "wandb_project": None, "wandb_name": None, "wandb_group": None, "max_steps": None,
    "tensorboard": None, "mlflow_uri": None, "mlflow_experiment": None, "mlflow_run_id": None,
}


@frozen_settings
class WatchSettings:
    """The checkpoints to watch (`checkpoints`, a trainer's folder), what to score them with, where the
    reports go (`out`: default CHECKPOINTS/dflash-eval), how to read and poll, and the stop (`stop`: with
    a baseline) and W&B run of the reports."""

    checkpoints: PathField
    cache: PathField
    target: PathField
    scoring: ScoringConfig
    baseline: OptionalPathField = path_field(default=None)
    baseline_cache_dir: OptionalPathField = path_field(default=None)
    out: OptionalPathField = path_field(default=None)
    poll_seconds: float = 5.0
    idle_exit: float | None = None
    once: bool = False
    settle_seconds: float = DEFAULTS["settle_seconds"]
    step_pattern: re.Pattern | None = None  # its first group (or match) is the step; None: the name's last integer
    state_key: str | None = None  # torch checkpoint files, the drafter's state dict under this key; None: HF folders
    state_file: str = DEFAULTS["state_file"]
    drafter_config: OptionalPathField = path_field(default=None)  # with state_key: the drafter's config.json
    # (what `config` was read from)
    config: Any = None  # the DrafterConfig of `drafter_config`
    max_steps: int | None = None
    stop: StopSettings | None = None
    wandb_project: str | None = None
    wandb_name: str | None = None
    wandb_group: str | None = None
    tensorboard: OptionalPathField = path_field(default=None)  # a TensorBoard folder the reports go to as well
    mlflow_uri: str | None = None  # an MLflow tracking URI, with mlflow_experiment (a run made there) or mlflow_run_id
    mlflow_experiment: str | None = None
    mlflow_run_id: str | None = None

    def __post_init__(self) -> None:
        """Every path given as a str or an os.PathLike is a Path from here on."""
        normalise_paths(self, ("checkpoints", "cache", "target"),
                        ("baseline", "baseline_cache_dir", "out", "drafter_config", "tensorboard"))

    def trackers(self) -> list:
        """The TensorBoard and MLflow trackers these settings ask for (`engine/trackers/flags.py`)."""
        from ..engine.trackers.flags import watcher_trackers

        return watcher_trackers(None if self.tensorboard is None else str(self.tensorboard), self.mlflow_uri,
                                self.mlflow_experiment, self.mlflow_run_id, run_name=self.out_folder.name)

    @property
    def out_folder(self) -> Path:
        return self.out if self.out is not None else self.checkpoints / "dflash-eval"
