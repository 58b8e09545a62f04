"""Scale-out: real 2-process CPU runs over gloo, launched the way users launch them.

Both tests run `tests/scripts/train_run.py` as a subprocess. With `strategy="ddp"` (and
Lightning's ModelParallelStrategy for FSDP2) Lightning re-launches that script for rank 1,
so every rank is a fresh interpreter. We do not fork the pytest process (`ddp_fork`):
after the parent has used OpenMP, a forked child that runs torch with more than one
thread hangs in libgomp (Lightning only avoids it by setting one thread per process when
OMP_NUM_THREADS is unset), and pytest's process holds threads of earlier tests. A fresh
launch is slower (two interpreter start-ups) but cannot inherit either problem.

Each rank writes `rank{N}.json` (tests/scripts/train_run.py:Recorder) with what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from runs import assert_clean, records, run_dir

from suite_paths import SCRIPTS  # noqa: E402
from train_run import shared_world, write_cache  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def run_script(args: list, timeout: float = 300) -> None:
    """Run train_run.py in a session of its own; on a hang, kill it and the rank it launched."""
    cmd = [sys.executable, str(SCRIPTS / "train_run.py"), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-8000:]}"


def ranks(root: Path) -> list[dict]:
    out = []
    for r in (0, 1):
        path = root / f"rank{r}.json"
        assert path.is_file(), f"rank {r} did not finish fit (no {path.name})"
        out.append(json.loads(path.read_text()))
    return out


@pytest.mark.slow
def test_ddp_rank0_scores_alone_ranks_stop_together_and_a_failing_slow_scorer_does_not_hang(world, tmp_path):
    """Two DDP ranks, two eval callbacks on rank 0:
    - one scores the world's cache; TrailingBaselineStop(min_ratio=5) against the baseline
      can never be met (tau <= block size), so the second report asks to stop;
    - one scores a cache whose first task is slow (~300 drafter forwards, a second or more)
      and whose second task file goes bad once training has started (it passed the checks at
      setup): every scoring (the baseline's too) takes long and then raises."""
    bad = write_cache(world, tmp_path / "bad-cache", [("slow", 300, 4), ("broken", 20, 3)])
    root = tmp_path / "run"
    run_script(["--world", world, "--root", root, "--devices", 2, "--strategy", "ddp", "--max-steps", 400,
                "--every", 2, "--eval-cache", world / "cache", "--eval-cache", bad, "--anchors-per-forward", 1,
                "--stop-min-ratio", 5, "--stop-patience", 2, "--record",
                "--corrupt-at-start", bad / "broken.safetensors"])
    r0, r1 = ranks(root)
    assert r0["world_size"] == r1["world_size"] == 2 and r0["pid"] != r1["pid"]

    # both ranks stopped, at the same step, long before max_steps, for rank 0's reason
    assert r0["should_stop"] and r1["should_stop"]
    assert r0["global_step"] == r1["global_step"] == r0["stopped_step"] == r1["stopped_step"] < 400
    assert r0["stop_reason"] == r1["stop_reason"]
    assert r0["stop_reason"].startswith("dflash: stopping at step ") and "< 5 x baseline" in r0["stop_reason"]

    # only rank 0 snapshots and scores: rank 1 never held a runner, a scoring thread or a report
    assert r1["violations"] == [] and r1["steps_seen"] == r1["global_step"]
    assert all({k: e[k] for k in ("reports", "baseline", "runner", "max_pending")}
               == {"reports": [], "baseline": False, "runner": False, "max_pending": 0} for e in r1["evals"])
    # ... yet its state follows rank 0's at every sync (a checkpoint saved on either rank restores the same
    # counts); errors of the reports drained after the last step (in on_train_end) stay on rank 0
    assert [e["skipped"] for e in r1["evals"]] == [e["skipped"] for e in r0["evals"]]
    assert all(a["errors"] <= b["errors"] for a, b in zip(r1["evals"], r0["evals"]))
    good, failing = r0["evals"]
    assert good["reports"] and good["errors"] == 0 and good["baseline"]
    steps = [r["step"] for r in records(root / "dflash")]
    assert steps == sorted(set(steps)) == good["reports"], "each step once in results.jsonl"
    assert all(s % 2 == 0 or s == r0["global_step"] for s in steps)

    # the failing, slow scorer cost nothing but its error count: training never waited for it
    # (snapshots were skipped while it was busy) and both ranks finished
    assert failing["reports"] == [] and not failing["baseline"]
    assert failing["skipped"] >= 1
    errors = records(root / "dflash-1")
    assert errors and all("error" in e and "tasks" not in e for e in errors)
    assert all("CacheError" in e["error"] and "broken" in e["error"] for e in errors)
    assert failing["errors"] == len(errors) + 1  # + the baseline's failure, which has no step
    assert len({e["step"] for e in errors}) == len(errors)
    assert_clean(root / "dflash") and assert_clean(root / "dflash-1")


@pytest.mark.slow
def test_fsdp2_capture_gathers_the_full_state_on_rank0_and_the_callback_keeps_ranks_in_step(world, tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2 `fully_shard` of the drafter) on 2 CPU processes.

    `capture` is called on both ranks (the gather is a collective): rank 0 gets plain CPU
    tensors equal, bit for bit, to the published folder the drafter started from and, after
    5 optimizer steps, to the full tensors gathered parameter by parameter; rank 1 gets None.

    The eval callback runs in the same job, on a cache that takes a few seconds to score
    (one anchor per forward), so rank 0 skips snapshots while it is busy; the last step
    (11, odd) is captured at the end of training. Only rank 0 knows when it skips: every rank
    must follow its decision, or the gathers would pair up wrongly or hang."""
    root = tmp_path / "run"
    slow = write_cache(world, tmp_path / "slow-cache", [("slow", 900, 4)])  # ~3 s a report: skips under any load
    run_script(["--world", world, "--root", root, "--devices", 2, "--strategy", "fsdp2", "--max-steps", 11,
                "--every", 2, "--no-baseline", "--init-from-baseline", "--capture-check", 5, "--record",
                "--eval-cache", slow, "--anchors-per-forward", 1, "--busy", "skip"])
    r0, r1 = ranks(root)
    assert r0["capture"]["start"] == {"sharded": True, "none": False, "same_keys": True, "bitwise": True,
                                      "plain_cpu": True, "dtypes_match": True}
    assert r0["capture"]["step"] == {"sharded": True, "none": False, "same_keys": True, "bitwise": True,
                                     "changed": True}
    assert r1["capture"] == {"start": {"sharded": True, "none": True}, "step": {"sharded": True, "none": True}}

    assert r0["global_step"] == r1["global_step"] == 11 and r1["violations"] == []
    (cb,) = r0["evals"]
    assert cb["errors"] == 0 and cb["skipped"] >= 1 and cb["reports"][0] == 2 and cb["reports"][-1] == 11
    steps = [r["step"] for r in records(root / "dflash")]
    assert steps == cb["reports"] and len(set(steps)) == len(steps)
    assert_clean(root / "dflash")
    # the snapshot on disk has the published layout
    with safe_open(str(run_dir(root / "dflash") / "snapshots" / "step-00000011" / "model.safetensors"), "pt") as f, \
            safe_open(str(world / "baseline" / "model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        assert all(f.get_slice(k).get_shape() == g.get_slice(k).get_shape() for k in g.keys())


@pytest.mark.slow
def test_ddp_drafter_early_stopping_and_a_monitored_checkpoint_end_together_counting_each_report_once(world, tmp_path):
    """Two DDP ranks with DrafterEarlyStopping (patience 3, never improving) and ModelCheckpoint on a dflash key,
    and a validation loop after every batch. The means were in callback_metrics on rank 0 only: EarlyStopping
    (strict=False) hung rank 0 in a cross-rank reduce that rank 1 never joined, ModelCheckpoint saved on rank 0
    alone. Now both ranks see every report at the same batch, stop together at the fourth, and the run ends."""
    root = tmp_path / "run"
    run_script(["--world", world, "--root", root, "--devices", 2, "--strategy", "ddp", "--max-steps", 400,
                "--every", 2, "--no-baseline", "--early-stop-patience", 3, "--monitor-checkpoint", "--val-every", 1,
                "--record"], timeout=300)
    r0, r1 = ranks(root)
    assert r0["global_step"] == r1["global_step"] < 400 and r0["should_stop"] and r1["should_stop"]
    assert r0["report_steps_seen"] == r1["report_steps_seen"] and len(r0["report_steps_seen"]) == 4
    assert r0["early_stop"]["wait_count"] == r1["early_stop"]["wait_count"] == 3
    assert len(list((root / "best").glob("*.ckpt"))) == 1
    assert_clean(root / "dflash")
