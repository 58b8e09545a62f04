import json
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dflash_callbacks.callbacks.eval_callback import DrafterEvalCallback
from dflash_callbacks.callbacks.host import LightningHost
from dflash_callbacks.engine.schedule import Schedule
from dflash_callbacks.engine.stop import Moment
from dflash_callbacks.callbacks.stopping import (
    TrailingBaselineStop,
    fit_projection,
    projected_value,
    validate_monitor,
)
from dflash_callbacks.scoring.report import EvalReport

BASE = 5.2  # baseline ddtree@8/live; with min_ratio=0.9 the threshold is 4.68


def make_report(value: float, step: int | None, method: str = "ddtree@8") -> EvalReport:
    return EvalReport(
        drafter="test",
        cache={"path": "x", "fingerprint": "f"},
        block_size=8,
        tasks={"t": {method: {"dense": value, "live": value, "curve": []}}},
        step=step,
    )


# ----- pure pieces ------------------------------------------------------------------------------------


def test_threshold_and_is_trailing_ratio_and_delta():
    ratio = TrailingBaselineStop(min_ratio=0.9)
    assert ratio.threshold(BASE) == pytest.approx(4.68)
    assert ratio.is_trailing(4.67, BASE) and not ratio.is_trailing(4.68, BASE) and not ratio.is_trailing(6.0, BASE)
    assert ratio.is_trailing(math.nan, BASE)
    delta = TrailingBaselineStop(min_delta=-0.5)
    assert delta.threshold(BASE) == pytest.approx(4.7)
    assert delta.is_trailing(4.69, BASE) and not delta.is_trailing(4.71, BASE)
    assert delta.describe_threshold(BASE) == "baseline 5.20 - 0.5 = 4.70"
    default = TrailingBaselineStop()
    assert default.min_ratio == 0.9 and default.min_delta is None
    assert default.is_trailing(4.67, BASE) and not default.is_trailing(4.68, BASE)


def test_trailing_for_patience_reports_stops():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3)
    two = cb.decide([(100, 3.0), (200, 3.1)], BASE)
    assert not two.stop and two.wait_count == 2 and "2/3" in two.reason
    three = cb.decide([(100, 3.0), (200, 3.1), (300, 3.2)], BASE)
    assert three.stop and three.wait_count == 3
    assert three.reason == "ddtree@8/live 3.20 < 0.9 x baseline 5.20 = 4.68 for 3 reports in a row (steps 100-300)"


def test_recovering_resets_the_count():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3)
    history = [(100, 3.0), (200, 3.1), (300, 5.0), (400, 3.2), (500, 3.3)]
    d = cb.decide(history, BASE)
    assert not d.stop and d.wait_count == 2
    d = cb.decide(history + [(600, 3.4)], BASE)
    assert d.stop and d.wait_count == 3 and "(steps 400-600)" in d.reason
    assert not cb.decide(history + [(600, 4.68)], BASE).stop  # equal to the threshold is not trailing
    # order of the history does not matter
    assert cb.decide(list(reversed(history + [(600, 3.4)])), BASE).stop


def test_grace_period_ignores_early_reports():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=2, grace_steps=300)
    early = [(100, 1.0), (200, 1.0)]
    d = cb.decide(early, BASE)
    assert not d.stop and d.wait_count == 0 and "grace_steps=300" in d.reason
    d = cb.decide(early + [(300, 1.0)], BASE)
    assert not d.stop and d.wait_count == 1
    assert cb.decide(early + [(300, 1.0), (400, 1.0)], BASE).stop


def test_min_delta_mode():
    cb = TrailingBaselineStop(min_delta=-0.5, patience=2)
    assert not cb.decide([(1, 4.75), (2, 4.71)], BASE).stop
    d = cb.decide([(1, 4.6), (2, 4.65)], BASE)
    assert d.stop and "< baseline 5.20 - 0.5 = 4.70 for 2 reports" in d.reason
    positive = TrailingBaselineStop(min_delta=0.25, patience=1)
    assert positive.decide([(1, 5.3)], BASE).stop  # must beat the baseline by 0.25
    assert not positive.decide([(1, 5.45)], BASE).stop


