"""DrafterEvaluator: the evaluation engine in a plain PyTorch loop (one process, DDP or FSDP2), with no
framework: `attach(drafter, optimizer)` before the first step, `step(step)` after each optimizer step
(True once the stop decided), `close()` at the end (README: "A plain PyTorch loop").

`attach` hooks the optimizer: a snapshot's copy (on CUDA, pinned, on a side stream) has landed before the
optimizer writes the weights, so a report holds the weights of the step it names; a write that bypasses
the optimizer (an EMA swap, `load_state_dict`, a clamp of `p.data`) calls `sync()` first. Under
`torch.distributed` every rank calls `attach`, `step` and `close` (the FSDP2 gather and rank 0's news are
collectives); rank 0 scores. A loop that raises inside `with evaluator:`, or past it, keeps what is on
disk for a resume."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Unpack

import torch
from torch import nn

from .checks import check_int, is_int
from .engine.drafters import (
    check_drafter_config, drafter_config_of, optimizer_problems, refuse_collective_wrappers, unwrap,
)
from .engine.eval_engine import EvalEngine
from .engine.host import Host, TorchDistributed
from .engine.trackers.base import Tracker, checked_trackers
from .engine.trackers.log_functions import as_loggers, log_functions
from .engine.trackers.wandb import ActiveWandb
from .engine.stop import StopPolicy, stop_policies
from .engine.adapter import EvalAdapter
from .model import DrafterConfig
from .scoring.service import PreflightError
from .settings import EvalFields, EvalSettings, eval_settings


class LoopHost(Host):
    """A plain loop as the engine's host: torch.distributed's ranks, the user's log functions, the W&B run."""

    def __init__(self, evaluator: DrafterEvaluator):
        self.evaluator, self.ranks = evaluator, TorchDistributed()
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size

    def broadcast(self, obj: Any) -> Any:
        return self.ranks.broadcast(obj)

    def loggers(self):
        return as_loggers(self.evaluator.log)

    def wandb_runs(self):
        return self.evaluator.wandb.runs()

    def trackers(self):
        return list(self.evaluator.trackers)

    def horizon(self) -> int | None:
        return self.evaluator.max_steps

    def ending(self) -> str | None:
        max_steps, step = self.evaluator.max_steps, self.evaluator.last_step
        return f"max_steps={max_steps} reached" if max_steps is not None and step is not None and step >= max_steps \
            else None


