"""DrafterEvaluator: the engine in a plain PyTorch loop (one process, DDP, FSDP2), held to the same
guarantees as the Lightning callback: every report of the weights of its step, on disk before it is
logged, W&B rows of the loop's own never lost, every mistake listed before the first step, and the
faults (a failing scorer, NaN weights, an unwritable results file, a killed worker, SIGKILL and
resume) survived with nothing lost."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec

from fsdp1 import FullyShardedDataParallel  # FSDP1 needs an accelerator: a stand-in of its name
from loops import SCORING, DrafterModel, plain_fit, two_ranks
from runs import assert_clean, kill_after_reports, records, run_dir, unwritable_results_for_a_while, wait_until

from suite_paths import SCRIPTS  # noqa: E402
from train_run import write_cache  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from synthetic import build_world

    return build_world(tmp_path_factory.getbasetemp() / "loop-world")


def evaluator(world, tmp_path: Path, **kwargs) -> DrafterEvaluator:
    args = dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2, scoring=SCORING,
                dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False, busy="queue",
                max_pending=8, wait_timeout=300)
    return DrafterEvaluator(**{**args, **kwargs})


def zero_task_files(cache: Path) -> None:
    for file in cache.glob("*.safetensors"):
        file.write_bytes(b"\0" * file.stat().st_size)


def test_a_plain_loop_scores_each_step_as_score_does_and_logs_at_the_snapshots_step(world, tmp_path, monkeypatch):
    """The weights scored are those of the captured step (the optimizer pre-hook waits for the copy), every
    report goes to results.jsonl, to `log=` at the snapshot's step and to the active W&B run, whose own rows,
    logged with `step=`, are all kept."""
    import wandb

    from wandb_records import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    logged, weights = [], {}
    ev = evaluator(world, tmp_path, keep_last=10, log=lambda metrics, step: logged.append((step, dict(metrics))),
                   max_steps=10)
    run = wandb.init(project="dflash-loop", dir=str(tmp_path))
    try:
        def after(model, step):
            weights[step] = {k: v.detach().clone() for k, v in model.drafter.state_dict().items()}
            run.log({"train/loss_seen": float(step)}, step=step)  # the loop's own rows, at its own steps

        plain_fit(world, 10, ev, after_step=after)
    finally:
        wandb.finish()
    assert [r.step for r in ev.reports] == [2, 4, 6, 8, 10] and ev.errors == 0
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    for report in ev.reports:
        assert report.tasks == service.score(world.config, weights[report.step], step=report.step).tasks
    assert [step for step, _ in logged] == [2, 4, 6, 8, 10]
    for (step, metrics), report in zip(logged, ev.reports):
        assert metrics["dflash/ddtree@4/live/mean"] == pytest.approx(report.value("ddtree@4/live"))
        assert metrics["dflash/ratio/ddtree@4/live/mean"] == pytest.approx(
            report.value("ddtree@4/live") / ev.baseline_report.value("ddtree@4/live"))
    assert ev.metrics["dflash/step"] == 10.0
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6, 8, 10]

    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    history = read_run(folder)["history"]
    assert sorted(r["train/loss_seen"] for r in history if "train/loss_seen" in r) == [float(s) for s in range(1, 11)]
    ours = [r for r in history if "dflash/ddtree@4/live/mean" in r]
    assert [r["dflash/step"] for r in ours] == [2, 4, 6, 8, 10]  # each report in a row of its own
    assert all(any(k.startswith("dflash/live_table/") for k in r) for r in ours)
    assert_clean(tmp_path / "d", ev.reports)


def test_every_mistake_is_listed_before_the_first_step(world, tmp_path):
    model = DrafterModel(world.config, world.target)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ev = evaluator(world, tmp_path, cache=tmp_path / "no-cache")
    with pytest.raises(PreflightError) as info:
        ev.attach(model.drafter, other)
    message = str(info.value)
    assert re.search(r"the optimizer does not step \d+ of the drafter's trainable parameters \(fc.weight, "
                     r"hidden_norm.weight, layers.0.\S+ and \d+ more\): pass the optimizer", message)
    assert "cache:" in message and "no-cache" in message  # both problems, at once
    assert not (tmp_path / "d").exists()

    sharded = DrafterModel(world.config, world.target)
    sharded.drafter.layers[0] = FullyShardedDataParallel(sharded.drafter.layers[0])
    with pytest.raises(ValueError, match=r"attach\(drafter, optimizer\): the drafter's layers.0 is a "
                                         r"FullyShardedDataParallel, which is not supported: FSDP1"):
        evaluator(world, tmp_path).attach(sharded.drafter, torch.optim.AdamW(sharded.drafter.parameters()))

    ev = evaluator(world, tmp_path)
    with pytest.raises(RuntimeError, match=r"call DrafterEvaluator.attach\(drafter, optimizer\) before step\(\)"):
        ev.step(1)
    optimizer = torch.optim.AdamW(model.drafter.parameters())
    ev.attach(model.drafter, optimizer)
    ev.step(4)
    with pytest.raises(ValueError, match=r"step\(\) got step 3 after step 4: steps go forward"):
        ev.step(3)
    with pytest.warns(UserWarning, match=r"step\(6\): the optimizer has not stepped since step\(4\)"):
        ev.step(6)
    ev.close()
    with pytest.raises(TypeError, match=r"drafter_config must be a DrafterConfig, a config.json path or None; got int"):
        evaluator(world, tmp_path, drafter_config=3)
    with pytest.raises(TypeError, match=r"stop must be a TrailingBaselineStop"):
        evaluator(world, tmp_path, stop="ddtree@8/live")
    with pytest.raises(ValueError, match=r"TrailingBaselineStop monitors 'ddtree@8/live', but 'dflash' scores only "
                                         r"\['vanilla', 'ddtree@4'\]"):
        evaluator(world, tmp_path, stop=TrailingBaselineStop(monitor="ddtree@8/live"))


def test_a_scorer_failing_mid_run_is_an_error_line_and_training_goes_on(world, tmp_path):
    cache = shutil.copytree(world.cache, tmp_path / "eval-cache")
    ev = evaluator(world, tmp_path, cache=cache, busy="skip")  # the next snapshot only once this report is in
    ev.subscribe(lambda report, baseline: zero_task_files(cache))

    def first_report_scored(model, step):  # so that it is published while training goes on, whatever the load
        if step == 2:
            wait_until(lambda: not ev.engine.runner._outbox.empty(), what="the report of step 2")

    with pytest.warns(UserWarning, match=r"dflash: step \d+ failed: CacheError"):
        plain_fit(world, 10, ev, after_step=first_report_scored)
    lines = records(tmp_path / "d")
    good, bad = [r for r in lines if "tasks" in r], [r for r in lines if "error" in r]
    assert len(good) == 1 and bad and all("CacheError" in r["error"] for r in bad) and ev.errors == len(bad)
    assert_clean(tmp_path / "d", ev.reports)


def test_nan_weights_are_an_error_line_never_a_logged_number(world, tmp_path):
    logged = []
    ev = evaluator(world, tmp_path, log=lambda metrics, step: logged.append(step) if "dflash/step" in metrics else None)
    saved = {}

    def after(model, step):  # NaN while step 4's snapshot is taken, restored before the next update
        with torch.no_grad():
            if step == 3:
                saved["w"] = model.drafter.fc.weight[0, 0].item()
            if step == 4:
                model.drafter.fc.weight[0, 0] = saved["w"]

    def before(model, step):
        if step == 4:
            with torch.no_grad():
                model.drafter.fc.weight[0, 0] = float("nan")

    with pytest.warns(UserWarning, match=r"step 4 failed: NonFiniteError: step 4 holds NaN or Inf weights in fc\.weight"):
        plain_fit(world, 6, ev, before_step=before, after_step=after)
    assert [(r["step"], "error" in r) for r in records(tmp_path / "d")] == [(2, False), (4, True), (6, False)]
    assert logged == [2, 6] and ev.errors == 1
    assert_clean(tmp_path / "d", ev.reports)


def test_an_unwritable_results_file_holds_its_lines_and_writes_them_later(world, tmp_path):
    ev = evaluator(world, tmp_path)
    seen = unwritable_results_for_a_while(ev)
    with pytest.warns(UserWarning, match=r"appending to .*results.jsonl failed|can not open .*results.jsonl"):
        plain_fit(world, 10, ev)
    assert seen == [2, 4, 6, 8, 10] and ev.errors == 2
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6, 8, 10]
    assert_clean(tmp_path / "d", ev.reports)


def test_a_killed_scoring_worker_fails_its_step_and_a_new_worker_scores_the_next(world, tmp_path):
    slow = write_cache(world.target.parent, tmp_path / "slow-cache", [("slow", 300, 4)])
    ev = evaluator(world, tmp_path, cache=slow, baseline=None, runner="process", keep_last=2,
                   scoring={**SCORING, "anchors_per_forward": 1})
    killed = {}

    def kill(model, step):  # the loop waits here until the worker scoring step 2 is killed
        runner = ev.engine.runner
        if step != 2 or runner is None:
            return
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            proc = runner.scorer.process
            if proc is not None and proc.poll() is None and runner.run.list_snapshots():
                time.sleep(0.3)  # inside the slow task by now
                os.kill(proc.pid, signal.SIGKILL)
                killed["pid"] = proc.pid
            time.sleep(0.01)

    with pytest.warns(UserWarning, match=r"step 2 failed: RuntimeError: the scoring worker died \(exit code -9\)"):
        plain_fit(world, 4, ev, after_step=kill)
    assert [(r["step"], "error" in r) for r in records(tmp_path / "d")] == [(2, True), (4, False)]
    assert ev.errors == 1 and [r.step for r in ev.reports] == [4]
    assert_clean(tmp_path / "d", ev.reports)


def test_a_sigkilled_plain_loop_resumes_from_its_checkpoint_and_loses_nothing(world, tmp_path):
    """train_loop.py (checkpoint every 3 steps) is SIGKILLed once results.jsonl has 3 lines; the resume from
    the newest loadable checkpoint reopens the same run folder: nothing finished before the kill is lost or
    scored again, and a snapshot the killed run wrote but never scored is scored."""
    root = tmp_path / "run"
    base = [sys.executable, str(SCRIPTS / "train_loop.py"), "--world", str(world.target.parent), "--root", str(root),
            "--every", "2", "--no-baseline", "--busy", "queue"]
    kill_after_reports(base + ["--max-steps", "100000", "--ckpt-every", "3", "--step-sleep", "0.02"], root / "dflash",
                       tmp_path / "train.log")
    folder = run_dir(root / "dflash")
    before = [json.loads(line)["step"] for line in (folder / "results.jsonl").read_text().splitlines()]
    ckpts = sorted(root.glob("ckpt/step=*.pt"), key=lambda p: int(p.stem.split("=")[1]))
    ckpt = next(p for p in reversed(ckpts) if int(p.stem.split("=")[1]) < max(before))
    resumed_from = int(ckpt.stem.split("=")[1])
    end = max(before) + 4
    with open(tmp_path / "train.log", "a") as log:
        subprocess.run(base + ["--max-steps", str(end), "--resume", str(ckpt), "--record"], check=True, timeout=300,
                       stdout=log, stderr=subprocess.STDOUT)
    out = json.loads((root / "rank0.json").read_text())
    assert run_dir(root / "dflash") == folder and out["run_id"] == folder.name
    steps = [json.loads(line)["step"] for line in (folder / "results.jsonl").read_text().splitlines()]
    assert steps[: len(before)] == before and len(steps) == len(set(steps)) and steps[-1] == end
    assert set(out["reports"]).isdisjoint(before) and all(s > resumed_from or s % 2 == 0 for s in out["reports"])
    assert sorted(out["history"]) == sorted(steps)
    assert_clean(root / "dflash")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_score_on_rank0_alone_and_stop_together(world, tmp_path, parallel):
    """torchrun, 2 gloo processes: the drafter in DDP, or sharded per layer by FSDP2 `fully_shard` (the
    snapshot's gather is a collective on every rank). Rank 0 scores alone; every report is written once;
    `step()` returns True on both ranks at the same step; rank 1 holds rank 0's history and run id."""
    root = tmp_path / "run"
    r0, r1 = two_ranks(SCRIPTS / "train_loop.py",
                       ["--world", str(world.target.parent), "--max-steps", "200", "--every", "2", "--stop-min-ratio",
                        "10", "--stop-patience", "2", "--parallel", parallel],
                       root, port=29400 + os.getpid() % 500 + (7 if parallel == "fsdp2" else 0))
    assert r0["should_stop"] and r1["should_stop"] and r0["step"] == r1["step"] == r0["stopped_step"] == r1["stopped_step"] < 200
    assert r0["stop_reason"] == r1["stop_reason"] and r0["stop_reason"].startswith("dflash: stopping at step ")
    assert r1["reports"] == [] and r1["threads_on_rank1"] == [] and r0["reports"]
    assert r1["run_id"] == r0["run_id"] and set(r1["history"]) <= set(r0["history"])
    steps = [r["step"] for r in records(root / "dflash")]
    assert steps == sorted(set(steps)) == r0["reports"]
    assert_clean(root / "dflash")
