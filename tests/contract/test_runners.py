import os
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.engine.run_folder import RunFolder, RunFolderBusy
from dflash_callbacks.watch.runs import Watcher
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences

from runs import DEADLINE, assert_clean, records, run_dir, run_dirs
from synthetic import build_world

SCORING = {"ddtree_budgets": [4], "device": "cpu"}
from suite_paths import SUPPORT

HERE = Path(__file__).resolve().parent  # this module: the script below imports its `fit`


def fit(world, tmp_path, cb, max_steps, ckpt_path=None, extra=()):
    torch.manual_seed(0)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=[cb, *extra],
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(extra), default_root_dir=tmp_path)
    data = DataLoader(CacheSequences(world.cache), batch_size=1, collate_fn=collate_sequences)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def rescore(world, folder, step):
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    return service.score_folder(folder / "snapshots" / f"step-{step:08d}")


def test_process_runner_scores_in_a_spawned_worker(tmp_path):
    world = build_world(tmp_path / "world")
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=3,
                             scoring=SCORING, runner="process", busy="queue", max_pending=4, keep_last=4,
                             dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc")
    fit(world, tmp_path, cb, max_steps=6)
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [3, 6]
    assert cb.baseline_report is not None and cb.errors == 0
    again = rescore(world, run_dir(tmp_path / "d"), 6)
    assert lines[1]["tasks"] == again.tasks and lines[1]["snapshot_id"] == again.snapshot_id
    assert_clean(tmp_path / "d", cb.reports)


def test_external_runner_with_watch(tmp_path):
    world = build_world(tmp_path / "world")
    dirpath = tmp_path / "d"
    dirpath.mkdir()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(dirpath), "--cache", str(world.cache),
         "--target", str(world.target), "--baseline", str(world.baseline), "--baseline-cache-dir", str(tmp_path / "bc"),
         "--budgets", "4", "--device", "cpu", "--poll-seconds", "0.2", "--idle-exit", "60"],
    )
    try:
        cb = DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline,
                                 every_n_train_steps=3, scoring=SCORING, runner="external", busy="queue",
                                 max_pending=4, keep_last=4, dirpath=dirpath, wait_timeout=DEADLINE)
        fit(world, tmp_path, cb, max_steps=6)
    finally:
        watcher.kill()
    lines, folder = records(dirpath), run_dir(dirpath)
    assert [r["step"] for r in lines] == [3, 6]
    assert (folder / "reports" / "step-00000006.json").is_file()
    assert cb.baseline_report is not None
    assert lines[0]["tasks"] == rescore(world, folder, 3).tasks
    assert_clean(dirpath, cb.reports)


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
    steps = [r["step"] for r in records(tmp_path / "d")]  # one run folder: the resume reopened it
    assert steps == [2, 4, 6, 8, 10]
    assert second.run_id == first.run_id
    assert [h["step"] for h in second.history] == [2, 4, 6, 8, 10]
    assert [r.step for r in second.reports] == [8, 10]
    assert_clean(tmp_path / "d")


def test_a_resume_whose_run_json_is_damaged_goes_on_in_its_folder_and_rewrites_it(tmp_path):
    world = build_world(tmp_path / "world")

    def callback():
        return DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=2, scoring=SCORING,
                                   dirpath=tmp_path / "d", verbose=False)

    first = callback()
    fit(world, tmp_path, first, max_steps=2, extra=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)])
    (run_dir(tmp_path / "d") / "run.json").write_text('{"run_id": "2026')  # torn by a full disk
    second = callback()
    fit(world, tmp_path, second, max_steps=4, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    about = RunFolder(run_dir(tmp_path / "d")).about()
    assert second.run_id == first.run_id == about["run_id"] and about["runner"] == "thread"
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4] and second.errors == 0
    assert_clean(tmp_path / "d")


