"""The three training loops the evaluation attaches to, behind one interface, so that a contract test
is written once and run against each (tests/contract/test_faults_every_adapter.py):

- `Lightning`: `DrafterEvalCallback` in a Lightning fit (tests/scripts/train_run.py `fit`);
- `PlainLoop`: `DrafterEvaluator` in a plain PyTorch loop (loops.py `plain_fit`);
- `Transformers`: `DrafterEvalTrainerCallback` in a transformers `Trainer` (loops.py `hf_fit`).

Each trains the synthetic world's drafter (`shared_world`), builds its evaluation from the same settings
(`evaluation`), runs hooks at the same points of a step (`train`), records what its loggers received
(`logged`, and `rows`: what a logger wrote, where one writes), and runs its training script as a
subprocess with a checkpoint every 3 steps (`script`), whose checkpoints `checkpoints` finds.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from safetensors.torch import load_file
from transformers import TrainerCallback

from loops import SCORING, hf_fit, plain_fit
from suite_paths import SCRIPTS
from train_run import fit, world_paths

Hook = Callable[[torch.nn.Module, int], None]  # (the module that holds `.drafter`, the training step)


class Adapter:
    """One entry point over the world at `world` (a `shared_world` folder). `logged` holds (step, metrics)
    as the loggers (or `log=` functions) received them."""

    name = ""
    SCRIPT, SCRIPT_ARGS = "", []  # the training script in tests/scripts, its arguments for a checkpoint every 3 steps
    CHECKPOINTS = ""  # where under the script's root its checkpoints are (a glob)

    def __init__(self, world: Path):
        self.world, self.paths = Path(world), SimpleNamespace(**world_paths(world))
        self.logged: list[tuple[int, dict]] = []
        self.stop = None

    def evaluation(self, tmp_path: Path, stop=None, **settings):
        """The entry point's evaluation, every 2 steps, its runs under tmp_path/d, no baseline unless given;
        `settings` override these; `stop` (a TrailingBaselineStop) goes where this entry point takes it."""
        args = dict(cache=self.paths.cache, target=self.paths.target, every_n_steps=2, scoring=SCORING,
                    dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False, wait_timeout=300)
        self.stop = stop
        return self._evaluation({**args, **settings})

    def train(self, evaluation, out: Path, max_steps: int, *, before_snapshot: Hook | None = None,
              after_step: Hook | None = None, at_start: Callable[[], None] | None = None,
              resume: Path | None = None) -> tuple[int, torch.nn.Module]:
        """Train for `max_steps` steps in `out` (from the checkpoint `resume`): `before_snapshot` runs after each
        optimizer step, before the evaluation takes its snapshot, `after_step` after the evaluation's step,
        `at_start` once the evaluation has (re)opened its run, before any report is published. Returns the
        last step trained and the module that holds the drafter."""
        raise NotImplementedError

    def rows(self) -> list[tuple[int, dict]]:
        """What reached a logger's own output, as (step, {key: number}): here what was logged."""
        return self.logged

    def script(self, root: Path) -> list[str]:
        """The command line of this entry point's training script, run until it is killed: a report every 2
        steps, no baseline, a checkpoint every 3 steps, its run folder under root/dflash."""
        return [sys.executable, str(SCRIPTS / self.SCRIPT), "--world", str(self.world), "--root", str(root),
                "--max-steps", "100000", "--every", "2", "--no-baseline", "--step-sleep", "0.02", *self.SCRIPT_ARGS]

    def checkpoints(self, root: Path) -> list[tuple[int, Path]]:
        """The checkpoints `script` saved that load, as (step, path), newest first."""
        found = []
        for path in root.glob(self.CHECKPOINTS):
            try:
                found.append((self._saved_step(path), path))
            except Exception:  # one the kill cut short
                continue
        return sorted(found, reverse=True)

    def _saved_step(self, checkpoint: Path) -> int:
        """The step `checkpoint` holds, once it loads."""
        raise NotImplementedError

    def _evaluation(self, args: dict):
        raise NotImplementedError

    def _log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, dict(metrics)))


class _RecordingCSVLogger(CSVLogger):
    """Lightning's CSV logger, noting what it is given."""

    def __init__(self, out: Path, logged: list):
        super().__init__(out, name="run")
        self.noted = logged

    def log_metrics(self, metrics, step=None):
        self.noted.append((step, dict(metrics)))
        super().log_metrics(metrics, step)


