"""The training loop as the engine sees it: `Host`, and the small parts hosts are made of.

Each adapter gives the engine a Host (Lightning's Trainer, the plain loop, the transformers
Trainer, the checkpoint watcher): its ranks and their one collective, where run folders go,
where metrics and W&B rows go, the loop's last step and whether it is ending, and how it says
things. The defaults are one process with no logger, no known last step, and messages through
`logging` / `warnings`. The parts below (torch.distributed's ranks, a list of log functions, the
active W&B run) are composed by the hosts that need them.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Sequence
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


def log_functions(log: Callable | Sequence[Callable] | None) -> list[Callable[[dict, int], object]]:
    """`log=` of the plain-loop and transformers adapters, as a list (TypeError for anything else)."""
    functions = [] if log is None else [log] if callable(log) else list(log)
    if not all(callable(fn) for fn in functions):
        raise TypeError("log must be a function fn(metrics, step) or a list of them")
    return functions


def as_loggers(functions: list[Callable[[dict, int], object]]) -> list[Logger]:
    return [(getattr(fn, "__qualname__", type(fn).__name__), fn) for fn in functions]


class ActiveWandb:
    """The W&B run reports go to: the one given, else the active `wandb.run` when the script has started
    one (wandb is never imported here), never with `False`. Each run gets a `WandbRows` writer."""

    def __init__(self, given: Any = None):
        self.given = given
        self._rows: dict[int, Any] = {}

    def runs(self) -> list[WandbRun]:
        run = self.given
        if run is None:
            module = sys.modules.get("wandb")
            run = getattr(module, "run", None) if module is not None else None
        if run is None or run is False:
            return []
        rows = self._rows.setdefault(id(run), WandbRows(run))
        return [("wandb", run, rows.log)]


class WandbRows:
    """Writes our rows into a W&B run that the training loop may log to as well, with or without
    `step=`: each report in a row of its own, and W&B's step counter never moved past a step the loop
    has yet to log (W&B drops a row whose step is below its counter).

    A report joins the run's current row, uncommitted (the loop's next log commits it with its own).
    Only when our previous report still sits in that row (the loop has not logged since) is it
    committed first, which moves the counter one past the loop's last step."""

    def __init__(self, run):
        self.run = run
        self.row: int | None = None  # the step of the row our last report joined

    def log(self, payload: dict, step: int) -> None:
        """`payload`, of the report of training step `step` (which it holds as PREFIX/step)."""
        if self.row is not None and self.run.step == self.row:
            self.run.log({}, commit=True)
        self.run.log(payload, commit=False)
        self.row = self.run.step