def test_a_fresh_run_gets_a_fresh_folder_and_two_writers_are_refused(tmp_path):
    """Running the same script twice (no checkpoint) must not inherit the first run's numbers."""
    world = build_world(tmp_path / "world")

    def callback():
        return DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=2, scoring=SCORING,
                                   verbose=False)  # dirpath: the default, <default_root_dir>/dflash

    first, second = callback(), callback()
    fit(world, tmp_path, first, max_steps=4)
    fit(world, tmp_path, second, max_steps=4)
    runs = run_dirs(tmp_path / "dflash")
    assert [r.name for r in runs] == sorted([first.run_id, second.run_id]) and first.run_id != second.run_id
    for run in runs:  # each run scored its own steps 2 and 4; nothing was skipped as "already scored"
        assert [r.step for r in RunFolder(run).read_results().reports] == [2, 4]
        assert_clean(run)
    assert [r.step for r in second.reports] == [2, 4]

    held = RunFolder.reopen(tmp_path / "dflash", first.run_id)  # a second writer on the same run is refused
    try:
        with pytest.raises(RunFolderBusy, match=f"in use by pid {os.getpid()}"):
            RunFolder.reopen(tmp_path / "dflash", first.run_id)
    finally:
        held.unlock()


def test_a_resume_with_another_runner_is_scored_by_it(tmp_path):
    """A run scored by a thread, resumed with runner="external": run.json names the resume's
    runner (and baseline), so a watcher scores its snapshots instead of skipping the run."""
    world = build_world(tmp_path / "world")

    def callback(runner):
        return DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=2,
                                   scoring=SCORING, runner=runner, dirpath=tmp_path / "d",
                                   baseline_cache_dir=tmp_path / "bc", wait_timeout=60, verbose=False)

    first = callback("thread")
    fit(world, tmp_path, first, max_steps=2, extra=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)])
    spec = ServiceSpec(str(world.cache), str(world.target), str(world.baseline), SCORING, str(tmp_path / "bc"))
    watcher, done = Watcher(ScoringService(spec), tmp_path / "d", log=lambda line: None), threading.Event()

    def watch():
        while not done.wait(0.2):
            watcher.scan_once()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    second = callback("external")
    try:
        fit(world, tmp_path, second, max_steps=4, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    finally:
        done.set()
        thread.join()
    about = RunFolder(run_dir(tmp_path / "d")).about()
    assert second.run_id == first.run_id and (about["runner"], about["pid"]) == ("external", os.getpid())
    assert about["baseline"] == str(world.baseline.resolve())
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4] and second.errors == 0
    assert second.baseline_report is not None and [r.step for r in second.reports] == [4]
    assert_clean(tmp_path / "d", second.reports)


@pytest.mark.slow
def test_the_process_worker_never_runs_the_training_script_again(tmp_path):
    """A training script without an `if __name__ == "__main__":` guard: a multiprocessing
    spawn would run all of it again in the worker (a second training run there, and the
    real run's reports waiting for it to end). The worker imports only the package, with the
    script's import path (a pathlib.Path the script put there, which imports skip, failed every
    job: the path was not JSON)."""
    build_world(tmp_path / "world")
    script = tmp_path / "train.py"
    script.write_text(f"""
import os, sys
sys.path[:0] = [{str(SUPPORT)!r}, {str(HERE)!r}]
import pathlib
sys.path.append(pathlib.Path({str(tmp_path)!r}))
print("top level ran", flush=True)
from test_runners import fit
from synthetic import World
from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.model import DrafterConfig
import pathlib
root = pathlib.Path({str(tmp_path)!r})
world = World(DrafterConfig.from_file(root / "world" / "baseline"), root / "world" / "target", root / "world" / "cache",
              root / "world" / "baseline", None, None)
cb = DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=2, scoring={SCORING!r},
                         runner="process", dirpath=root / "d", verbose=False, wait_timeout={DEADLINE})
fit(world, root, cb, max_steps=2)
print("reports", [r.step for r in cb.reports], "errors", cb.errors, flush=True)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("top level ran") == 1 and "reports [2] errors 0" in out.stdout, out.stdout
    assert [r["step"] for r in records(tmp_path / "d")] == [2]
    assert_clean(tmp_path / "d")
