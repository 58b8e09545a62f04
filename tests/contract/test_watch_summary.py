"""The watchers say what they are scoring and end with a summary: `watch --checkpoints` and `watch
--dir` print a line when a checkpoint (a snapshot) starts scoring, and at exit the steps scored, the
errors, the last report's monitored number (every method's live tau without a stop) and the stop's
state."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from dflash_callbacks.cli import main
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.engine.snapshot import Snapshot
from dflash_callbacks.model import DFlashDrafter, save_drafter

from train_run import shared_world, world_paths


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    return SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))


def test_watch_checkpoints_says_each_checkpoint_it_scores_and_sums_up_at_exit(world, tmp_path, capsys):
    root = tmp_path / "ckpts"
    for step in (2, 4):
        save_drafter(root / f"checkpoint-{step}", world.config, DFlashDrafter(world.config).state_dict())
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")  # the Trainer's marker: complete
    (root / "checkpoint-6").mkdir()
    (root / "checkpoint-6" / "model.safetensors").write_bytes(b"not a checkpoint")
    (root / "checkpoint-6" / "trainer_state.json").write_text("{}")
    with pytest.warns(UserWarning, match="min_ratio=3"):
        code = main(["watch", "--checkpoints", str(root), "--cache", str(world.cache), "--target", str(world.target),
                     "--baseline", str(world.baseline), "--baseline-cache-dir", str(tmp_path / "bc"), "--budgets",
                     "4", "--device", "cpu", "--once", "--settle-seconds", "0", "--monitor", "ddtree@4/live",
                     "--min-ratio", "3", "--patience", "5"])
    out = capsys.readouterr().out
    assert code == 0
    for step in (2, 4, 6):
        assert f"watch: step {step}: scoring {root / f'checkpoint-{step}'}\n" in out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"watch: exiting: 2 step\(s\) scored, 1 error\(s\); the last report, step 4: ddtree@4/live "
                        r"\d\.\d\d \(the baseline's \d\.\d\d\); the stop: ddtree@4/live \d\.\d\d < 3 x baseline .*"
                        r"trailing 2/5 reports", last), last


def test_watch_dir_says_each_snapshot_it_scores_and_sums_up_at_exit(world, tmp_path, capsys):
    run = RunFolder.create(tmp_path / "runs", "run-a")
    for step in (3, 6):
        run.write_snapshot(Snapshot(step, 0, world.config, DFlashDrafter(world.config).state_dict()))
    run.unlock()
    assert main(["watch", "--dir", str(tmp_path / "runs"), "--cache", str(world.cache), "--target", str(world.target),
                 "--budgets", "4", "--device", "cpu", "--once"]) == 0
    out = capsys.readouterr().out
    for step in (3, 6):
        assert f"watch: run-a step {step}: scoring {run.snapshot_path(step)}\n" in out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"watch: exiting: 2 snapshot\(s\) scored, 0 failed; the last report: run-a step 6: live tau "
                        r"vanilla \d\.\d\d, ddtree@4 \d\.\d\d", last), last
