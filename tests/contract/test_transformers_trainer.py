"""The transformers Trainer entry point (`dflash_callbacks.hf.DrafterEvalTrainerCallback`) holds what the
Lightning callback holds, on a real `Trainer` run (tests/support/loops.py `hf_fit`) of the synthetic world's drafter:
background scoring of the weights of each snapshot's step, the run folder, W&B through the Trainer's own
run, the stop, a resume through the Trainer's own checkpoint, and the faults of tests/test_reliability.py
and tests/test_trust.py (SIGKILL and resume, a failing scorer, NaN weights, an unwritable results file, a
killed scoring worker). Every run folder goes through the audit (runs.py)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import EarlyStoppingCallback, TrainerCallback

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.engine.runners import SnapshotOutcome
from dflash_callbacks.hf import DrafterEvalTrainerCallback
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec

from loops import SCORING, hf_fit, two_ranks
from runs import (assert_clean, kill_after_reports, reads_update_atime, records, run_dir, tear_as_a_kill_would,
                  unwritable_results_for_a_while)
from wandb_records import read_run

from suite_paths import SCRIPTS  # noqa: E402
from train_run import shared_world, world_paths, write_cache  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    path = shared_world(tmp_path_factory.getbasetemp() / "reliability-world")
    return SimpleNamespace(path=path, bc=path.parent / "hf-baselines", **world_paths(path))


def eval_cb(world, tmp_path: Path, **kwargs) -> DrafterEvalTrainerCallback:
    """The callback of these tests: every 2 steps, runs under tmp_path/d, no baseline unless given."""
    args = dict(cache=world.cache, target=world.target, every_n_steps=2, scoring=SCORING, dirpath=tmp_path / "d",
                baseline_cache_dir=world.bc, verbose=False, wait_timeout=300)
    args.update(kwargs)
    return DrafterEvalTrainerCallback(**args)


def unreachable_stop(patience: int) -> TrailingBaselineStop:
    with pytest.warns(UserWarning, match="must reach 10x the baseline"):
        return TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=10, patience=patience, verbose=False)


class Weights(TrainerCallback):
    """After ours in the callbacks: the drafter's weights at the end of every step."""

    def __init__(self):
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.at[state.global_step] = {k: v.detach().clone() for k, v in model.drafter.state_dict().items()}


class Settle(TrainerCallback):
    """After ours: at each step that took a snapshot, wait until its outcome is ready, so that its report
    is published at the next step (and a stop reaches training at a step known in advance)."""

    def __init__(self, cb: DrafterEvalTrainerCallback):
        self.cb = cb

    def on_step_end(self, args, state, control, **kwargs):
        runner = self.cb.engine.runner
        if runner is None or state.global_step not in runner.pending_steps():
            return
        deadline = time.time() + 120
        step = state.global_step
        while not any(isinstance(o, SnapshotOutcome) and o.step == step for o in list(runner._outbox.queue)):
            assert time.time() < deadline, f"step {state.global_step} was never scored"
            time.sleep(0.01)


class CountSteps(TrainerCallback):
    steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps += 1


def service(world) -> ScoringService:
    return ScoringService(ServiceSpec(str(world.cache), str(world.target), str(world.baseline), SCORING, str(world.bc)))


# ---------------------------------------------------------------- scoring in the background