def test_fit_projection_recovers_a_log_curve():
    steps = [100, 200, 400, 800]
    values = [1.5 + 0.4 * math.log(s) for s in steps]
    a, b = fit_projection(steps, values)
    assert a == pytest.approx(1.5) and b == pytest.approx(0.4)
    assert projected_value(a, b, 5000) == pytest.approx(1.5 + 0.4 * math.log(5000))
    with pytest.raises(ValueError, match="positive"):
        fit_projection([0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="2 distinct"):
        fit_projection([5, 5], [1, 2])


def rising(a: float, b: float, steps=(400, 600, 800, 1000, 1200)) -> list[tuple[int, float]]:
    return [(s, a + b * math.log(s)) for s in steps]


def test_projection_catches_up_so_no_stop():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True)
    history = rising(-4.0, 1.0)  # 2.0 at 400 ... 3.09 at 1200; 4.52 at 5000, 5.21 at 10000
    assert cb.decide(history, BASE).stop is False  # horizon unknown and the curve rises
    far = cb.decide(history, BASE, max_steps=10_000)
    assert not far.stop and far.projected == pytest.approx(-4.0 + math.log(10_000))
    assert "reaches 5.21 by max_steps=10000 >= 4.68: not stopping" in far.reason


def test_projection_will_not_catch_up_so_stop():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True)
    history = rising(-4.0, 1.0)
    d = cb.decide(history, BASE, max_steps=5000)
    assert d.stop and d.projected == pytest.approx(-4.0 + math.log(5000))
    assert d.reason.endswith("projection a+b*log(step) reaches 4.52 by max_steps=5000 < 4.68")
    flat = cb.decide([(s, 3.0) for s in (400, 600, 800)], BASE)  # no horizon, but the curve does not rise
    assert flat.stop and "does not rise" in flat.reason


def test_projection_uses_only_the_last_window():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True, projection_window=3)
    # a steep early rise, then flat: the full history would project a catch-up, the window does not
    history = [(10, 0.5), (20, 2.0), (40, 3.0), (1000, 3.5), (1100, 3.5), (1200, 3.5)]
    assert TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True, projection_window=6).decide(
        history, BASE, max_steps=100_000
    ).stop is False
    assert cb.decide(history, BASE, max_steps=100_000).stop


