"""TrailingBaselineStop in real Lightning runs: the trainer stops at the step the rule says, with a
projection to max_steps, a warn action that trains to the end, a second fit that starts fresh, a stop
decided once training ends anyway, and DDP ranks that stop together at the next sync. The reports are
scripted (`ScriptedReports`): nothing is scored. (The rule itself: tests/unit/test_stopping.py.)"""

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dflash_callbacks.callbacks.eval_callback import DrafterEvalCallback
from dflash_callbacks.callbacks.host import LightningHost
from dflash_callbacks.callbacks.stopping import TrailingBaselineStop
from dflash_callbacks.engine.snapshot_schedule import Schedule

from made_reports import BASE, make_report


class TinyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def tiny_loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


class ScriptedReports(DrafterEvalCallback):
    """A DrafterEvalCallback whose reports are scripted: at scripted global steps its engine hands a real
    EvalReport to the stops (rank 0 only, on the training thread, as after scoring) and brings their
    stop to every rank, as it does for scored reports. Nothing is scored and no folder is written."""

    def __init__(self, values: dict[int, float], baseline: float | None = BASE, history: list[dict] = (),
                 at_end: float | None = None, sync_every_n_steps: int = 1):
        super().__init__(cache="scripted", target="scripted", baseline=None if baseline is None else "scripted",
                         verbose=False, sync_every_n_steps=sync_every_n_steps)
        self.values, self.history0, self.at_end = values, list(history), at_end  # at_end: a report in on_train_end
        self.base = None if baseline is None else make_report(baseline, None)

    def setup(self, trainer, pl_module, stage):
        self.engine.host = LightningHost(trainer)

    def on_train_start(self, trainer, pl_module):  # what engine.start does, less the run folder and the runner
        engine = self.engine
        engine.host, engine._started = LightningHost(trainer), True
        engine._fresh({"history": self.history0})
        engine.schedule = Schedule(engine.settings, None, {})
        engine.publisher.baseline = self.base

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.publish(trainer, self.values.get(trainer.global_step))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer, pl_module):
        pass

    def on_train_end(self, trainer, pl_module):
        self.engine.publisher.close()
        self.publish(trainer, self.at_end)

    def _module(self, pl_module):
        return pl_module

    def publish(self, trainer, value: float | None) -> None:
        if value is None or trainer.global_rank != 0:
            return
        report = make_report(value, trainer.global_step)
        self.engine.state.add({"step": report.step, "mean": report.mean})
        self.engine.publisher.notify(report)


def fit(stop: TrailingBaselineStop, values: dict[int, float], max_steps: int = 20, at_end: float | None = None,
        more: list = (), source: ScriptedReports | None = None, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[*more, source or ScriptedReports(values, at_end=at_end), stop],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(TinyModule(), tiny_loader())
    return trainer


def test_trainer_stops_at_the_expected_step(tmp_path):
    stop = TrailingBaselineStop(min_ratio=0.9, patience=3, grace_steps=4)
    # step 2 is in the grace period; step 6 recovers; 8, 10, 12 trail -> stop at 12
    values = {2: 1.0, 4: 3.0, 6: 5.5, 8: 3.1, 10: 3.2, 12: 3.3, 14: 3.4}
    trainer = fit(stop, values)
    assert trainer.global_step == 12 < trainer.max_steps
    assert stop.stopped_step == 12 and stop.wait_count == 3
    assert [s for s, _ in stop.history] == [2, 4, 6, 8, 10, 12]
    assert stop.stop_reason == (
        "dflash: stopping at step 12: ddtree@8/live 3.30 < 0.9 x baseline 5.20 = 4.68"
        " for 3 reports in a row (steps 8-12)"
    )
    # the state travels in a real checkpoint under the callback's state key
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"][stop.state_key]
    resumed = TrailingBaselineStop(min_ratio=0.9, patience=3, grace_steps=4)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == stop.state_dict()


def test_trainer_projection_uses_max_steps():
    values = {s: -4.0 + math.log(100 * s) for s in (4, 6, 8, 10, 12)}  # as if steps were 100x larger
    # the fit over (step, value) is a=-4+log(100), b=1: at max_steps=40 it projects 4.29 < 4.68 -> stop at the
    # third report (patience 3)
    stop = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True)
    trainer = fit(stop, values, max_steps=40)
    assert trainer.global_step == 8 and "by max_steps=40 < 4.68" in stop.stop_reason
    assert stop.last_decision.projected == pytest.approx(-4.0 + math.log(4000))
    # no max_steps: the horizon is the trainer's estimate from max_epochs (1 epoch = 32 batches of 2)
    stop = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True)
    trainer = fit(stop, values, max_steps=-1, max_epochs=1)
    assert trainer.global_step == 8 and "by max_steps=32 < 4.68" in stop.stop_reason


