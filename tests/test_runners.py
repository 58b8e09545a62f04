import subprocess
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.callbacks.eval_callback import read_results
from dflash_callbacks.callbacks.evaluator import Evaluator, EvaluatorSpec
from dflash_callbacks.training import CacheSequences, DFlashTrainingModule, collate_sequences

from synthetic import build_world

SCORING = {"ddtree_budgets": [4], "device": "cpu"}


def fit(world, tmp_path, cb, max_steps, ckpt_path=None, extra=()):
    torch.manual_seed(0)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=[cb, *extra],
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(extra), default_root_dir=tmp_path)
    data = DataLoader(CacheSequences(world.cache), batch_size=1, collate_fn=collate_sequences)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def rescore(world, run_dir, step):
    evaluator = Evaluator(EvaluatorSpec(str(world.cache), str(world.target), None, SCORING))
    return evaluator.score_folder(run_dir / "snapshots" / f"step-{step:08d}", step)


def test_process_runner_scores_in_a_spawned_worker(tmp_path):
    world = build_world(tmp_path / "world")
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=3,
                             scoring=SCORING, runner="process", busy="queue", max_pending=4, keep_last=4,
                             dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc")
    fit(world, tmp_path, cb, max_steps=6)
    records = read_results(tmp_path / "d" / "results.jsonl")
    assert [r["step"] for r in records] == [3, 6]
    assert cb.baseline_report is not None and cb.errors == 0
    assert records[1]["tasks"] == rescore(world, tmp_path / "d", 6).tasks


def test_external_runner_with_watch(tmp_path):
    world = build_world(tmp_path / "world")
    run_dir = tmp_path / "d"
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(run_dir), "--cache", str(world.cache),
         "--target", str(world.target), "--baseline", str(world.baseline), "--baseline-cache-dir", str(tmp_path / "bc"),
         "--budgets", "4", "--device", "cpu", "--poll-seconds", "0.2", "--idle-exit", "60"],
    )
    try:
        cb = DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline,
                                 every_n_train_steps=3, scoring=SCORING, runner="external", busy="queue",
                                 max_pending=4, keep_last=4, dirpath=run_dir, wait_timeout=120)
        fit(world, tmp_path, cb, max_steps=6)
    finally:
        watcher.kill()
    records = read_results(run_dir / "results.jsonl")
    assert [r["step"] for r in records] == [3, 6]
    assert (run_dir / "reports" / "step-00000006.json").is_file()
    assert cb.baseline_report is not None
    assert records[0]["tasks"] == rescore(world, run_dir, 3).tasks


def test_resume_restores_history_and_scores_no_step_twice(tmp_path):
    world = build_world(tmp_path / "world")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)

    def callback():
        return DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=2, scoring=SCORING,
                                   busy="queue", max_pending=8, dirpath=tmp_path / "d")

    first = callback()
    fit(world, tmp_path, first, max_steps=6, extra=[ckpt])
    assert [h["step"] for h in first.history] == [2, 4, 6]
    # resume from step 4: step 6 was scored after that checkpoint; it is not scored again
    second = callback()
    fit(world, tmp_path, second, max_steps=10, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt"),
        extra=[ModelCheckpoint(dirpath=tmp_path / "ckpt2")])
    steps = [r["step"] for r in read_results(tmp_path / "d" / "results.jsonl")]
    assert steps == [2, 4, 6, 8, 10]
    assert [h["step"] for h in second.history] == [2, 4, 6, 8, 10]
    assert [r.step for r in second.reports] == [8, 10]