def test_too_few_points_for_projection_does_not_stop():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=2, projection=True)
    d = cb.decide([(100, 1.0), (200, 1.0)], BASE, max_steps=1000)
    assert not d.stop and d.wait_count == 2 and "needs 3 reports" in d.reason and d.projected is None
    # non-finite values do not count as projection points (but still trail)
    d = cb.decide([(100, 1.0), (200, math.nan), (300, 1.0)], BASE, max_steps=1000)
    assert not d.stop and d.wait_count == 3 and "has 2" in d.reason
    assert cb.decide([(100, 1.0), (200, 1.0), (300, 1.0)], BASE, max_steps=1000).stop


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"monitor": "ddtree8/live"}, "vanilla, ddtree@N (node budget N >= 1) or top@K (width K >= 1); got 'ddtree8'"),
        ({"monitor": "ddtree@8"}, "METHOD/AGGREGATE"),
        ({"monitor": "top@0/live"}, "got 'top@0'"),
        ({"monitor": "vanilla/mean"}, "an aggregate is one of ['dense', 'live']; got 'mean'"),
        ({"min_ratio": 0.9, "min_delta": -0.5}, "not both"),
        ({"min_ratio": 0.0}, "`min_ratio` must be None or a finite number > 0"),
        ({"min_ratio": "0.9"}, "`min_ratio` must be None or a finite number > 0; got '0.9'"),
        ({"min_delta": math.inf}, "`min_delta` must be None or a finite number"),
        ({"patience": 0}, "`patience` must be an integer >= 1; got 0"),
        ({"patience": 2.0}, "`patience` must be an integer >= 1; got 2.0"),
        ({"grace_steps": -1}, "`grace_steps` must be an integer >= 0"),
        ({"projection": "false"}, "`projection` must be true or false; got 'false'"),
        ({"projection_window": 2}, "`projection_window` must be an integer >= 3"),
        ({"action": "halt"}, "`action` must be one of ['stop', 'warn']; got 'halt'"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        TrailingBaselineStop(**kwargs)
    assert message in str(err.value)


def test_valid_monitors():
    for monitor in ("vanilla/live", "vanilla/dense", "ddtree@8/live", "ddtree@128/dense", "top@4/live"):
        assert validate_monitor(monitor) == monitor


def test_state_dict_round_trip():
    cb = TrailingBaselineStop(monitor="top@4/dense", min_ratio=0.9, patience=3)
    cb.history = [(100, 3.0), (200, 3.1)]
    cb.wait_count, cb.stopped_step, cb.stop_reason = 2, 0, None
    state = cb.state_dict()
    assert json.loads(json.dumps(state)) == state  # primitives only
    assert state["history"] == [[100, 3.0], [200, 3.1]]
    restored = TrailingBaselineStop(monitor="top@4/dense", min_ratio=0.9, patience=3)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.history == cb.history and restored.wait_count == 2 and restored.state_dict() == state
    assert "top@4/dense" in cb.state_key and cb.state_key != TrailingBaselineStop().state_key


# ----- the hook, without a Trainer run ---------------------------------------------------------------


def say(text: str) -> None:
    warnings.warn(text, UserWarning)


def test_no_baseline_records_and_warns_once(tmp_path):
    cb = TrailingBaselineStop(min_ratio=0.9, patience=1)
    now = Moment(step=1, horizon=10)
    with pytest.warns(UserWarning, match="no baseline report"):
        assert cb.on_report(make_report(1.0, 1), None, now, print, say) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second report without a baseline warns no more
        assert cb.on_report(make_report(1.0, 2), None, now, print, say) is None
    assert cb.history == [(1, 1.0), (2, 1.0)] and cb.stop_reason is None
    reason = cb.on_report(make_report(1.0, 3), make_report(BASE, None), now, print, say)
    assert reason.startswith("dflash: stopping at step 3:")


def test_missing_monitor_names_what_exists():
    cb = TrailingBaselineStop(monitor="ddtree@16/live")
    with pytest.raises(RuntimeError, match=r"ddtree@16/live is not in this report; it holds the methods \['ddtree@8'\]"):
        cb.on_report(make_report(1.0, 1), make_report(BASE, None), Moment(step=1), print, say)


def test_defaults_without_a_threshold_is_ninety_percent_and_delta_alone_is_accepted():
    assert (TrailingBaselineStop().min_ratio, TrailingBaselineStop().min_delta) == (0.9, None)
    alone = TrailingBaselineStop(min_delta=-0.5)  # the YAML defect: this was refused as "not both"
    assert (alone.min_ratio, alone.min_delta) == (None, -0.5) and alone.threshold(BASE) == BASE - 0.5


# ----- real Trainer runs -----------------------------------------------------------------------------


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
        engine.reports.baseline = self.base
        for policy in engine.stops.policies:
            policy.load_history(engine.history)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.publish(trainer, self.values.get(trainer.global_step))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer, pl_module):
        pass

    def on_train_end(self, trainer, pl_module):
        self.engine.reports.closing = True
        self.publish(trainer, self.at_end)

    def _module(self, pl_module):
        return pl_module

    def publish(self, trainer, value: float | None) -> None:
        if value is None or trainer.global_rank != 0:
            return
        report = make_report(value, trainer.global_step)
        self.engine.state.add({"step": report.step, "mean": report.mean})
        self.engine.reports.notify(report, None)


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
    source.engine.stops.pending = (0, stop.stop_reason)  # what rank 0 holds when training ends before the sync
    source.values = {4: 5.0}
    trainer = fit(stop, {}, source=source)
    assert trainer.global_step == 20 and (stop.stopped_step, stop.stop_reason, source.engine.stops.pending) == (0, None, None)
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
