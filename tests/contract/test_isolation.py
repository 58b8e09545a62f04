"""Evaluation reads the training process and never writes to it: a seeded run ends with the same
weights, bit for bit, with and without evaluation attached, on every runner and entry point; the
true-precision modes (which set the process-wide default dtype around every training forward)
lose no report; the engine's state keys, bounds and failures hold across resumes.
(Scoring's own isolation, function by function, is in test_global_state.py.)"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences

from loops import SCORING, plain_fit
from runs import assert_clean, records


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from synthetic import build_world

    return build_world(tmp_path_factory.getbasetemp() / "isolation-world")


def lightning_fit(world, tmp_path: Path, callbacks: list, max_steps: int, **trainer_kwargs) -> pl.Trainer:
    """A seeded Lightning run with a shuffling loader that draws its order from the global RNG (as
    a user's does): anything else that draws from it changes the order, and so the weights."""
    pl.seed_everything(0, verbose=False)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    data = DataLoader(CacheSequences(world.cache), batch_size=1, shuffle=True, collate_fn=collate_sequences)
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         **{"enable_checkpointing": False, **trainer_kwargs})
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def eval_cb(world, tmp_path: Path, **kwargs) -> DrafterEvalCallback:
    args = dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=2,
                scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False,
                busy="queue", max_pending=4)
    return DrafterEvalCallback(**{**args, **kwargs})


@pytest.mark.parametrize("runner", ["thread", "process"])
def test_a_seeded_lightning_run_is_bit_identical_with_and_without_evaluation(world, tmp_path, runner):
    """Building the target head drew from the global RNG (its nn.Linear init), in the preflight and on the
    scoring thread, at a time that raced the training thread: the loader's shuffle order, and so every
    weight, changed once the callback was attached."""
    alone = lightning_fit(world, tmp_path / "alone", [], max_steps=12).lightning_module.drafter.state_dict()
    cb = eval_cb(world, tmp_path, runner=runner)
    trainer = lightning_fit(world, tmp_path / "with", [cb], max_steps=12)
    assert len(cb.history) >= 3 and cb.history[-1]["step"] == 12 and cb.errors == 0
    watched = trainer.lightning_module.drafter.state_dict()
    assert all(torch.equal(alone[k], watched[k]) for k in alone)
    assert_clean(tmp_path / "d", cb.reports)


def test_a_seeded_plain_loop_is_bit_identical_with_and_without_evaluation(world, tmp_path):
    alone = plain_fit(world, 12).drafter.state_dict()
    torch.manual_seed(0)
    evaluator = DrafterEvaluator(world.cache, world.target, world.baseline, every_n_steps=2, scoring=SCORING,
                                 dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False,
                                 busy="queue", max_pending=4)
    watched = plain_fit(world, 12, evaluator).drafter.state_dict()
    assert len(evaluator.history) >= 3 and evaluator.history[-1]["step"] == 12 and evaluator.errors == 0
    assert all(torch.equal(alone[k], watched[k]) for k in alone)
    assert_clean(tmp_path / "d", evaluator.reports)


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_true_precision_scores_every_report_as_score_does(world, tmp_path, precision):
    """Lightning's true-precision modes set the process-wide default dtype around every training forward:
    the scoring thread built its tensors in it, and 5 of 6 reports were error lines (`top_logprobs must be a
    float32 tensor ... got torch.bfloat16`), the baseline's too, so no stop could ever judge."""
    cb = eval_cb(world, tmp_path, keep_last=10)
    trainer = lightning_fit(world, tmp_path, [cb], max_steps=8, precision=precision)
    assert trainer.global_step == 8 and cb.errors == 0 and cb.baseline_report is not None
    assert [r.step for r in cb.reports] == [2, 4, 6, 8]
    dtype = {"bf16-true": torch.bfloat16, "64-true": torch.float64}[precision]
    assert trainer.lightning_module.drafter.fc.weight.dtype == dtype
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    for report in cb.reports:
        assert report.tasks == service.score_folder(cb.run.snapshot_path(report.step)).tasks
    assert isinstance(trainer.callback_metrics["dflash/ddtree@4/live/mean"], torch.Tensor)
    assert trainer.callback_metrics["dflash/ddtree@4/live/mean"].dtype == torch.float32
    assert_clean(tmp_path / "d", cb.reports)


# ---------------------------------------------------------------- state keys, bounds, failures


def ckpt_fit(world, tmp_path, callbacks, max_steps, ckpt_path=None, every=4):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=every, save_top_k=-1)
    return lightning_fit(world, tmp_path, [*callbacks, ckpt], max_steps, enable_checkpointing=True, ckpt_path=ckpt_path)


def test_a_resume_with_the_cache_path_spelled_otherwise_reopens_its_run_and_the_stop_goes_on(world, tmp_path,
                                                                                               monkeypatch):
    """The callback's checkpoint key held the cache path as written: a resume that spelled it otherwise
    (relative instead of absolute, or the cache moved) got no state back, opened a new run folder, and the
    stop's patience started over without a word."""
    stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=5, verbose=False)
    first = eval_cb(world, tmp_path, cache=Path(world.cache).resolve())
    ckpt_fit(world, tmp_path, [first, stop], max_steps=4)
    assert stop.wait_count == 2
    monkeypatch.chdir(Path(world.cache).parent)  # the same cache, now as a relative path
    again = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=5, verbose=False)
    second = eval_cb(world, tmp_path, cache=Path(Path(world.cache).name))
    ckpt_fit(world, tmp_path, [second, again], max_steps=6, ckpt_path=tmp_path / "ckpt" / "step=4.ckpt")
    assert second.run.path == first.run.path and len(list((tmp_path / "d").iterdir())) == 1
    assert [s for s, _ in again.history] == [2, 4, 6] and again.wait_count == 3
    assert_clean(tmp_path / "d")