def test_each_report_scores_the_weights_of_its_step_and_lands_in_the_run_folder(world, tmp_path):
    """7 steps, a snapshot every 2 and the last step's at the end: each report equals scoring the weights
    the drafter had at the end of its step; results.jsonl, run.json and `metrics` hold them."""
    cb = eval_cb(world, tmp_path, baseline=world.baseline, busy="queue", max_pending=8)
    weights = Weights()
    trainer, model = hf_fit(world, tmp_path / "out", 7, [cb, weights])
    assert trainer.state.global_step == 7 and cb.errors == 0
    assert [r.step for r in cb.reports] == [2, 4, 6, 7] == [h["step"] for h in cb.history]
    reference = service(world)
    for report in cb.reports:
        assert report.tasks == reference.score(world.config, weights.at[report.step], step=report.step).tasks
    assert cb.reports[0].tasks != cb.reports[-1].tasks  # training moved the weights
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6, 7]
    assert all("tasks" in r for r in records(tmp_path / "d"))
    about = RunFolder(run_dir(tmp_path / "d")).about()
    assert about["runner"] == "thread" and about["basis"]["methods"] == ["vanilla", "ddtree@4"]
    last, base = cb.reports[-1], cb.baseline_report
    assert cb.metrics["dflash/step"] == 7.0
    assert cb.metrics["dflash/ddtree@4/live/mean"] == pytest.approx(last.value("ddtree@4/live"))
    assert cb.metrics["dflash/ratio/vanilla/dense/mean"] == pytest.approx(
        last.value("vanilla/dense") / base.value("vanilla/dense"))
    assert cb.engine.runner is None and cb.run._lock_fd is None  # the run folder is released
    assert_clean(tmp_path / "d", cb.reports)


def test_the_last_snapshot_is_taken_before_the_trainer_loads_the_best_model(world, tmp_path):
    """EarlyStoppingCallback stops training in on_evaluate, after every on_step_end, and the Trainer then
    loads the best checkpoint (step 2, with greater_is_better on the loss) into the model: the last
    step's snapshot holds the weights of step 4, not those loaded."""
    cb = eval_cb(world, tmp_path, every_n_steps=20)  # no snapshot but the last step's
    weights = Weights()
    early = EarlyStoppingCallback(early_stopping_patience=1)
    trainer, model = hf_fit(world, tmp_path / "out", 20, [cb, weights, early], save_steps=2, eval_strategy="steps",
                            eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                            greater_is_better=True, label_names=["input_ids"])  # the evaluation computes the loss
    assert trainer.state.global_step == 4 and trainer.state.best_global_step == 2
    loaded = model.drafter.state_dict()
    assert all(torch.equal(loaded[k], weights.at[2][k]) for k in loaded)  # the best model was loaded
    assert [r.step for r in cb.reports] == [4]
    assert cb.reports[0].tasks == service(world).score(world.config, weights.at[4], step=4).tasks
    assert cb.reports[0].tasks != service(world).score(world.config, weights.at[2], step=2).tasks
    assert_clean(tmp_path / "d", cb.reports)


# ---------------------------------------------------------------- W&B through the Trainer's own run


