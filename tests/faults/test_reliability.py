"""Reliability: faults while training runs, bad inputs before it starts, bounded resources.

Every fault is real: corrupted and missing cache files, a regular file where the snapshots
folder goes, a SIGKILLed scoring worker, NaN weights, a finished W&B run, a SIGKILLed
training process resumed from its checkpoint. The guarantee each time: training goes on
(or, with on_error="raise", stops with an error naming the step), the failure is counted
and recorded, and no finished evaluation is lost.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.callbacks.schema import CallbacksConfig, build_callbacks
from dflash_callbacks.config_files import CONF_DIR, load_config
from dflash_callbacks.scoring.service import PreflightError

from runs import assert_clean, records

from train_run import SCORING, eval_cb, fit, shared_world, world_paths  # noqa: E402

@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def results(tmp_path: Path, folder: str = "d") -> list[dict]:
    return records(tmp_path / folder)


class OnFirstReport:
    """Runs `action` once, on the training thread, when `cb`'s first report has been published."""

    def __init__(self, cb: DrafterEvalCallback, action):
        self.action, self.at = action, None
        cb.subscribe(self)

    def __call__(self, report, baseline):
        if self.at is None:
            self.at = report.step
            self.action()


def zero_task_files(cache: Path) -> None:
    for file in cache.glob("*.safetensors"):
        file.write_bytes(b"\0" * file.stat().st_size)


# ---------------------------------------------------------------- faults while training


def test_scorer_raising_with_on_error_raise_stops_the_fit_naming_the_step(world, tmp_path):
    cache = shutil.copytree(world / "cache", tmp_path / "eval-cache")
    cb = eval_cb(world, tmp_path, cache=cache, on_error="raise")
    corrupt = OnFirstReport(cb, lambda: zero_task_files(cache))
    with pytest.raises(RuntimeError, match=r"^dflash: step (\d+) failed: CacheError") as info:
        fit(world, tmp_path, [cb], max_steps=40)
    failed = int(str(info.value).split()[2])
    assert failed > corrupt.at
    records = results(tmp_path)  # the good report and the error are both on disk
    assert records[0]["step"] == corrupt.at and "tasks" in records[0]
    assert records[-1]["step"] == failed and "CacheError" in records[-1]["error"]
    assert cb.engine.runner is None  # closed by on_exception
    assert_clean(tmp_path / "d", cb.reports)


@pytest.mark.parametrize("runner", ["thread", "process"])
def test_snapshot_write_failure_is_counted_and_training_goes_on(world, tmp_path, runner):
    """A regular file where the snapshots folder goes: writes fail until it is removed
    (the external runner's case is in test_trust.py)."""
    cb = eval_cb(world, tmp_path, keep_last=2, runner=runner)

    class Block(pl.Callback):  # after cb in trainer.callbacks: its run folder exists by then
        def on_train_start(self, trainer, pl_module):
            self.blocker = cb.run.snapshots_dir
            self.blocker.write_text("not a folder")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cb.errors and self.blocker.is_file():
                self.blocker.unlink()

    with pytest.warns(UserWarning, match=r"dflash: step 2 failed: RuntimeError: writing the snapshot failed: "
                                         r"FileExistsError"):
        trainer = fit(world, tmp_path, [cb, Block()], max_steps=12)
    assert trainer.global_step == 12
    lines = results(tmp_path)
    bad = [r for r in lines if "error" in r]
    good = [r for r in lines if "tasks" in r]
    assert bad and all("writing the snapshot failed" in r["error"] for r in bad) and cb.errors == len(bad)
    assert good and min(r["step"] for r in good) > max(r["step"] for r in bad) and good[-1]["step"] == 12
    assert (cb.run.snapshot_path(12) / "model.safetensors").is_file()
    assert_clean(tmp_path / "d", cb.reports)


def test_cache_folder_vanishing_mid_run_is_counted_and_training_goes_on(world, tmp_path):
    cache = shutil.copytree(world / "cache", tmp_path / "eval-cache")
    cb = eval_cb(world, tmp_path, cache=cache)
    moved = OnFirstReport(cb, lambda: cache.rename(tmp_path / "moved-away"))
    with pytest.warns(UserWarning, match=r"dflash: step \d+ failed: .*eval-cache"):
        trainer = fit(world, tmp_path, [cb], max_steps=10)
    assert trainer.global_step == 10 and not cache.exists()
    lines = results(tmp_path)
    assert lines[0]["step"] == moved.at and "tasks" in lines[0]
    assert len(lines) > 1 and all("error" in r and str(cache) in r["error"] for r in lines[1:])
    assert cb.errors == len(lines) - 1
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
    lines = results(tmp_path)
    assert [r["step"] for r in lines] == [2, 4, 6]
    rows = {int(r["step"]): r for r in csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv"))))
            if r.get("dflash/vanilla/live/mean")}
    assert sorted(rows) == [2, 4, 6]
    for record in lines:
        logged = float(rows[record["step"]]["dflash/ddtree@4/live/mean"])
        assert logged == pytest.approx(record["mean"]["ddtree@4"]["live"])


