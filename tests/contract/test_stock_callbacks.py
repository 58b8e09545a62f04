"""Lightning's stock callbacks on a drafter metric: the means are in `callback_metrics` on every rank
(a NaN placeholder before the first report, so a monitor is never missing), ModelCheckpoint ranks a
placeholder below any number, and DrafterEarlyStopping counts each report once (stock EarlyStopping
on our keys is refused before training: it counted one report at every check)."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from dflash_callbacks import DrafterEarlyStopping

from runs import assert_clean

from train_run import ValidatedModule, eval_cb, make_loader, make_module, shared_world  # noqa: E402

MONITOR = "dflash/ddtree@4/live/mean"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


class Arrivals(pl.Callback):
    """The global step at which each new report's means reached callback_metrics, and what the early stop had
    counted by then (listed after the eval callback and the early stop: it sees both at the same batch)."""

    def __init__(self, early: DrafterEarlyStopping | None = None):
        self.early, self.seen, self.validations_before_first = early, [], 0

    def on_validation_end(self, trainer, pl_module):
        if not self.seen:
            self.validations_before_first += 1
            assert math.isnan(float(trainer.callback_metrics[MONITOR]))  # the placeholder

    def on_train_batch_end(self, trainer, pl_module, *args):
        step = trainer.callback_metrics.get("dflash/step")
        if step is not None and (not self.seen or self.seen[-1][0] != float(step)):
            self.seen.append((float(step), trainer.global_step, self.early.wait_count if self.early else None))


def validated_fit(world, tmp_path, callbacks, max_steps):
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    trainer.fit(make_module(world, ValidatedModule), make_loader(world), val_dataloaders=make_loader(world))
    return trainer


def test_drafter_early_stopping_counts_each_report_once(world, tmp_path):
    """Stock EarlyStopping on a dflash key read the same report at every validation: with patience=3 it stopped
    after 2 reports. Here every report is a non-improvement after the first (min_delta=100), validation runs
    after every batch, and training stops at the fourth report: patience 3 means 3 reports."""
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8)
    early = DrafterEarlyStopping(monitor=MONITOR, min_delta=100.0, patience=3)
    arrivals = Arrivals(early)
    trainer = validated_fit(world, tmp_path, [cb, early, arrivals], max_steps=200)
    assert trainer.should_stop and trainer.global_step < 200
    assert [wait for _, _, wait in arrivals.seen] == [0, 1, 2, 3]
    assert arrivals.seen[-1][1] == trainer.global_step  # stopped at the batch the fourth report arrived
    assert "did not improve in the last 3 records" in early.stopping_reason_message
    assert_clean(tmp_path / "d", cb.reports)


def test_a_monitored_model_checkpoint_outlives_the_time_before_the_first_report(world, tmp_path):
    """With a validation loop, ModelCheckpoint(monitor="dflash/...") killed fit before the first report landed
    (MisconfigurationException: the key does not exist yet); the NaN placeholder ranks below any number."""
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8)
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor=MONITOR, mode="max", save_top_k=1, filename="{step}")
    arrivals = Arrivals()
    validated_fit(world, tmp_path, [cb, best, arrivals], max_steps=8)
    assert arrivals.validations_before_first >= 1  # ModelCheckpoint checked while only the placeholder was there
    assert len(list((tmp_path / "best").glob("*.ckpt"))) == 1
    seen = {int(step) for step, _, _ in arrivals.seen}  # the reports that reached callback_metrics during training
    scores = [r.value("ddtree@4/live") for r in cb.reports if r.step in seen]
    assert any(float(best.best_model_score) == pytest.approx(v, rel=1e-6) for v in scores)  # a report, never NaN
    assert_clean(tmp_path / "d", cb.reports)


def test_stock_early_stopping_on_a_drafter_key_is_refused_before_training(world, tmp_path):
    cb = eval_cb(world, tmp_path)
    with pytest.raises(ValueError, match=r"EarlyStopping\(monitor='dflash/ddtree@4/live/mean'\) would count the same "
                                         r"report at every check .* use dflash_callbacks.DrafterEarlyStopping"):
        validated_fit(world, tmp_path, [cb, EarlyStopping(monitor=MONITOR, mode="max")], max_steps=4)
    EarlyStopping(monitor="val/loss")  # another key is left alone
    validated_fit(world, tmp_path, [eval_cb(world, tmp_path), EarlyStopping(monitor="val/loss")], max_steps=2)