def test_wandb_rows_land_in_the_trainers_run_beside_its_own(world, tmp_path, monkeypatch):
    """report_to="wandb": the Trainer's WandbCallback starts the run; our keys against `dflash/step`, the
    live table and the curves land in it, each report in a row of its own, and every row the Trainer
    logs (the loss at every step) is still there."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "dflash-hf")
    cb = eval_cb(world, tmp_path, baseline=world.baseline, every_n_steps=3, busy="queue", max_pending=8)
    try:
        trainer, _ = hf_fit(world, tmp_path / "out", 7, [cb], report_to="wandb", logging_steps=1)
    finally:
        wandb.finish()
    assert [r.step for r in cb.reports] == [3, 6, 7]
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_run(folder)
    losses = [r for r in run["history"] if "train/loss" in r]
    assert [r["train/global_step"] for r in losses] == list(range(1, 8))
    ours = [r for r in run["history"] if "dflash/ddtree@4/live/mean" in r]
    assert [r["dflash/step"] for r in ours] == [3, 6, 7]
    base = cb.baseline_report
    for row, report in zip(ours, cb.reports):
        for task in ("long", "short", "one_anchor", "mean"):
            value = report.value("ddtree@4/live", task)
            assert row[f"dflash/ddtree@4/live/{task}"] == pytest.approx(value)
            assert row[f"dflash/delta/ddtree@4/live/{task}"] == pytest.approx(value - base.value("ddtree@4/live", task))
        assert row["dflash/live_table/_type"] == "table-file"
        assert row["dflash/curve/ddtree@4_table/_type"] == "table-file"
    table = json.loads((folder / "files" / ours[-1]["dflash/live_table/path"]).read_text())
    assert [r[0] for r in table["data"]] == ["long", "short", "one_anchor", "mean"]
    assert run["metrics"]["dflash/ddtree@4/live/mean"].step_metric == "dflash/step"
    assert run["summary"]["dflash/ddtree@4/live/mean"] == {"max": pytest.approx(max(r.value("ddtree@4/live")
                                                                                    for r in cb.reports))}
    assert run["config"]["dflash"]["cache_fingerprint"] == cb.reports[0].cache["fingerprint"]
    assert run["config"]["max_steps"] == 7  # the Trainer's own config is there too
    assert_clean(tmp_path / "d", cb.reports)


# ---------------------------------------------------------------- the stop


def test_trailing_baseline_stop_stops_the_trainer_at_the_expected_step_with_its_reason(world, tmp_path):
    """min_ratio=10 can not be reached, patience 2: the reports of steps 2 and 4 trail; the second is
    published at step 5 (Settle), which sets control.should_training_stop; the last step's snapshot is
    still scored, and its report does not change the reason."""
    stop = unreachable_stop(patience=2)
    cb = eval_cb(world, tmp_path, baseline=world.baseline, stop=stop)
    trainer, _ = hf_fit(world, tmp_path / "out", 40, [cb, Settle(cb)])
    assert trainer.state.global_step == 5 and stop.stopped_step == 5 and cb.should_stop
    assert re.fullmatch(r"dflash: stopping at step 4: ddtree@4/live \d\.\d\d < 10 x baseline \d\.\d\d = \d+\.\d\d "
                        r"\(the ratio's 95% interval reaches \d\.\d\d\) for 2 reports in a row \(steps 2-4\)",
                        stop.stop_reason), stop.stop_reason
    assert cb.stop_reason == stop.stop_reason
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 5]
    assert_clean(tmp_path / "d", cb.reports)


# ---------------------------------------------------------------- resume through the Trainer's checkpoint


class AtStart(TrainerCallback):
    """After ours: what the callback and its stop hold when training (re)starts."""

    def __init__(self, cb: DrafterEvalTrainerCallback, stop: TrailingBaselineStop):
        self.cb, self.stop = cb, stop

    def on_train_begin(self, args, state, control, **kwargs):
        self.history = [h["step"] for h in self.cb.history]
        self.stop_steps, self.wait_count = [s for s, _ in self.stop.history], self.stop.wait_count
        self.metrics = dict(self.cb.metrics)


def test_a_resume_from_the_trainers_checkpoint_reopens_the_run_and_goes_on(world, tmp_path):
    """Run 1 (6 steps) saves checkpoint-3 holding the report of step 2; the reports of steps 4 and 6
    come after it. Run 2 resumes from checkpoint-3 (its state read from trainer_state.json): the same run
    folder, the history rebuilt from results.jsonl, steps 4 and 6 not scored again, the stop's count
    going on from the checkpoint's."""
    out = tmp_path / "out"
    stop = unreachable_stop(patience=100)
    first = eval_cb(world, tmp_path, baseline=world.baseline, stop=stop, dirpath=None)
    hf_fit(world, out, 6, [first, Settle(first)], save_steps=3)
    saved = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    entry = saved["stateful_callbacks"]["DrafterEvalTrainerCallback"]["attributes"]["resume_state"]
    assert entry["engine"]["run_id"] == first.run.path.name and [h["step"] for h in entry["engine"]["history"]] == [2]
    assert entry["engine"]["stops"][0]["wait_count"] == 1
    assert first.run.path.parent == out / "dflash"  # dirpath defaults to <output_dir>/<name>

    stop = unreachable_stop(patience=100)
    second = eval_cb(world, tmp_path, baseline=world.baseline, stop=stop, dirpath=None)
    at_start = AtStart(second, stop)
    trainer, _ = hf_fit(world, out, 10, [second, at_start, Settle(second)], save_steps=3,
                        resume=str(out / "checkpoint-3"))
    assert trainer.state.global_step == 10 and second.run.path == first.run.path
    assert at_start.history == at_start.stop_steps == [2, 4, 6] and at_start.wait_count == 1
    assert at_start.metrics["dflash/step"] == 6.0
    assert at_start.metrics["dflash/ddtree@4/live/mean"] == pytest.approx(first.reports[-1].value("ddtree@4/live"))
    assert [r.step for r in second.reports] == [8, 10]
    assert [r["step"] for r in records(out / "dflash")] == [2, 4, 6, 8, 10]
    assert [s for s, _ in stop.history] == [2, 4, 6, 8, 10] and stop.wait_count == 5 and stop.stopped_step == 0
    assert_clean(out / "dflash", first.reports + second.reports)


