"""The training loop as the engine sees it: `Host`, and the small parts hosts are made of.

Each adapter gives the engine a Host (Lightning's Trainer, the plain loop, the transformers
Trainer, the checkpoint watcher): its ranks and their one collective, where run folders go,
where metrics and W&B rows go, the loop's last step and whether it is ending, and how it says
things. The defaults are one process with no logger, no known last step, and messages through
`logging` / `warnings`. torch.distributed's ranks (`TorchDistributed`) are composed by the hosts that
need them, and so are the destinations in `trackers/` (`log=` functions, the active W&B run).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

Logger = tuple[str, Callable[[dict, int], object]]
"""A place metrics go: (its name, for errors; `log(metrics, step)`)."""
WandbRun = tuple[str, Any, Callable[[dict, int], object]]
"""A W&B run that gets the metrics, tables and curves: (a name for errors, the run, how a row is written)."""


def console_log() -> logging.Logger:
    """The "dflash_callbacks" logger; when the program has configured no logging at all, its INFO
    lines go to stderr (as Lightning does for its own), so a plain loop sees the run folder and the
    summaries."""
    log = logging.getLogger("dflash_callbacks")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class Host:
    """The protocol every adapter implements (each method's default: one process, nothing logged)."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (a collective: every rank calls it at the same point)."""
        return obj

    def default_dirpath(self, name: str) -> Path:
        """Where run folders go when `dirpath` is not given."""
        return Path.cwd() / name

    def loggers(self) -> list[Logger]:
        """Where metrics go (rank 0), looked up at each report."""
        return []

    def wandb_runs(self) -> list[WandbRun]:
        """The W&B runs that get the metrics, tables and curves."""
        return []

    def trackers(self) -> list:
        """The other destinations of the reports (`trackers/base.Tracker`: TensorBoard, MLflow, the user's
        own), rank 0, looked up once, at the first report."""
        return []

    def set_metrics(self, metrics: dict[str, float]) -> None:
        """The latest means (every rank): Lightning's `callback_metrics`, the plain loop's `metrics`."""

    def horizon(self) -> int | None:
        """The last training step, when known (the stop's projection needs it)."""
        return None

    def ending(self) -> str | None:
        """Why training ends now whatever the stop says (None while it goes on)."""
        return None

    def info(self, text: str) -> None:
        if self.rank == 0:
            console_log().info(text)

    def warn(self, text: str) -> None:
        if self.rank == 0:
            warnings.warn(text, UserWarning, stacklevel=3)


class TorchDistributed:
    """The ranks of torch.distributed (one process when it is not initialised) and its one collective."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world_size = dist.get_world_size() if self.on else 1

    def broadcast(self, obj: Any) -> Any:
        import torch

        device = None
        if torch.distributed.get_backend() == "nccl":  # its objects travel through the rank's own device
            device = torch.device("cuda", torch.cuda.current_device())
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, device=device)
        return box[0]
