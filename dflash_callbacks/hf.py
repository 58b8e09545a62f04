"""DrafterEvalTrainerCallback: the evaluation engine on a transformers `Trainer`.

    callback = DrafterEvalTrainerCallback(cache=..., target=..., baseline=..., every_n_steps=500,
                                          stop=TrailingBaselineStop(monitor="ddtree@8/live"))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with callback:                  # optional: a train() that raises keeps unscored snapshots for a resume
        trainer.train()

The drafter is found on the Trainer's model by attribute (`drafter="drafter"`; None: the model is
the drafter). Snapshots are taken at `state.global_step`, after the optimizer step; the copy has
landed in `on_pre_optimizer_step`. A stop sets `control.should_training_stop` on every rank. Reports
go to the active W&B run (the Trainer's `report_to="wandb"` starts one) and to `log=` functions.
A resume (`trainer.train(resume_from_checkpoint=...)`) goes through the Trainer's own checkpoint:
this callback's state is saved in `trainer_state.json` (it is an `ExportableState`) and read back at
`on_train_begin`; leave `restore_callback_states_from_checkpoint` False (its re-creation of callbacks
from their arguments would drop the stop objects).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .engine.drafters import drafter_config_of, resolve_drafter, unwrap
from .engine.evaluator import EvalEngine
from .engine.stop import StopPolicy
from .loop import LoopHost
from .model import DrafterConfig
from .scoring.config import ScoringConfig


class TrainerHost(LoopHost):
    """A transformers Trainer as the engine's host: its ranks, output folder, step limit and stop."""

    def __init__(self, callback: DrafterEvalTrainerCallback, args, state, control):
        super().__init__(callback)
        self.args, self.state, self.control = args, state, control
        self.rank, self.world_size = args.process_index, args.world_size

    def default_dirpath(self, name: str) -> Path:
        return Path(self.args.output_dir) / name

    def horizon(self) -> int | None:
        return self.state.max_steps if self.state.max_steps and self.state.max_steps > 0 else None

    def ending(self) -> str | None:
        if self.control.should_training_stop:
            return "control.should_training_stop is already set"
        if self.state.max_steps and 0 < self.state.max_steps <= self.state.global_step:
            return f"max_steps={self.state.max_steps} reached"
        return None