def test_two_callbacks_each_resume_their_own_run(world, tmp_path):
    """Two callbacks of this class (two names): trainer_state.json keeps a list of their states (and the
    Trainer appends to it at each save); a resume gives each the latest state of its name."""
    out = tmp_path / "out"
    def callback(name: str) -> DrafterEvalTrainerCallback:
        return eval_cb(world, tmp_path, name=name, dirpath=tmp_path / name, busy="queue", max_pending=8)

    firsts = [callback("a"), callback("b")]
    hf_fit(world, out, 6, firsts, save_steps=3)
    saved = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert isinstance(saved["stateful_callbacks"]["DrafterEvalTrainerCallback"], list)
    seconds = [callback("b"), callback("a")]
    hf_fit(world, out, 8, seconds, save_steps=3, resume=str(out / "checkpoint-6"))
    for first, second in zip(firsts, reversed(seconds)):
        assert second.run.path == first.run.path and [r.step for r in second.reports] == [8]
        assert [r["step"] for r in records(tmp_path / first.engine.name)] == [2, 4, 6, 8]
        assert_clean(tmp_path / first.engine.name, first.reports + second.reports)


def test_restoring_callbacks_by_recreating_them_is_refused_when_the_trainer_is_made(world, tmp_path):
    """restore_callback_states_from_checkpoint=True re-creates each stateful callback from its saved
    arguments: ours would come back with no cache, no target and no stop, so the Trainer is refused."""
    counter = CountSteps()
    with pytest.raises(ValueError, match=r"DrafterEvalTrainerCallback can not be re-created by TrainingArguments\("
                                         r"restore_callback_states_from_checkpoint=True\).*leave it False"):
        hf_fit(world, tmp_path / "out", 4, [eval_cb(world, tmp_path), counter],
               restore_callback_states_from_checkpoint=True)
    assert counter.steps == 0 and not (tmp_path / "d").exists()


def test_two_ranks_under_ddp_score_on_rank0_alone_and_stop_together(world, tmp_path):
    """torchrun, 2 gloo processes: the Trainer wraps the model in DDP. Rank 0 scores alone; every report is
    written once; the stop sets `should_training_stop` on both ranks at the same step; rank 1 holds rank 0's
    history and run id."""
    root = tmp_path / "run"
    r0, r1 = two_ranks(SCRIPTS / "train_hf.py",
                       ["--world", str(world.path), "--max-steps", "200", "--every", "2", "--stop-min-ratio", "10",
                        "--stop-patience", "2"],
                       root, port=29900 + os.getpid() % 90)
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["should_stop"] and r1["should_stop"] and r0["step"] == r1["step"] == r0["stopped_step"] == r1["stopped_step"] < 200
    assert r0["stop_reason"] == r1["stop_reason"] and r0["stop_reason"].startswith("dflash: stopping at step ")
    assert r1["reports"] == [] and r0["reports"] and r1["run_id"] == r0["run_id"]
    assert set(r1["history"]) <= set(r0["history"]) and r0["errors"] == r1["errors"] == 0
    steps = [r["step"] for r in records(root / "dflash")]
    assert steps == sorted(set(steps)) == r0["reports"]
    assert_clean(root / "dflash")