# ---------------------------------------------------------------- bad inputs, before training


class CountBatches(pl.Callback):
    batches = 0

    def on_train_batch_start(self, *args):
        self.batches += 1


def edit_manifest(manifest: dict, how: str) -> None:
    if how == "wrong type":
        manifest["tasks"][0]["prompt_len"] = "5"
    elif how == "missing field":
        del manifest["layer_ids"]
    elif how == "unknown version":
        manifest["version"] = 99


@pytest.mark.parametrize("how,message", [
    ("wrong type", r"tasks\[0\]: field 'prompt_len' must be int, got str"),
    ("missing field", r"manifest.json: missing field 'layer_ids'"),
    ("unknown version", r"cache format version 99 is not supported"),
])
def test_bad_manifest_is_refused_before_training(world, tmp_path, how, message):
    cache = shutil.copytree(world / "cache", tmp_path / "cache")
    manifest = json.loads((cache / "manifest.json").read_text())
    edit_manifest(manifest, how)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    counter = CountBatches()
    with pytest.raises(PreflightError, match=message):
        fit(world, tmp_path, [eval_cb(world, tmp_path, cache=cache), counter], max_steps=4)
    assert counter.batches == 0 and not (tmp_path / "d").exists()


@pytest.mark.parametrize("override,message", [
    ("eval.bogus=1", r"override 'eval.bogus=1': Key 'bogus' not in 'EvalConfig'"),
    ("eval.scoring.ddtree_budgets=[4,0]", r"ddtree_budgets must be a list of integers >= 1; got 0 in \[4, 0\]"),
    ("eval.scoring.anchors_per_forward=0", r"anchors_per_forward must be an integer >= 1; got 0"),
    ("eval.every_n_train_steps=0", r"every_n_train_steps must be an integer >= 1; got 0"),
    ("eval.keep_last=-1", r"keep_last must be an integer >= 0; got -1"),
    ("stop.patience=0", r"`patience` must be an integer >= 1; got 0"),
    ("stop.min_ratio=0", r"`min_ratio` must be None or a finite number > 0; got 0"),
    ("stop.min_delta=-0.5", None),  # alone, from YAML: min_ratio defaults to null (defect: it was refused)
])
def test_bad_config_is_refused_before_a_trainer_exists(world, tmp_path, override, message):
    """load_config refuses unknown keys and wrong types (naming the override) and ScoringConfig's
    impossible values; the callbacks' own checks refuse the rest when they are built."""
    paths = world_paths(world)
    path = tmp_path / "run.yaml"
    path.write_text((CONF_DIR / "callbacks.yaml").read_text())
    overrides = [f"eval.cache={paths['cache']}", f"eval.target={paths['target']}", override]
    if message is None:
        stop = build_callbacks(load_config(CallbacksConfig, path, overrides))[1]
        assert (stop.min_ratio, stop.min_delta) == (None, -0.5)
        return
    with pytest.raises(ValueError, match=message):
        build_callbacks(load_config(CallbacksConfig, path, overrides))


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("eval:\n  cache: /c\n  target: /t\n  every_n_train_step: 5\n")
    with pytest.raises(ValueError, match=r"config key 'eval.every_n_train_step' in .*run\.yaml: Key 'every_n_train_step' not in"):
        load_config(CallbacksConfig, path)


def test_block_size_beyond_the_longest_completion_is_refused_before_training(world, tmp_path):
    """The rule: a block drafts B-1 tokens, so the longest completion (tokens after the
    prompt) must hold B tokens, else the deepest depths have no label anywhere. The world's
    longest completion is 35 tokens ('long': 40 tokens, prompt 5)."""
    counter = CountBatches()
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "block_size": 36})
    with pytest.raises(ValueError, match=r"block size 36 is larger than the cache .* allows: a block drafts 35 "
                                         r"tokens, but the longest completion \('long', 35 tokens\) has labels for "
                                         r"at most 34; use a block size <= 35"):
        fit(world, tmp_path, [cb, counter], max_steps=2)
    assert counter.batches == 0
    # only the tasks that are scored count: 'short' (22 tokens after a 3-token prompt) holds 22
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "block_size": 23, "tasks": ["short", "one_anchor"]})
    with pytest.raises(ValueError, match=r"block size 23 .* \('short', 22 tokens\)"):
        fit(world, tmp_path, [cb], max_steps=2)
    # at the limit it trains (scores nothing: every_n_train_steps=1000, no final snapshot)
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "block_size": 35}, every_n_train_steps=1000, wait_on_end=False)
    assert fit(world, tmp_path, [cb], max_steps=1).global_step == 1


# ---------------------------------------------------------------- bounded resources


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
    steps = [r["step"] for r in results(tmp_path)]
    assert 30 <= len(steps) + cb.skipped <= 31 and steps[-1] == 60  # 60 may be skipped, then taken at the end