class DrafterEvaluator(EvalAdapter):
    """Snapshot the drafter every `every_n_steps` steps of a plain loop and score it in the background.

    Takes an `EvalSettings` (`settings=`) or its fields, and:

    Args:
        cache, target, baseline: the hidden-state cache, the target's folder and the baseline (a drafter folder
            or a saved report); by position or by name.
        settings: an `EvalSettings` instead of its fields.
        **fields: any other field of `EvalSettings` (every_n_steps, scoring, runner, ...: `EvalFields`;
            docs/configuration.md lists each with its default).
        stop: a TrailingBaselineStop (any `StopPolicy`), or a list of them: `step()` returns True once one decides.
        drafter_config: a DrafterConfig or config.json path, when the drafter has none at `.config`.
        max_steps: the loop's last step, when known: the stop's projection horizon; a report of that step
            (or later) never stops training (it ends anyway).
        log: a function `fn(metrics, step)`, or a list of them, that gets every report's numbers at the
            snapshot's step (TensorBoard: `lambda m, s: [writer.add_scalar(k, v, s) for k, v in m.items()]`).
        wandb: a W&B run to log to; None: the active `wandb.run` when there is one; False: never.
        trackers: other destinations of every report (`TensorBoardTracker(folder)`, `MlflowTracker(uri, ...)`,
            any `Tracker`): its keys at the snapshot's step, its per-task table, the live-tau plot at the end.

    Attributes (every rank): `metrics` (the latest means, NaN before the first report), `history`, `errors`,
    `should_stop`, `stop_reason`; on rank 0 also `reports`, `baseline_report`, `run`.
    """

    def __init__(self, cache: str | os.PathLike[str] | None = None, target: str | os.PathLike[str] | None = None,
                 baseline: str | os.PathLike[str] | None = None, *, settings: EvalSettings | None = None,
                 stop: StopPolicy | Sequence[StopPolicy] | None = None,
                 drafter_config: DrafterConfig | str | os.PathLike[str] | None = None, max_steps: int | None = None,
                 log: Callable | Sequence[Callable] | None = None, wandb: Any = None,
                 trackers: Sequence[Tracker] | None = None, **fields: Unpack[EvalFields]):
        given = {"cache": cache, "target": target, "baseline": baseline}
        self.engine = EvalEngine(eval_settings(settings, given, fields, type(self).__name__))
        for policy in stop_policies(stop):
            self.engine.add_stop(policy)  # its monitor must be scored: checked now
        self.drafter_config = check_drafter_config(drafter_config)
        self.max_steps = check_int("max_steps", max_steps, 1, optional=True)
        self.log, self.wandb, self.trackers = log_functions(log), ActiveWandb(wandb), checked_trackers(trackers)
        self.last_step: int | None = None
        self._drafter: nn.Module | None = None
        self._hooks: list = []
        self._updates = self._updates_at_last_step = 0  # optimizer steps seen by the post-hook, and at the last step()
        self._closed = False


    # ------------------------------------------------------------------ before training
    def attach(self, drafter: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        """Every rank, before the first step: check everything (the drafter, its optimizer, the cache, the
        target, the baseline, the scoring config, the device) and hook the optimizer. Raises PreflightError
        listing every problem."""
        if self._drafter is not None:
            raise RuntimeError("DrafterEvaluator.attach() was called already: one evaluator follows one drafter")
        if not isinstance(drafter, nn.Module):
            raise TypeError(f"attach(drafter, optimizer): the drafter must be an nn.Module; got {type(drafter).__name__}")
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
        module = unwrap(drafter)
        refuse_collective_wrappers(module, drafter, "attach(drafter, optimizer)")
        problems = optimizer_problems(module, optimizers, "attach(drafter, optimizer)")
        config = drafter_config_of(module, self.drafter_config, "DrafterEvaluator", drafter="drafter")
        try:
            self.engine.check(LoopHost(self), module, config, self.max_steps)
        except PreflightError as e:
            problems += str(e).splitlines()[1:]
        if problems:
            raise PreflightError("the scoring inputs do not fit together:\n  " + "\n  ".join(p.strip() for p in problems))
        self._drafter = module
        for opt in optimizers:
            self._hooks.append(opt.register_step_pre_hook(lambda *args: self.engine.copy_landed()))
            self._hooks.append(opt.register_step_post_hook(lambda *args: self._count_update()))

    def _count_update(self) -> None:
        self._updates += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume, before the first `step()`: the run folder of the saved run is reopened, its history
        rebuilt from results.jsonl, and the stops go on with their counts."""
        if self.last_step is not None:
            raise RuntimeError("load_state_dict() must come before the first step()")
        self.engine.load_state_dict(state_dict.get("engine", state_dict))  # {"engine": ...}: an earlier version's

    # ------------------------------------------------------------------ training
    def step(self, step: int) -> bool:
        """Every rank, after `optimizer.step()` of training step `step` (steps go forward; a repeated step,
        under gradient accumulation, only publishes). Returns True on every rank once the stop decided."""
        if self._drafter is None:
            raise RuntimeError("call DrafterEvaluator.attach(drafter, optimizer) before step()")
        if self._closed:
            raise RuntimeError("step() after close(): this evaluator's run is over")
        if not is_int(step) or step < 0:
            raise ValueError(f"step() takes the training step, an integer >= 0; got {step!r}")
        step = int(step)
        if self.last_step is not None and step < self.last_step:
            raise ValueError(f"step() got step {step} after step {self.last_step}: steps go forward (a resume "
                             "restores the evaluator with load_state_dict and goes on from its step)")
        if self.last_step is None:
            self.engine.start(LoopHost(self), self._drafter)
        elif step != self.last_step and self._updates == self._updates_at_last_step:
            warnings.warn(f"DrafterEvaluator.step({step}): the optimizer has not stepped since step({self.last_step}); "
                          "call step() after optimizer.step(), or its snapshot holds the weights of the step before",
                          UserWarning, stacklevel=2)
        self._updates_at_last_step, self.last_step = self._updates, step
        self.engine.on_step(step, 0, self._drafter)
        return self.engine.state.should_stop

    def sync(self) -> None:
        """Wait for a snapshot's copy to land: call it before writing the weights other than through the
        optimizer (an EMA swap, load_state_dict, clamping p.data)."""
        self.engine.copy_landed()

    # ------------------------------------------------------------------ the end
    def close(self, error: BaseException | None = None) -> None:
        """Every rank, after the last step: its snapshot (with wait_on_end), then on rank 0 the pending
        reports within wait_timeout, and the run folder is released. With `error` (the loop raised), what is
        on disk stays for a resume. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.last_step is not None:  # never started: no run folder
            self.engine.end(self.last_step, 0, self._drafter, error=error, where="the loop")

    def __enter__(self) -> DrafterEvaluator:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(error)


__all__ = ["DrafterEvaluator", "LoopHost"]