# ---------------------------------------------------------------- faults while training


def test_sigkilled_training_resumes_from_its_trainer_checkpoint_and_loses_nothing(world, tmp_path):
    """train_hf.py (a Trainer checkpoint every 3 steps) is SIGKILLed once results.jsonl has 3 lines; a
    torn last line and a half-written snapshot folder are left behind, as a kill in the middle of an
    append or of a snapshot write would. Resuming from the newest checkpoint that loads reopens the same
    run folder: every line parses, nothing finished before the kill is lost or rescored, and a snapshot
    the killed run wrote but never scored is scored."""
    root = tmp_path / "run"
    results_path = kill_after_reports(
        [sys.executable, str(SCRIPTS / "train_hf.py"), "--world", str(world.path), "--root", str(root),
         "--max-steps", "100000", "--every", "2", "--no-baseline", "--save-steps", "3", "--step-sleep", "0.02"],
        root / "dflash", tmp_path / "train.log")

    left = {step: RunFolder.snapshot_id(folder) for step, folder in RunFolder(results_path.parent).list_snapshots()}
    before = results_path.read_text()
    lines = before[: before.rfind("\n") + 1].splitlines()
    steps_before = [json.loads(line)["step"] for line in lines]
    stale = tear_as_a_kill_would(results_path)

    def loads(folder: Path) -> int | None:
        try:
            from safetensors.torch import load_file

            load_file(str(folder / "model.safetensors"))
            return json.loads((folder / "trainer_state.json").read_text())["global_step"]
        except Exception:
            return None

    ckpts = sorted(root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]), reverse=True)
    ckpt = next(p for p in ckpts if loads(p) is not None and loads(p) < max(steps_before))  # reports came after it
    resumed_from = loads(ckpt)
    max_steps = max(steps_before + [resumed_from]) + 4

    stop = TrailingBaselineStop(monitor="ddtree@4/live", verbose=False)
    cb = eval_cb(world, tmp_path, dirpath=root / "dflash", stop=stop)
    at_start = AtStart(cb, stop)
    with pytest.warns(UserWarning, match="ended in a torn line"):
        trainer, _ = hf_fit(world, root, max_steps, [cb, at_start], save_steps=3, resume=str(ckpt))
    assert trainer.state.global_step == max_steps and cb.run.path == results_path.parent
    # the stop's history was rebuilt from results.jsonl: it has the reports appended between the
    # checkpoint and the kill, not only those in the checkpoint
    assert at_start.stop_steps == sorted(steps_before) and any(step > resumed_from for step in at_start.stop_steps)

    text = results_path.read_text()
    assert text.startswith("".join(line + "\n" for line in lines)), "a line finished before the kill changed"
    parsed = [json.loads(line) for line in text.splitlines()]  # every line parses
    steps = [r["step"] for r in parsed]
    assert len(steps) == len(set(steps)) and 999998 not in steps
    new = [r.step for r in cb.reports]
    assert new and set(new).isdisjoint(steps_before) and new[-1] == max_steps
    # a report of a step before the checkpoint is the killed run's snapshot it left unscored, scored now
    assert all(r.step > resumed_from or r.snapshot_id == left.get(r.step) for r in cb.reports)
    assert sorted(steps) == sorted(steps_before + new)
    assert {h["step"] for h in cb.history} == set(steps)
    assert not stale.exists() and len(cb.run.list_snapshots()) <= 2
    assert_clean(root / "dflash", cb.reports)


def zero_task_files(cache: Path) -> None:
    for file in cache.glob("*.safetensors"):
        file.write_bytes(b"\0" * file.stat().st_size)


