"""The transformers Trainer entry point (`dflash_callbacks.hf.DrafterEvalTrainerCallback`) holds what the
Lightning callback holds, on a real `Trainer` run (tests/support/loops.py `hf_fit`) of the synthetic world's
drafter: background scoring of the weights of each snapshot's step, the run folder, W&B through the Trainer's
own run, the stop, a resume through the Trainer's own checkpoint, two ranks under DDP, every mistake before
the first step. The faults every adapter survives are in test_faults_every_adapter.py. Every run folder goes
through the audit (runs.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import EarlyStoppingCallback, TrainerCallback

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.engine.runners.jobs import SnapshotOutcome
from dflash_callbacks.hf import DrafterEvalTrainerCallback
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec

from loops import SCORING, hf_fit, two_ranks
from runs import assert_clean, records, run_dir, wait_until
from suite_paths import SCRIPTS
from train_run import shared_world, world_paths
from wandb_records import read_run


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
    with pytest.warns(UserWarning, match="must reach 5x the baseline"):
        return TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=patience, verbose=False)


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
        step = state.global_step
        wait_until(lambda: any(isinstance(o, SnapshotOutcome) and o.step == step for o in list(runner._outbox.queue)),
                   what=f"the report of step {step}")


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
    """min_ratio=5 can not be reached, patience 2: the reports of steps 2 and 4 trail; the second is
    published at step 5 (Settle), which sets control.should_training_stop; the last step's snapshot is
    still scored, and its report does not change the reason."""
    stop = unreachable_stop(patience=2)
    cb = eval_cb(world, tmp_path, baseline=world.baseline, stop=stop)
    trainer, _ = hf_fit(world, tmp_path / "out", 40, [cb, Settle(cb)])
    assert trainer.state.global_step == 5 and stop.stopped_step == 5 and cb.should_stop
    assert re.fullmatch(r"dflash: stopping at step 4: ddtree@4/live \d\.\d\d < 5 x baseline \d\.\d\d = \d+\.\d\d "
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


@pytest.mark.slow
def test_two_ranks_under_ddp_score_on_rank0_alone_and_stop_together(world, tmp_path):
    """torchrun, 2 gloo processes: the Trainer wraps the model in DDP. Rank 0 scores alone; every report is
    written once; the stop sets `should_training_stop` on both ranks at the same step; rank 1 holds rank 0's
    history and run id."""
    root = tmp_path / "run"
    r0, r1 = two_ranks(SCRIPTS / "train_hf.py",
                       ["--world", str(world.path), "--max-steps", "200", "--every", "2", "--stop-min-ratio", "5",
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
