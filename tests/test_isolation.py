"""Evaluation reads the training process and never writes to it: a seeded run ends with the same
weights, bit for bit, with and without evaluation attached, on every runner and entry point; the
true-precision modes (which set the process-wide default dtype around every training forward)
lose no report; the engine's state keys, bounds and failures hold across resumes.
(Scoring's own isolation, function by function, is in test_global_state.py.)"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.training import CacheSequences, DFlashTrainingModule, collate_sequences

from loops import SCORING, plain_fit
from runs import assert_clean, records, run_dir

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from train_run import shared_world, world_paths  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from synthetic import build_world

    return build_world(tmp_path_factory.getbasetemp() / "isolation-world")


def lightning_fit(world, tmp_path: Path, callbacks: list, max_steps: int, **trainer_kwargs) -> pl.Trainer:
    """A seeded Lightning run with a shuffling loader that draws its order from the global RNG (as
    a user's does): anything else that draws from it changes the order, and so the weights."""
    pl.seed_everything(0, verbose=False)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    data = DataLoader(CacheSequences(world.cache), batch_size=1, shuffle=True, collate_fn=collate_sequences)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, **trainer_kwargs)
    trainer.fit(module, data)
    return trainer


def eval_cb(world, tmp_path: Path, **kwargs) -> DrafterEvalCallback:
    args = dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=2,
                scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False,
                busy="queue", max_pending=4)
    return DrafterEvalCallback(**{**args, **kwargs})


@pytest.mark.parametrize("runner", ["thread", "process"])
def test_a_seeded_lightning_run_is_bit_identical_with_and_without_evaluation(world, tmp_path, runner):
    """Building the target head drew from the global RNG (its nn.Linear init), in the preflight and on the
    scoring thread, at a time that raced the training thread: the loader's shuffle order, and so every
    weight, changed once the callback was attached."""
    alone = lightning_fit(world, tmp_path / "alone", [], max_steps=12).lightning_module.drafter.state_dict()
    cb = eval_cb(world, tmp_path, runner=runner)
    trainer = lightning_fit(world, tmp_path / "with", [cb], max_steps=12)
    assert len(cb.history) >= 3 and cb.history[-1]["step"] == 12 and cb.errors == 0
    watched = trainer.lightning_module.drafter.state_dict()
    assert all(torch.equal(alone[k], watched[k]) for k in alone)
    assert_clean(tmp_path / "d", cb.reports)


def test_a_seeded_plain_loop_is_bit_identical_with_and_without_evaluation(world, tmp_path):
    alone = plain_fit(world, 12).drafter.state_dict()
    torch.manual_seed(0)
    evaluator = DrafterEvaluator(world.cache, world.target, world.baseline, every_n_steps=2, scoring=SCORING,
                                 dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False,
                                 busy="queue", max_pending=4)
    watched = plain_fit(world, 12, evaluator).drafter.state_dict()
    assert len(evaluator.history) >= 3 and evaluator.history[-1]["step"] == 12 and evaluator.errors == 0
    assert all(torch.equal(alone[k], watched[k]) for k in alone)
    assert_clean(tmp_path / "d", evaluator.reports)


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_true_precision_scores_every_report_as_score_does(world, tmp_path, precision):
    """Lightning's true-precision modes set the process-wide default dtype around every training forward:
    the scoring thread built its tensors in it, and 5 of 6 reports were error lines (`top_logprobs must be a
    float32 tensor ... got torch.bfloat16`), the baseline's too, so no stop could ever judge."""
    cb = eval_cb(world, tmp_path, keep_last=10)
    trainer = lightning_fit(world, tmp_path, [cb], max_steps=8, precision=precision)
    assert trainer.global_step == 8 and cb.errors == 0 and cb.baseline_report is not None
    assert [r.step for r in cb.reports] == [2, 4, 6, 8]
    dtype = {"bf16-true": torch.bfloat16, "64-true": torch.float64}[precision]
    assert trainer.lightning_module.drafter.fc.weight.dtype == dtype
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    for report in cb.reports:
        assert report.tasks == service.score_folder(cb.run.snapshot_path(report.step)).tasks
    assert isinstance(trainer.callback_metrics["dflash/ddtree@4/live/mean"], torch.Tensor)
    assert trainer.callback_metrics["dflash/ddtree@4/live/mean"].dtype == torch.float32
    assert_clean(tmp_path / "d", cb.reports)