def test_a_scorer_failing_mid_run_is_counted_and_training_finishes(world, tmp_path):
    """The evaluation cache is zeroed once the first report is in: every later step is an error line."""
    cache = shutil.copytree(world.cache, tmp_path / "eval-cache")  # training reads the world's copy
    cb = eval_cb(world, tmp_path, cache=cache)
    first = []

    def corrupt(report, baseline):
        if not first:
            first.append(report.step)
            zero_task_files(cache)

    cb.subscribe(corrupt)
    with pytest.warns(UserWarning, match=r"dflash: step \d+ failed: CacheError: .*not a readable safetensors file"):
        trainer, _ = hf_fit(world, tmp_path / "out", 10, [cb])
    assert trainer.state.global_step == 10
    lines = records(tmp_path / "d")
    good, bad = [r for r in lines if "tasks" in r], [r for r in lines if "error" in r]
    assert [r["step"] for r in good] == first == [r.step for r in cb.reports]
    assert bad and all(r["step"] > first[0] and "CacheError" in r["error"] for r in bad)
    assert cb.errors == len(bad) and [h["step"] for h in cb.history] == first
    assert_clean(tmp_path / "d", cb.reports)


def test_nan_weights_at_one_step_are_an_error_line_and_never_a_logged_number(world, tmp_path):
    """At step 4 (after its optimizer step) one weight is NaN while the snapshot is taken, and restored
    right after: steps 2 and 6 are scored and logged, step 4 is an error line and only the error count."""

    class SetNaN(TrainerCallback):  # before ours
        saved = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 4:
                with torch.no_grad():
                    self.saved = model.drafter.fc.weight[0, 0].item()
                    model.drafter.fc.weight[0, 0] = float("nan")

    class Restore(TrainerCallback):  # after ours
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 4:
                with torch.no_grad():
                    model.drafter.fc.weight[0, 0] = nan.saved

    nan, logged = SetNaN(), []
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8, log=lambda metrics, step: logged.append((step, metrics)))
    with pytest.warns(UserWarning, match=r"step 4 failed: NonFiniteError: step 4 holds NaN or Inf weights in fc\.w"):
        trainer, model = hf_fit(world, tmp_path / "out", 6, [nan, cb, Restore()])
    assert trainer.state.global_step == 6 and torch.isfinite(model.drafter.fc.weight).all()
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [2, 4, 6]
    assert "NaN or Inf" in lines[1]["error"] and "tasks" not in lines[1]
    assert cb.errors == 1 and [h["step"] for h in cb.history] == [2, 6]
    assert [step for step, metrics in logged if "dflash/vanilla/live/mean" in metrics] == [2, 6]
    assert all(math.isfinite(v) for _, metrics in logged for v in metrics.values())
    assert any(metrics == {"dflash/errors": 1.0} for _, metrics in logged)
    assert_clean(tmp_path / "d", cb.reports)


def test_a_results_file_unwritable_for_a_while_costs_no_report(world, tmp_path):
    """After the first report a folder takes the place of results.jsonl (every append fails); after the
    third it is put back: each failure is counted, and the lines held in memory land once each, in order."""
    cb = eval_cb(world, tmp_path, busy="queue", max_pending=8)
    seen = unwritable_results_for_a_while(cb)
    with pytest.warns(UserWarning, match=r"appending to .*results.jsonl failed|can not open .*results.jsonl"):
        trainer, _ = hf_fit(world, tmp_path / "out", 10, [cb])
    assert trainer.state.global_step == 10 and seen == [2, 4, 6, 8, 10]
    assert cb.errors == 2  # the appends of steps 4 and 6
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6, 8, 10]
    assert_clean(tmp_path / "d", cb.reports)


