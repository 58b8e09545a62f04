"""DrafterEvalTrainerCallback: the evaluation engine on a transformers `Trainer` (README: "The transformers
Trainer"). Its hooks, and what the engine does in them:

    on_init_end:            TrainingArguments(restore_callback_states_from_checkpoint=True) is refused
    on_train_begin:         the drafter found on the model (`drafter=None`: the model), every input checked,
                            then the run folder (a resume's: its state read from the checkpoint's
                            trainer_state.json, where this `ExportableState` saves it)
    on_pre_optimizer_step:  the snapshot's copy has landed before the optimizer writes the weights
    on_step_end:            reports published; every `every_n_steps`, a snapshot; a stop sets
                            `control.should_training_stop`; when training stops here, the last step's
                            snapshot, before the Trainer loads the best model at the end
    on_epoch_end:           the same, when a later callback stopped training (EarlyStoppingCallback)
    on_train_end:           the last reports, then the run folder is released
    `with callback:`        around `trainer.train()`: a train() that raises keeps unscored snapshots

Reports go to the active W&B run (`report_to="wandb"`; a row of its own each, none of the Trainer's lost),
to the Trainer's own TensorBoard and MLflow integrations (`report_to=["tensorboard", "mlflow"]`: their
folder and run, `trackers/trainer_integrations.py`), to `trackers=` and to `log=` functions."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from typing_extensions import Unpack

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .engine.drafters import check_drafter_config, drafter_config_of, refuse_collective_wrappers, resolve_drafter, unwrap
from .engine.eval_engine import EvalEngine
from .engine.host import Host, TorchDistributed
from .engine.trackers.base import Tracker, checked_trackers
from .engine.trackers.log_functions import as_loggers, log_functions
from .engine.trackers.trainer_integrations import calling_handler, trainer_trackers
from .engine.trackers.wandb import ActiveWandb
from .engine.stop import StopPolicy, stop_policies
from .engine.adapter import EvalAdapter
from .model import DrafterConfig
from .settings import EvalFields, EvalSettings, eval_settings


class TrainerHost(Host):
    """A transformers Trainer as the engine's host: its ranks, output folder, step limit and stop."""

    def __init__(self, callback: DrafterEvalTrainerCallback, args, state, control):
        self.callback, self.args, self.state, self.control = callback, args, state, control
        self.rank, self.world_size = args.process_index, args.world_size
        self.integrations: list = []  # the Trainer's TensorBoard and MLflow callbacks' trackers (rank 0)

    def update(self, state, control) -> None:
        """The Trainer's state and control at this step (what `horizon` and `ending` read)."""
        self.state, self.control = state, control

    def broadcast(self, obj: Any) -> Any:
        return TorchDistributed().broadcast(obj)  # the Trainer made the process group

    def default_dirpath(self, name: str) -> Path:
        return Path(self.args.output_dir) / name

    def loggers(self):
        return as_loggers(self.callback.log)

    def wandb_runs(self):
        return self.callback.wandb.runs()

    def trackers(self):
        return [*self.callback.trackers, *self.integrations]

    def horizon(self) -> int | None:
        return self.state.max_steps if self.state.max_steps and self.state.max_steps > 0 else None

    def ending(self) -> str | None:
        if self.state.max_steps and 0 < self.state.max_steps <= self.state.global_step:
            return f"max_steps={self.state.max_steps} reached"
        return "control.should_training_stop is already set" if self.control.should_training_stop else None