class _LightningHooks(pl.Callback):
    def __init__(self, at_batch_end: Hook | None = None, at_start: Callable[[], None] | None = None):
        self.at_batch_end, self.at_start = at_batch_end, at_start

    def on_train_start(self, trainer, pl_module):
        if self.at_start is not None:
            self.at_start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at_batch_end is not None:
            self.at_batch_end(pl_module, trainer.global_step)


class Lightning(Adapter):
    name, SCRIPT, SCRIPT_ARGS, CHECKPOINTS = "lightning", "train_run.py", ["--ckpt-every", "3"], "ckpt/step=*.ckpt"

    def _evaluation(self, args: dict):
        from dflash_callbacks.callbacks import DrafterEvalCallback

        return DrafterEvalCallback(**args)

    def train(self, evaluation, out, max_steps, *, before_snapshot=None, after_step=None, at_start=None, resume=None):
        # before the eval callback: its hook runs first; after it (and the stop): once they ran
        callbacks = [_LightningHooks(before_snapshot), evaluation, *([self.stop] if self.stop else []),
                     _LightningHooks(after_step, at_start)]
        self.logger = _RecordingCSVLogger(out / "logs", self.logged)
        trainer = fit(self.world, out, callbacks, max_steps, logger=self.logger,
                      ckpt_path=None if resume is None else str(resume))
        return trainer.global_step, trainer.lightning_module

    def rows(self):
        """The rows of metrics.csv that hold a number, as (step, {key: number})."""
        with open(Path(self.logger.log_dir) / "metrics.csv") as f:
            return [(int(row.pop("step")), {k: float(v) for k, v in row.items() if v}) for row in csv.DictReader(f)]

    def _saved_step(self, checkpoint):
        return torch.load(checkpoint, weights_only=False, map_location="cpu")["global_step"]


class PlainLoop(Adapter):
    name, SCRIPT, CHECKPOINTS = "loop", "train_loop.py", "ckpt/step=*.pt"
    SCRIPT_ARGS = ["--ckpt-every", "3", "--busy", "queue"]

    def _evaluation(self, args: dict):
        from dflash_callbacks import DrafterEvaluator

        return DrafterEvaluator(**args, stop=self.stop, log=self._log)

    def train(self, evaluation, out, max_steps, *, before_snapshot=None, after_step=None, at_start=None, resume=None):
        if at_start is not None:  # a plain loop has no start hook: right after the engine's start, in the first step()
            start = evaluation.engine.start

            def started(*args, **kwargs):
                start(*args, **kwargs)
                at_start()

            evaluation.engine.start = started
        steps = []

        def after(model, step):
            steps.append(step)
            if after_step is not None:
                after_step(model, step)

        model = plain_fit(self.paths, max_steps, evaluation, resume=resume, before_eval=before_snapshot,
                          after_step=after)
        return steps[-1], model

    def _saved_step(self, checkpoint):
        return torch.load(checkpoint, weights_only=False)["step"]


class _TrainerHooks(TrainerCallback):
    def __init__(self, at_step_end: Hook | None = None, at_start: Callable[[], None] | None = None):
        self.at_step_end, self.at_start = at_step_end, at_start

    def on_train_begin(self, args, state, control, **kwargs):
        if self.at_start is not None:
            self.at_start()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.at_step_end is not None:
            self.at_step_end(model, state.global_step)


class Transformers(Adapter):
    name, SCRIPT, SCRIPT_ARGS, CHECKPOINTS = "hf", "train_hf.py", ["--save-steps", "3"], "checkpoint-*"

    def _evaluation(self, args: dict):
        from dflash_callbacks.hf import DrafterEvalTrainerCallback

        return DrafterEvalTrainerCallback(**args, stop=self.stop, log=self._log)

    def train(self, evaluation, out, max_steps, *, before_snapshot=None, after_step=None, at_start=None, resume=None):
        callbacks = [_TrainerHooks(before_snapshot), evaluation, _TrainerHooks(after_step, at_start)]
        trainer, model = hf_fit(self.paths, out, max_steps, callbacks, save_steps=3 if resume else 0,
                                resume=None if resume is None else str(resume))
        return trainer.state.global_step, model

    def _saved_step(self, checkpoint):
        load_file(str(checkpoint / "model.safetensors"))
        return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


ADAPTERS = {adapter.name: adapter for adapter in (Lightning, PlainLoop, Transformers)}
