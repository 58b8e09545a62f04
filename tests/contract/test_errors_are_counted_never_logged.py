"""An error in the evaluation is counted and warned about, none of its numbers is logged, and it ends
training only with on_error="raise" (naming the step): a scorer that raises, a subscriber that raises, a
logger that breaks, a report in memory that is not strict JSON, float16 logits that overflow (in the
scoring service, the score CLI and the callback). Lightning's callback; the faults every adapter survives
are in test_faults_every_adapter.py."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from dflash_callbacks import save_drafter
from dflash_callbacks.callbacks.host import LightningHost
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.engine.eval_engine import EvalEngine
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.scorer import NonFiniteError
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.settings import EvalSettings

from runs import OnFirstReport, assert_clean, records, zero_task_files
from train_run import ScoredAt, SCORING, eval_cb, fit, shared_world, world_paths


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def test_scorer_raising_with_on_error_raise_stops_the_fit_naming_the_step(world, tmp_path):
    cache = shutil.copytree(world / "cache", tmp_path / "eval-cache")
    cb = eval_cb(world, tmp_path, cache=cache, on_error="raise")
    corrupt = OnFirstReport(cb, lambda: zero_task_files(cache))
    with pytest.raises(RuntimeError, match=r"^dflash: step (\d+) failed: CacheError") as info:
        fit(world, tmp_path, [cb, ScoredAt(cb, 2)], max_steps=40)
    failed = int(str(info.value).split()[2])
    assert failed > corrupt.at
    lines = records(tmp_path / "d")  # the good report and the error are both on disk
    assert lines[0]["step"] == corrupt.at and "tasks" in lines[0]
    assert lines[-1]["step"] == failed and "CacheError" in lines[-1]["error"]
    assert cb.engine.runner is None  # closed by on_exception
    assert_clean(tmp_path / "d", cb.reports)


def test_a_subscriber_that_raises_is_counted_and_training_goes_on(world, tmp_path):
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8)
    calls = []
    cb.subscribe(lambda report, baseline: 1 / 0)
    cb.subscribe(lambda report, baseline: calls.append(report.step))  # the next subscriber still gets it
    with pytest.warns(UserWarning, match=r"subscriber .* raised on step 2: ZeroDivisionError"):
        trainer = fit(world, tmp_path, [cb], max_steps=6)
    assert trainer.global_step == 6 and calls == [2, 4, 6] and cb.errors == 3
    assert_clean(tmp_path / "d", cb.reports)


def test_broken_wandb_logger_does_not_cost_the_csv_logger_its_numbers(world, tmp_path, monkeypatch):
    """The W&B run is finished once training has started (its service gone): every call on
    it raises. The CSV logger attached next to it still receives every dflash number."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_logger = WandbLogger(project="dflash-reliability", save_dir=str(tmp_path), offline=True)
    csv_logger = CSVLogger(tmp_path / "logs", name="run")
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8)

    class FinishWandb(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            wandb_logger.experiment.finish()

    try:
        with pytest.warns(UserWarning, match=r"dflash: logging step 2 to WandbLogger failed: UsageError"):
            trainer = fit(world, tmp_path, [FinishWandb(), cb], max_steps=6, logger=[wandb_logger, csv_logger])
    finally:
        wandb.finish()
    assert trainer.global_step == 6 and cb.errors == 3  # one per report it could not take
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [2, 4, 6]
    rows = {int(r["step"]): r for r in csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv"))))
            if r.get("dflash/vanilla/live/mean")}
    assert sorted(rows) == [2, 4, 6]
    for record in lines:
        logged = float(rows[record["step"]]["dflash/ddtree@4/live/mean"])
        assert logged == pytest.approx(record["mean"]["ddtree@4"]["live"])


def test_a_report_or_line_that_is_not_strict_json_is_an_error_line_dropped_never_retried(world, tmp_path):
    """A report in memory the strict reader would refuse (here NaN seconds) is an error line
    in results.jsonl, counted, and none of its numbers is logged; a line that is not JSON at
    all is dropped and counted, not held to fail every later append; good reports go on."""
    service = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), None, SCORING))
    good = service.score_folder(world / "baseline")
    good.step, good.snapshot_id = 2, "a" * 16
    bad = EvalReport.from_dict({**good.to_dict(), "step": 4, "snapshot_id": "b" * 16})
    bad.seconds = float("nan")
    later = EvalReport.from_dict({**good.to_dict(), "step": 6, "snapshot_id": "c" * 16})
    run, failures, seen = RunFolder.create(tmp_path / "d", "r"), [], []
    trainer = pl.Trainer(logger=False, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    engine = EvalEngine(EvalSettings(world / "cache", world / "target", scoring=SCORING, verbose=False))
    engine.host = engine.publisher.host = LightningHost(trainer)
    engine.publisher.fail = failures.append
    engine.publisher.start(run, [])
    engine.subscribe(lambda report, baseline: seen.append(report.step))
    engine.publisher.publish(bad, 1.0)
    assert not trainer.callback_metrics and seen == [] and failures == [
        "step 4: the report is refused, none of its numbers is logged: not a report: seconds is nan, not a finite number"]
    engine.publisher.record({"step": 5, "snapshot_id": "d" * 16, "error": "x", "seconds": float("inf")})
    assert "line of step 5 is not strict JSON" in failures[1] and engine.publisher.unsaved == []
    engine.publisher.publish(later, 1.0)
    lines = [json.loads(line) for line in run.results_path.read_text().splitlines()]
    assert [(r["step"], "error" in r) for r in lines] == [(4, True), (6, False)] and seen == [6] and len(failures) == 2
    assert lines[0]["error"] == failures[0] and lines[0]["snapshot_id"] == "b" * 16
    assert float(trainer.callback_metrics["dflash/vanilla/live/mean"]) == pytest.approx(later.value("vanilla/live"))
    assert_clean(tmp_path / "d")


def overflowing_drafter(world: Path, folder: Path) -> Path:
    """Finite weights that overflow float16 (final norm weights of 1e5 > 65504, its largest value)."""
    paths = world_paths(world)
    from safetensors.torch import load_file

    state = load_file(str(paths["baseline"] / "model.safetensors"))
    state["norm.weight"] = torch.full_like(state["norm.weight"], 1e5)
    return save_drafter(folder, paths["config"], state)


def test_float16_overflow_is_an_error_and_never_a_score(world, tmp_path):
    paths = world_paths(world)
    service = ScoringService(ServiceSpec(str(paths["cache"]), str(paths["target"]), None,
                                         {**SCORING, "dtype": "float16"}))
    with pytest.raises(NonFiniteError, match=r"task 'long': the drafter's logits are NaN or Inf at \d+ of"):
        service.score_folder(overflowing_drafter(world, tmp_path / "big"))
    same = ScoringService(ServiceSpec(str(paths["cache"]), str(paths["target"]), None, SCORING))
    assert same.score_folder(tmp_path / "big").mean  # float32 takes it: the error was the overflow


def test_the_score_cli_refuses_nan_weights_and_overflow(world, tmp_path, capsys):
    paths = world_paths(world)
    from safetensors.torch import load_file

    state = load_file(str(paths["baseline"] / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    nan = save_drafter(tmp_path / "nan", paths["config"], state)
    args = ["score", "--cache", str(paths["cache"]), "--target", str(paths["target"]), "--budgets", "4",
            "--device", "cpu"]
    assert cli_main([*args, "--drafter", str(nan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "NaN or Inf weights in fc.weight" in err and "Traceback" not in err
    assert cli_main([*args, "--drafter", str(overflowing_drafter(world, tmp_path / "big")), "--dtype", "float16"]) == 2
    assert "logits are NaN or Inf" in capsys.readouterr().err


def test_float16_overflow_in_the_callback_is_an_error_line_not_a_row(world, tmp_path):
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "dtype": "float16"})

    class Blow(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            with torch.no_grad():
                pl_module.drafter.norm.weight.fill_(1e5)

    with pytest.warns(UserWarning, match="logits are NaN or Inf"):
        fit(world, tmp_path, [Blow(), cb], max_steps=2)
    (line,) = records(tmp_path / "d")
    assert "tasks" not in line and "NonFiniteError" in line["error"] and cb.reports == []