def test_a_checkpoint_of_the_earlier_key_still_resumes(world, tmp_path):
    """A checkpoint written before the keys changed ({name, cache as written}; {monitor})."""
    stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=5, verbose=False)
    first = eval_cb(world, tmp_path)
    ckpt_fit(world, tmp_path, [first, stop], max_steps=4)
    path = tmp_path / "ckpt" / "step=4.ckpt"
    saved = torch.load(path, weights_only=False)
    states = saved["callbacks"]
    states[f"DrafterEvalCallback{{'name': 'dflash', 'cache': '{world.cache}'}}"] = states.pop(first.state_key)
    states["TrailingBaselineStop{'monitor': 'ddtree@4/live'}"] = states.pop(stop.state_key)
    torch.save(saved, path)
    again = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=5, verbose=False)
    second = eval_cb(world, tmp_path)
    ckpt_fit(world, tmp_path, [second, again], max_steps=6, ckpt_path=path)
    assert second.run.path == first.run.path and again.wait_count == 3
    assert_clean(tmp_path / "d")


def test_two_stops_following_two_eval_callbacks_have_two_keys(world, tmp_path):
    """Two eval callbacks, each followed by its own stop on the same monitor, were refused by Lightning:
    the stops shared one state key."""
    a, b = eval_cb(world, tmp_path / "a", name="a"), eval_cb(world, tmp_path / "b", name="b")
    stop_a = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=9, verbose=False, eval_callback="a")
    stop_b = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, patience=9, verbose=False, eval_callback="b")
    trainer = lightning_fit(world, tmp_path, [a, b, stop_a, stop_b], max_steps=4)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    states = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]
    assert stop_a.state_key != stop_b.state_key and {stop_a.state_key, stop_b.state_key} <= set(states)
    assert states[stop_a.state_key] == stop_a.state_dict() and states[stop_b.state_key] == stop_b.state_dict()
    assert [s for s, _ in stop_a.history] == [h["step"] for h in a.history] == [2, 4] == [s for s, _ in stop_b.history]


def test_keep_last_bounds_the_snapshots_from_the_start_of_a_resume(world, tmp_path):
    """A run with keep_last=3 resumed with keep_last=0 kept its 3 snapshots on disk for good."""
    first = eval_cb(world, tmp_path, keep_last=3)
    ckpt_fit(world, tmp_path, [first], max_steps=8)
    assert len(first.run.list_snapshots()) == 3
    second = eval_cb(world, tmp_path, keep_last=0)
    ckpt_fit(world, tmp_path, [second], max_steps=10, ckpt_path=tmp_path / "ckpt" / "step=8.ckpt")
    assert second.run.path == first.run.path and second.run.list_snapshots() == []
    third = eval_cb(world, tmp_path, keep_last=1)
    ckpt_fit(world, tmp_path, [third], max_steps=12, ckpt_path=tmp_path / "ckpt" / "step=8.ckpt")
    assert [step for step, _ in third.run.list_snapshots()] == [12]
    assert_clean(tmp_path / "d")


def test_the_staging_buffers_are_released_when_fit_ends_and_made_again_for_the_next(world, tmp_path):
    cb = eval_cb(world, tmp_path, max_pending=3)
    pools = []

    class Seen(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            pools.append(cb.engine.schedule.pool)

    lightning_fit(world, tmp_path, [cb, Seen()], max_steps=4)
    assert cb.engine.schedule.pool is None and cb.engine.schedule.staging is None
    lightning_fit(world, tmp_path, [cb, Seen()], max_steps=4)
    first, second = pools[0], pools[-1]
    assert first is not second and first.allocations == second.allocations == 3
    assert cb.engine.schedule.pool is None


def test_a_drafter_whose_state_dict_changes_gets_an_error_line_per_step_naming_the_keys(world, tmp_path):
    """A drafter that gains a tensor mid-run failed every later snapshot with a bare KeyError: 'extra', and
    those steps left no line in results.jsonl."""
    cb = eval_cb(world, tmp_path)

    class Grow(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3 and not hasattr(pl_module.drafter, "extra"):
                pl_module.drafter.register_buffer("extra", torch.zeros(1))

    with pytest.warns(UserWarning, match=r"step 4 failed: ValueError: the drafter's state dict changed since it was "
                                         r"checked before training \(added: \['extra'\]; missing: none\)"):
        lightning_fit(world, tmp_path, [Grow(), cb], max_steps=8)
    lines = sorted(records(tmp_path / "d"), key=lambda r: r["step"])
    assert [(r["step"], "error" in r) for r in lines] == [(2, False), (4, True), (6, True), (8, True)]
    assert all("added: ['extra']" in r["error"] for r in lines[1:]) and cb.errors == 3
    assert_clean(tmp_path / "d")