class DrafterEvalTrainerCallback(EvalAdapter, TrainerCallback, ExportableState):
    """Snapshot the Trainer's drafter every `every_n_steps` optimizer steps and score it in the background.

    Takes an `EvalSettings` (`settings=`, as `Trainer(args=TrainingArguments(...))`) or its fields, and:

    Args:
        cache, target, baseline: the hidden-state cache, the target's folder and the baseline (a drafter folder
            or a saved report); by position or by name.
        settings: an `EvalSettings` instead of its fields.
        **fields: any other field of `EvalSettings` (every_n_steps, scoring, runner, ...: `EvalFields`;
            docs/configuration.md lists each with its default).
        stop, drafter_config, log, wandb, trackers: as DrafterEvaluator's; `report_to`'s TensorBoard and
            MLflow integrations get the reports too, in their folder and run.
        drafter: the attribute path of the drafter on the Trainer's model, a function model -> drafter, or
            None when the model is the drafter. `dirpath` defaults to <output_dir>/<name>.

    Attributes (every rank): `metrics` (the latest means, NaN before the first report), `history`, `errors`,
    `skipped`, `should_stop`, `stop_reason`; on rank 0 also `reports`, `baseline_report`, `run`.
    """

    def __init__(self, cache: str | os.PathLike[str] | None = None, target: str | os.PathLike[str] | None = None,
                 baseline: str | os.PathLike[str] | None = None, *, settings: EvalSettings | None = None,
                 stop: StopPolicy | Sequence[StopPolicy] | None = None,
                 drafter: str | Callable[[nn.Module], nn.Module] | None = "drafter",
                 drafter_config: DrafterConfig | str | os.PathLike[str] | None = None,
                 log: Callable | Sequence[Callable] | None = None, wandb: Any = None,
                 trackers: Sequence[Tracker] | None = None, **fields: Unpack[EvalFields]):
        given = {"cache": cache, "target": target, "baseline": baseline}
        self.engine = EvalEngine(eval_settings(settings, given, fields, type(self).__name__))
        for policy in stop_policies(stop):
            self.engine.add_stop(policy)  # its monitor must be scored: checked now
        if not (drafter is None or isinstance(drafter, str) or callable(drafter)):
            raise TypeError("drafter must be an attribute path, a function model -> drafter, or None (the model)")
        self.drafter, self.drafter_config = drafter, check_drafter_config(drafter_config)
        self.log, self.wandb, self.trackers = log_functions(log), ActiveWandb(wandb), checked_trackers(trackers)
        self._module: nn.Module | None = None
        self._host: TrainerHost | None = None  # the Trainer as the engine's host, after on_train_begin
        self._finished = False


    # ------------------------------------------------------------------ state (trainer_state.json)
    def state(self) -> dict:
        """What the Trainer saves in each checkpoint's trainer_state.json (primitives only). "args" is
        empty: this callback is never re-created from it (see on_init_end)."""
        return {"args": {}, "attributes": {"resume_state": {"name": self.name, "engine": self.engine.state_dict()}}}

    def _saved_state(self, state) -> dict | None:
        """This callback's state in a resumed checkpoint's trainer_state.json: the latest entry of its name
        (with several callbacks of this class, the Trainer keeps a list and appends at each save)."""
        entries = state.stateful_callbacks.get(type(self).__name__) or []
        entries = entries if isinstance(entries, list) else [entries]
        saved = [(e.get("attributes") or {}).get("resume_state") or {} for e in entries if isinstance(e, dict)]
        mine = [s for s in saved if s.get("name") == self.name]
        return mine[-1] if mine else None

    # ------------------------------------------------------------------ hooks
    def on_init_end(self, args, state, control, **kwargs):
        """Refuse what would replace this callback: the Trainer's restore re-creates callbacks from their
        saved arguments, and one made from none would have no cache, no target and no stop."""
        if args.restore_callback_states_from_checkpoint:
            raise ValueError(
                f"{type(self).__name__} can not be re-created by TrainingArguments(restore_callback_states_from_"
                "checkpoint=True) (the Trainer would build it from no arguments and drop this one); leave it False: "
                "this callback restores its own state from the checkpoint's trainer_state.json on "
                "trainer.train(resume_from_checkpoint=...)")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Every check, then the run folder (a resume's, when the Trainer resumes from a checkpoint)."""
        self._host = host = TrainerHost(self, args, state, control)
        if host.rank == 0:  # the integrations open their writer and run on rank 0 only, before this hook
            host.integrations = trainer_trackers(calling_handler())
        self._module = unwrap(model) if self.drafter is None else resolve_drafter(model, self.drafter, type(self).__name__)
        refuse_collective_wrappers(self._module, model, f"{type(self).__name__}(drafter={self.drafter!r})")
        config = drafter_config_of(self._module, self.drafter_config, type(self).__name__, model,
                                   self.drafter or "the model")
        self._finished = False
        self.engine.check(host, self._module, config, host.horizon())
        for policy in self.engine.policies:
            policy.reset()  # nothing of an earlier train() with these stops; a resume loads its own below
        saved = self._saved_state(state) if state.global_step > 0 else None
        if saved is not None:
            self.engine.load_state_dict({**saved["engine"], **({"stops": saved["stops"]} if "stops" in saved else {})})
        self.engine.start(host, self._module)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.engine.copy_landed()

    def on_step_end(self, args, state, control, **kwargs):
        self._host.update(state, control)
        if self.engine.on_step(state.global_step, int(state.epoch or 0), self._module) is not None:
            control.should_training_stop = True
        if control.should_training_stop or 0 < state.max_steps <= state.global_step:
            self._finish(state)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_training_stop:  # set after on_step_end (an EarlyStoppingCallback's on_evaluate)
            self._finish(state)

    def _finish(self, state) -> None:
        """The last step's snapshot, once: before the Trainer loads the best model at the end."""
        if not self._finished:
            self._finished = True
            self.engine.finish(state.global_step, int(state.epoch or 0), self._module)

    def on_train_end(self, args, state, control, **kwargs):
        self._finish(state)
        self.engine.end(where="train()")

    def __enter__(self) -> DrafterEvalTrainerCallback:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """A train() that raised: the run folder is released, unscored snapshots stay for a resume."""
        if error is not None:
            self.engine.end(error=error, where="train()")


__all__ = ["DrafterEvalTrainerCallback"]