def test_trainer_warn_action_trains_to_the_end():
    stop = TrailingBaselineStop(min_ratio=0.9, patience=2, action="warn", verbose=False)
    with pytest.warns(UserWarning, match="action='warn', not stopping"):
        trainer = fit(stop, {2: 1.0, 4: 1.0, 6: 1.0}, max_steps=10)
    assert trainer.global_step == 10 and stop.stopped_step == 0
    assert "ddtree@8/live 1.00 < 0.9 x baseline 5.20 = 4.68 for 3 reports" in stop.stop_reason


def test_a_second_fit_with_the_same_callback_starts_fresh():
    """The stop of the first fit (and a stop still pending on rank 0 when a multi-rank fit ended, which
    the next fit's first sync broadcast) stayed: the second fit, never trailing, reported "stopping at step 2"."""
    stop = TrailingBaselineStop(min_ratio=0.9, patience=1, verbose=False)
    source = ScriptedReports({2: 1.0})
    assert fit(stop, {}, source=source).global_step == 2 and stop.stopped_step == 2
    source.engine.state.decided = (0, stop.stop_reason)  # what rank 0 holds when training ends before the sync
    source.values = {4: 5.0}
    trainer = fit(stop, {}, source=source)
    assert trainer.global_step == 20 and (stop.stopped_step, stop.stop_reason, source.engine.state.decided) == (0, None, None)
    assert stop.history == [(4, 5.0)] and stop.wait_count == 0


class StopAt(pl.Callback):
    """Another callback (EarlyStopping, a Timer) that stops training at `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        trainer.should_stop = trainer.should_stop or trainer.global_step == self.step


def test_a_stop_decided_once_training_ends_anyway_claims_no_stop():
    """The report of the last snapshot is drained in on_train_end, after max_steps ended the fit; a report
    can also come after another callback stopped training. Deciding then said "stopping at step 10", set
    should_stop and stopped_step=10 (the demo drew "stopped at step 10"), though the stop stopped nothing."""
    stop = TrailingBaselineStop(min_ratio=0.9, patience=2, verbose=False)
    with pytest.warns(UserWarning, match=r"trailing the baseline at step 10 \(training ends anyway: max_steps=10 "
                                         r"reached, not stopping\): ddtree@8/live 1.00 < 0.9 x baseline"):
        trainer = fit(stop, {4: 1.0}, max_steps=10, at_end=1.0)
    assert trainer.global_step == 10 and not trainer.should_stop and stop.stopped_step == 0
    assert stop.history == [(4, 1.0), (10, 1.0)]
    stop = TrailingBaselineStop(min_ratio=0.9, patience=2, verbose=False)
    with pytest.warns(UserWarning, match=r"\(training ends anyway: trainer.should_stop is already set, not stopping\)"):
        trainer = fit(stop, {2: 1.0, 6: 1.0}, max_steps=10, more=[StopAt(6)])
    assert trainer.global_step == 6 and stop.stopped_step == 0


class RecordEachRank(pl.Callback):
    """Writes what each rank ended with to `folder/rank{N}.json` (forked ranks share no memory with the test)."""

    def __init__(self, folder: Path, stop: TrailingBaselineStop):
        self.folder, self.stop = folder, stop

    def on_fit_end(self, trainer, pl_module):
        out = {"step": trainer.global_step, "stopped": self.stop.stopped_step, "reason": self.stop.stop_reason}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def test_ddp_ranks_stop_together_at_the_next_sync(tmp_path):
    """Two forked CPU processes (gloo): only rank 0 sees reports; it decides at step 5, and both ranks stop at
    the next sync step (8) together, so neither waits forever for the other in a collective."""
    if torch.cuda.is_initialized():
        pytest.skip("Lightning refuses to fork once CUDA is initialized; CPU-only runs cover this test")
    stop = TrailingBaselineStop(min_ratio=0.9, patience=2, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_steps=20,
        callbacks=[ScriptedReports({2: 1.0, 5: 1.0}, sync_every_n_steps=4), stop, RecordEachRank(tmp_path, stop)],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(), tiny_loader())
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in results] == [8, 8] and [r["stopped"] for r in results] == [8, 8]
    for r in results:
        assert r["reason"].startswith("dflash: stopping at step 5: ddtree@8/live 1.00 < 0.9 x baseline 5.20")
