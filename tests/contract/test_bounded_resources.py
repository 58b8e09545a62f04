"""Resources stay bounded however long the run and however slow the scorer: snapshot folders on disk never
exceed keep_last and snapshots waiting in memory never exceed max_pending; the rest are skipped, not piled
up. (From the start of a resume: test_isolation.py.)"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from runs import records
from train_run import SCORING, eval_cb, fit, shared_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def test_long_run_keeps_snapshots_and_pending_bounded(world, tmp_path):
    """60 steps, a snapshot every 2, a scorer slower than that (one anchor per forward):
    at every step, at most keep_last=2 snapshot folders (finished or being written) are on
    disk and at most max_pending=2 snapshots wait in memory; the bound is reached and the
    rest are skipped, not piled up."""
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=2, keep_last=2,
                 scoring={**SCORING, "anchors_per_forward": 1})

    class Watch(pl.Callback):
        most_on_disk = most_pending = 0
        samples = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots = cb.run.snapshots_dir
            on_disk = [p for p in snapshots.iterdir() if "step-" in p.name] if snapshots.is_dir() else []
            self.most_on_disk = max(self.most_on_disk, len(on_disk))
            self.most_pending = max(self.most_pending, cb.engine.runner.pending)
            self.samples += 1

    watch = Watch()
    trainer = fit(world, tmp_path, [cb, watch], max_steps=60)
    assert trainer.global_step == 60 and watch.samples == 60 and cb.errors == 0
    assert watch.most_on_disk <= 2 and watch.most_pending <= 2
    assert watch.most_pending == 2 and cb.skipped > 0  # the bound was reached, and held
    assert [s for s, _ in cb.run.list_snapshots()] == [r.step for r in cb.reports][-2:]
    steps = [r["step"] for r in records(tmp_path / "d")]
    assert 30 <= len(steps) + cb.skipped <= 31 and steps[-1] == 60  # 60 may be skipped, then taken at the end