class DrafterEvalTrainerCallback(TrainerCallback, ExportableState):
    """Snapshot the Trainer's drafter every `every_n_steps` optimizer steps and score it in the background.

    Args:
        drafter: the attribute path of the drafter on the Trainer's model, a function model -> drafter,
            or None when the model is the drafter.
        every_n_steps, stop, drafter_config, log, wandb: as DrafterEvaluator's.
        The other arguments are DrafterEvalCallback's; `dirpath` defaults to <output_dir>/<name>.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        target: str | os.PathLike,
        baseline: str | os.PathLike | None = None,
        every_n_steps: int = 500,
        stop: StopPolicy | Sequence[StopPolicy] | None = None,
        drafter: str | Callable[[nn.Module], nn.Module] | None = "drafter",
        drafter_config: DrafterConfig | str | os.PathLike | None = None,
        scoring: ScoringConfig | Mapping | None = None,
        runner: str = "thread",
        device: str | None = None,
        busy: str = "skip",
        max_pending: int = 1,
        keep_last: int = 2,
        on_error: str = "warn",
        wait_on_end: bool = True,
        dirpath: str | os.PathLike | None = None,
        baseline_cache_dir: str | os.PathLike | None = None,
        wait_timeout: float = 3600.0,
        name: str = "dflash",
        verbose: bool = True,
        sync_every_n_steps: int = 1,
        log: Callable[[dict, int], object] | Sequence[Callable[[dict, int], object]] | None = None,
        wandb: Any = None,
    ):
        self.engine = EvalEngine(cache, target, baseline, every_n_steps, scoring, runner, device, busy, max_pending,
                                 keep_last, on_error, wait_on_end, dirpath, baseline_cache_dir, wait_timeout, name,
                                 verbose, sync_every_n_steps)
        stops = [] if stop is None else [stop] if isinstance(stop, StopPolicy) else list(stop)
        if not all(isinstance(s, StopPolicy) for s in stops):
            raise TypeError("stop must be a TrailingBaselineStop (a StopPolicy), a list of them, or None")
        for policy in stops:
            self.engine.add_stop(policy)
        if not (drafter is None or isinstance(drafter, str) or callable(drafter)):
            raise TypeError("drafter must be an attribute path, a function model -> drafter, or None (the model)")
        if not (drafter_config is None or isinstance(drafter_config, (DrafterConfig, str, os.PathLike))):
            raise TypeError("drafter_config must be a DrafterConfig, a config.json path or None")
        self.drafter, self.drafter_config = drafter, drafter_config
        self.log = [] if log is None else [log] if callable(log) else list(log)
        if not all(callable(fn) for fn in self.log):
            raise TypeError("log must be a function fn(metrics, step) or a list of them")
        self.wandb = wandb
        self.max_steps: int | None = None  # LoopHost reads these two
        self.last_step: int | None = None
        self.metrics: dict[str, float] = {}
        self.resume_state: dict | None = None  # set by the Trainer when it re-creates callbacks from their state
        self._module: nn.Module | None = None
        self._host: TrainerHost | None = None
        self._finished = False

    # ------------------------------------------------------------------ state (trainer_state.json)
    def state(self) -> dict:
        return {"args": {}, "attributes": {"resume_state": {
            "engine": self.engine.state_dict(), "stops": [p.state_dict() for p in self.engine.stops.policies]}}}

    @property
    def history(self) -> list[dict]:
        return self.engine.history

    @property
    def reports(self):
        return self.engine.reports

    @property
    def errors(self) -> int:
        return self.engine.errors

    @property
    def run(self):
        return self.engine.run

    # ------------------------------------------------------------------ hooks
    def _drafter_of(self, model: nn.Module) -> nn.Module:
        if self.drafter is None:
            return unwrap(model)
        return resolve_drafter(model, self.drafter, type(self).__name__)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Every check, then the run folder (a resume's, when the Trainer resumes from a checkpoint)."""
        self._host = TrainerHost(self, args, state, control)
        self._module = self._drafter_of(model)
        config = drafter_config_of(self._module, self.drafter_config, type(self).__name__, model,
                                   self.drafter or "the model")
        self.max_steps, self.last_step, self._finished = self._host.horizon(), None, False
        self.engine.check(self._host, self._module, config, self.max_steps)
        saved = self.resume_state or (state.stateful_callbacks.get(type(self).__name__) or {}).get("attributes", {}).get(
            "resume_state")
        if state.global_step > 0 and saved:
            self.engine.load_state_dict(saved["engine"])
            for policy, policy_state in zip(self.engine.stops.policies, saved.get("stops", [])):
                policy.load_state_dict(policy_state)
        self.resume_state = None
        self.engine.start(self._host, self._module)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.engine.copy_landed()

    def on_step_end(self, args, state, control, **kwargs):
        self._host.state, self._host.control = state, control
        self.last_step = state.global_step
        if self.engine.on_step(state.global_step, int(state.epoch or 0), self._module) is not None:
            control.should_training_stop = True
        if control.should_training_stop or (state.max_steps and state.global_step >= state.max_steps):
            self._finish(state)  # before the Trainer loads the best model at the end

    def _finish(self, state) -> None:
        if not self._finished:
            self._finished = True
            self.engine.finish(state.global_step, int(state.epoch or 0), self._module)

    def on_train_end(self, args, state, control, **kwargs):
        self._finish(state)
        if self.engine.wait_on_end:
            self.engine.close(True, f"wait_timeout={self.engine.wait_timeout:g} s ran out at the end of training")
        else:
            self.engine.close(False, "wait_on_end=False: train() returned without waiting for it")

    def __enter__(self) -> DrafterEvalTrainerCallback:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """A train() that raised: the run folder is released, unscored snapshots stay for a resume."""
        if error is not None:
            self.engine.close(False, f"train() stopped on {type(error).__name__}", publish=False)


__all__ = ["DrafterEvalTrainerCallback"]
