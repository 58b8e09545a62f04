"""Files that fail under a running evaluation: a full disk (appends refused past RLIMIT_FSIZE), a regular
file where the snapshots folder goes (with every runner), the cache folder moved away, a results.jsonl line
that is JSON but not a report. Training goes on, each failure is an error line and counted, and no
finished evaluation is lost. (A results.jsonl that can not be written for a while, with every adapter:
contract/test_faults_every_adapter.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint


from runs import OnFirstReport, assert_clean, records
from train_run import ScoredAt, eval_cb, fit, shared_world, world_paths


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def test_a_failed_append_leaves_no_torn_line_and_is_written_once_the_disk_takes_it(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG), as a full disk does:
    the line is cut back whole, and appends go through again once there is room."""
    script = textwrap.dedent(f"""
        import json, resource, signal
        from dflash_callbacks.engine.run_folder import RunFolder, ResultsWriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        run = RunFolder.create({str(tmp_path)!r}, "r")
        run.append({{"step": 1, "error": "first"}})
        size = run.results_path.stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))
        try:
            run.append({{"step": 2, "error": "x" * 200}})
            print("appended")
        except ResultsWriteError as e:
            print("refused", run.results_path.stat().st_size == size, e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        run.append({{"step": 2, "error": "x" * 200}})
        print(json.dumps([json.loads(l)["step"] for l in run.results_path.read_text().splitlines()]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.strip().splitlines()
    assert first.startswith("refused True") and "File too large" in first
    assert json.loads(last) == [1, 2]


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
    lines = records(tmp_path / "d")
    bad = [r for r in lines if "error" in r]
    good = [r for r in lines if "tasks" in r]
    assert bad and all("writing the snapshot failed" in r["error"] for r in bad) and cb.errors == len(bad)
    assert good and min(r["step"] for r in good) > max(r["step"] for r in bad) and good[-1]["step"] == 12
    assert (cb.run.snapshot_path(12) / "model.safetensors").is_file()
    assert_clean(tmp_path / "d", cb.reports)


def test_a_snapshot_write_failure_with_the_external_runner_does_not_stop_later_snapshots(world, tmp_path):
    """The defect: one failed write left `pending` at 1 forever, so busy="skip" skipped every later snapshot."""
    paths = world_paths(world)
    dirpath = tmp_path / "d"
    dirpath.mkdir()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(dirpath), "--cache", str(paths["cache"]),
         "--target", str(paths["target"]), "--budgets", "4", "--device", "cpu", "--poll-seconds", "0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    cb = eval_cb(world, tmp_path, runner="external", keep_last=2)

    class BlockFirstWrite(pl.Callback):  # after cb: its run folder exists
        def on_train_start(self, trainer, pl_module):
            cb.run.snapshots_dir.write_text("a file where the folder goes")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cb.errors and cb.run.snapshots_dir.is_file():
                cb.run.snapshots_dir.unlink()

    try:
        with pytest.warns(UserWarning, match="writing the snapshot failed"):
            fit(world, tmp_path, [cb, BlockFirstWrite()], max_steps=10)
    finally:
        watcher.kill()
    lines = records(dirpath)
    assert "writing the snapshot failed" in lines[0]["error"]
    assert len(cb.reports) >= 2 and cb.reports[-1].step == 10
    assert_clean(dirpath, cb.reports)


def test_cache_folder_vanishing_mid_run_is_counted_and_training_goes_on(world, tmp_path):
    cache = shutil.copytree(world / "cache", tmp_path / "eval-cache")
    cb = eval_cb(world, tmp_path, cache=cache)
    moved = OnFirstReport(cb, lambda: cache.rename(tmp_path / "moved-away"))
    with pytest.warns(UserWarning, match=r"dflash: step \d+ failed: .*eval-cache"):
        trainer = fit(world, tmp_path, [cb, ScoredAt(cb, 2)], max_steps=10)
    assert trainer.global_step == 10 and not cache.exists()
    lines = records(tmp_path / "d")
    assert lines[0]["step"] == moved.at and "tasks" in lines[0]
    assert len(lines) > 1 and all("error" in r and str(cache) in r["error"] for r in lines[1:])
    assert cb.errors == len(lines) - 1
    assert_clean(tmp_path / "d", cb.reports)


def test_a_results_line_that_is_json_but_not_a_report_is_skipped_with_its_line_number(world, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = eval_cb(world, tmp_path)
    fit(world, tmp_path, [first, ckpt], max_steps=4, enable_checkpointing=True)
    with open(first.run.results_path, "a") as f:
        f.write("[1, 2]\n")
        f.write('{"step": "x", "tasks": {}}\n')
    second = eval_cb(world, tmp_path)
    with pytest.warns(UserWarning, match=r"results.jsonl line 3: not a report: a JSON object was expected"):
        trainer = fit(world, tmp_path, [second], max_steps=6, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt"))
    assert trainer.global_step == 6 and [h["step"] for h in second.history] == [2, 4, 6]
