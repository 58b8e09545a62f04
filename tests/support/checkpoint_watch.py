"""Running `dflash-callbacks watch --checkpoints` in the tests: checkpoints of the synthetic world's drafter
as if training moved it, the watcher's command line, its reports read back and compared with `score`'s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.scoring.report import EvalReport

from runs import wait_until

SAME = ("tasks", "mean", "block_size", "drafter_block_size", "cache", "scoring")  # what `score` and `watch` share


def trained(world, step: int) -> dict[str, torch.Tensor]:
    """The world's drafter, moved as if `step` steps had trained it."""
    g = torch.Generator().manual_seed(step)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in world.drafter.state_dict().items()}


def watch_args(world, checkpoints: Path, *extra, baseline: bool = False) -> list[str]:
    """`watch --checkpoints` of the world's cache and target, one budget, on the CPU; with the baseline."""
    args = ["watch", "--checkpoints", str(checkpoints), "--cache", str(world.cache), "--target", str(world.target),
            "--budgets", "4", "--device", "cpu"]
    if baseline:
        args += ["--baseline", str(world.baseline), "--baseline-cache-dir", str(checkpoints.parent / "bc")]
    return args + [str(x) for x in extra]


def scored(world, folder: Path, tmp_path: Path, *extra) -> EvalReport:
    """`dflash-callbacks score` on `folder`, as a user runs it."""
    out = tmp_path / f"score-{folder.name}.json"
    assert cli_main(["score", "--drafter", str(folder), "--cache", str(world.cache), "--target", str(world.target),
                     "--budgets", "4", "--device", "cpu", "--json", str(out), *map(str, extra)]) == 0
    return EvalReport.load(out)


def results(out: Path) -> tuple[dict[int, EvalReport], dict[int, dict]]:
    """The watcher's reports and error lines in `out`, by step (none skipped, none twice)."""
    found = RunFolder(out).read_results()
    assert not found.skipped, found.skipped
    reports = {r.step: r for r in found.reports}
    assert len(reports) == len(found.reports), "a step reported twice"
    return reports, {e["step"]: e for e in found.errors}


def assert_same(ours: EvalReport, reference: EvalReport) -> None:
    """What `score` and `watch` share is equal."""
    a, b = ours.to_dict(), reference.to_dict()
    for key in SAME:
        assert a[key] == b[key], key


def spawn_watcher(args: list[str], log: Path) -> subprocess.Popen:
    """`dflash-callbacks ARGS` as a process (W&B offline), its output to `log`."""
    return subprocess.Popen([sys.executable, "-m", "dflash_callbacks.cli", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "WANDB_MODE": "offline"})


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Until `condition()` holds; fails with the end of the watcher's log when the watcher ends first or
    `timeout` s pass."""
    try:
        wait_until(lambda: proc.poll() is not None or condition(), timeout, "the watcher's progress")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}:\n{log.read_text()[-4000:]}") from None
    assert condition(), f"the watcher ended early:\n{log.read_text()[-4000:]}"
