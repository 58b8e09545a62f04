"""API misuse is either accepted as meant or refused in one line that names the fix: a NumPy
integer is an integer (a step, max_steps); a stop threshold no tau can reach (above the most tau
can be at the block size) is refused before training; a stop given as its class is named as such."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_callbacks import DrafterEvalTrainerCallback, DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.scoring.service import PreflightError

from loops import SCORING, DrafterModel, hf_fit
from runs import records

from train_run import eval_cb, fit, shared_world, world_paths


@pytest.fixture(scope="module")
def world_root(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


@pytest.fixture(scope="module")
def world(world_root) -> SimpleNamespace:
    return SimpleNamespace(**world_paths(world_root))


def settings(world, tmp_path: Path, **kwargs) -> dict:
    return {**dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2, scoring=SCORING,
                   dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False), **kwargs}


# ---------------------------------------------------------------- NumPy integers


def test_a_plain_loop_takes_numpy_steps_and_max_steps(world, tmp_path):
    evaluator = DrafterEvaluator(**settings(world, tmp_path), max_steps=np.int64(4))
    model = DrafterModel(world.config, world.target)
    optimizer = torch.optim.AdamW(model.drafter.parameters())
    evaluator.attach(model.drafter, optimizer)
    for step in np.arange(1, 5):  # numpy.int64 steps, as `for step in np.arange(...)` gives them
        optimizer.step()
        assert evaluator.step(step) is False
    evaluator.close()
    assert evaluator.max_steps == 4 and type(evaluator.max_steps) is int and type(evaluator.last_step) is int
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4] and evaluator.errors == 0


def test_the_trainer_takes_max_steps_as_a_numpy_integer(world, tmp_path):
    callback = DrafterEvalTrainerCallback(**settings(world, tmp_path))
    hf_fit(world, tmp_path / "out", np.int64(4), [callback])
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4] and callback.errors == 0


# ---------------------------------------------------------------- a threshold no tau can reach


@pytest.mark.parametrize("threshold, words", [
    ({"min_ratio": 90}, r"TrailingBaselineStop\(min_ratio=90\): its threshold, 90 x the baseline's tau, is above 6, "
                        r"the most tau can be at block size 6 \(5 proposals \+ 1\), for any baseline, so it can never "
                        r"be reached; min_ratio is a share of the baseline's tau: e.g. min_ratio=0.9 for 90%"),
    ({"min_delta": 5.5}, r"TrailingBaselineStop\(min_delta=5.5\): its threshold, the baseline's tau \+ 5.5, is above 6, .* "
                         r"give a min_delta below 5, e.g. -0.5"),
], ids=["min_ratio", "min_delta"])
def test_a_threshold_above_the_most_tau_can_be_is_refused_before_training(world, tmp_path, threshold, words):
    with pytest.warns(UserWarning) if "min_ratio" in threshold else _nothing():
        stop = TrailingBaselineStop(monitor="ddtree@4/live", **threshold)
    model = DrafterModel(world.config, world.target)
    evaluator = DrafterEvaluator(**settings(world, tmp_path), stop=stop)
    with pytest.raises(PreflightError, match=words) as refused:
        evaluator.attach(model.drafter, torch.optim.AdamW(model.drafter.parameters()))
    assert len(str(refused.value).splitlines()) == 2 and not (tmp_path / "d").exists()


def test_a_threshold_above_the_most_tau_can_be_is_refused_by_lightning_whichever_setup_runs_first(world_root, tmp_path):
    for order in ("stop first", "eval first"):
        with pytest.warns(UserWarning, match="min_ratio=7"):
            stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=7)
        cb = eval_cb(world_root, tmp_path, baseline=world_paths(world_root)["baseline"])
        with pytest.raises(PreflightError, match=r"min_ratio=7\): its threshold, 7 x the baseline's tau, is above 6"):
            fit(world_root, tmp_path, [stop, cb] if order == "stop first" else [cb, stop], max_steps=2)
        assert not (tmp_path / "d").exists()


def test_a_threshold_above_the_most_tau_at_the_monitors_own_block_is_refused(world, tmp_path):
    """A stop on a `:bB` monitor is held to the most tau at block B, not at the run's: `vanilla:b2/live` with
    min_delta=1.5 needs 2.5 where block 2 reaches at most 2 (1 proposal + 1), refused like the same stop at
    the run's block (6); min_delta=0.5 there (1.5 <= 2) is within reach and taken."""
    stop = TrailingBaselineStop(monitor="vanilla:b2/live", min_delta=1.5)
    model = DrafterModel(world.config, world.target)
    evaluator = DrafterEvaluator(**settings(world, tmp_path, scoring={**SCORING, "block_sizes": [2]}), stop=stop)
    with pytest.raises(PreflightError, match=r"TrailingBaselineStop\(min_delta=1.5\): its threshold, the baseline's tau "
                                             r"\+ 1.5, is above 2, the most tau can be at block size 2 \(1 proposals "
                                             r"\+ 1\), .* give a min_delta below 1, e.g. -0.5") as refused:
        evaluator.attach(model.drafter, torch.optim.AdamW(model.drafter.parameters()))
    assert len(str(refused.value).splitlines()) == 2 and not (tmp_path / "d").exists()
    within = DrafterEvaluator(**settings(world, tmp_path, scoring={**SCORING, "block_sizes": [2]}),
                              stop=TrailingBaselineStop(monitor="vanilla:b2/live", min_delta=0.5, action="warn"))
    within.attach(model.drafter, torch.optim.AdamW(model.drafter.parameters()))
    within.close()


def test_a_threshold_within_reach_is_taken(world, tmp_path):
    with pytest.warns(UserWarning, match="min_ratio=5"):  # above 1: said, but a tau of 5 x 1.1 can be reached
        stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=5, action="warn")
    model = DrafterModel(world.config, world.target)
    evaluator = DrafterEvaluator(**settings(world, tmp_path), stop=stop)
    evaluator.attach(model.drafter, torch.optim.AdamW(model.drafter.parameters()))
    evaluator.close()


# ---------------------------------------------------------------- a stop given as its class


def test_a_stop_given_as_its_class_is_named_as_such(world, tmp_path):
    said = r"stop=TrailingBaselineStop is a class: give an instance, e.g. stop=TrailingBaselineStop\(monitor='ddtree@8/live'\)"
    with pytest.raises(TypeError, match=said):
        DrafterEvaluator(**settings(world, tmp_path), stop=TrailingBaselineStop)
    with pytest.raises(TypeError, match=said):
        DrafterEvalTrainerCallback(**settings(world, tmp_path), stop=TrailingBaselineStop)
    with pytest.raises(TypeError, match=r"stop must be a TrailingBaselineStop .* got \['type'\]"):
        DrafterEvaluator(**settings(world, tmp_path), stop=[TrailingBaselineStop])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