def test_a_killed_scoring_worker_fails_its_step_and_a_new_worker_scores_the_next(world, tmp_path):
    """runner="process": SIGKILL the worker while it scores step 2, as soon as it has loaded the snapshot's
    weights (the file's atime moves past its mtime), with a cache that takes it a second or more to score.
    Step 2 is an error line, step 4 is scored by a new worker."""
    slow = write_cache(world.path, tmp_path / "slow-cache", [("slow", 300, 4)])
    cb = eval_cb(world, tmp_path, cache=slow, runner="process", busy="queue", max_pending=4, keep_last=2,
                 scoring={**SCORING, "anchors_per_forward": 1})

    class KillWorker(TrainerCallback):  # after ours: training waits here, no step 4 before the kill
        killed = scorer = None
        loaded = False

        def on_step_end(self, args, state, control, **kwargs):
            runner = cb.engine.runner
            if self.killed is not None or runner is None or runner.pending == 0:
                return
            deadline = time.time() + 240
            while time.time() < deadline:
                proc, snaps = runner.scorer.process, runner.run.list_snapshots()
                if proc is not None and proc.poll() is None and snaps:
                    weights = os.stat(snaps[-1][1] / "model.safetensors")
                    self.loaded = weights.st_atime_ns > weights.st_mtime_ns
                    if self.loaded or not precise:
                        os.kill(proc.pid, signal.SIGKILL)
                        self.killed, self.scorer = snaps[-1][0], runner.scorer
                        return
                time.sleep(0.005)
            raise AssertionError("the scoring worker never loaded the snapshot")

    precise = reads_update_atime(tmp_path)
    killer = KillWorker()
    with pytest.warns(UserWarning, match=r"step 2 failed: RuntimeError: the scoring worker died \(exit code -9\)"):
        hf_fit(world, tmp_path / "out", 4, [cb, killer])
    assert killer.killed == 2 and (killer.loaded or not precise)
    lines = records(tmp_path / "d")
    assert [r["step"] for r in lines] == [2, 4]
    assert "the scoring worker died (exit code -9)" in lines[0]["error"] and "tasks" in lines[1]
    assert cb.errors == 1 and [r.step for r in cb.reports] == [4]
    assert killer.scorer.restarts == 1 and not killer.scorer.process  # closed after the run
    assert_clean(tmp_path / "d", cb.reports)


# ---------------------------------------------------------------- bad input, before any step


def test_a_drafter_attribute_the_model_lacks_names_the_drafter_like_submodules(world, tmp_path):
    counter = CountSteps()
    with pytest.raises(AttributeError, match=re.escape(
            "DrafterEvalTrainerCallback(drafter='draft'): DrafterModel has no attribute 'draft'; pass the attribute "
            "path of the drafter (drafter-like submodules of DrafterModel: ['drafter'])")):
        hf_fit(world, tmp_path / "out", 4, [eval_cb(world, tmp_path, drafter="draft"), counter])
    assert counter.steps == 0 and not (tmp_path / "d").exists()


def test_every_preflight_problem_is_listed_at_once_before_any_step(world, tmp_path):
    """A truncated target weight file, a truncated baseline and a truncated cache task: one error, a line each."""
    damaged = {}
    for name in ("baseline", "target"):
        damaged[name] = shutil.copytree(getattr(world, name), tmp_path / f"damaged-{name}") / "model.safetensors"
        damaged[name].write_bytes(damaged[name].read_bytes()[:100])
    cache = shutil.copytree(world.cache, tmp_path / "truncated-cache")
    (cache / "long.safetensors").write_bytes((cache / "long.safetensors").read_bytes()[:-10])
    counter = CountSteps()
    cb = eval_cb(world, tmp_path, cache=cache, target=damaged["target"].parent, baseline=damaged["baseline"].parent)
    with pytest.raises(PreflightError) as info:
        hf_fit(world, tmp_path / "out", 4, [cb, counter])
    message = str(info.value)
    assert re.search(r"task 'long': file .* is \d+ bytes but the manifest says \d+: truncated", message), message
    assert re.search(rf"target: {re.escape(str(damaged['target']))} is not a readable safetensors file", message)
    assert re.search(rf"baseline .*{re.escape(str(damaged['baseline']))} is not", message), message
    assert counter.steps == 0 and not (tmp_path / "d").exists()
