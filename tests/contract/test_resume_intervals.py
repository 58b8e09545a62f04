"""A resume restores the last report's means with their intervals: right after it, before any new
report, every run-level mean the loop's metrics hold (ours, and once the baseline is in, the
baseline's, the delta and the ratio) has its `_lo` and `_hi`, finite, around it; for the plain loop
and for Lightning."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from dflash_callbacks import DrafterEvaluator

from loops import SCORING, plain_fit
from runs import wait_until

from train_run import eval_cb, fit, shared_world, world_paths


@pytest.fixture(scope="module")
def world_root(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def bracketing_problems(metrics: dict[str, float], name: str = "dflash") -> list[str]:
    """Every run-level mean with a number whose interval is missing, not finite, or not around it."""
    problems = []
    for key, value in metrics.items():
        if not key.endswith("/mean") or not key.startswith(f"{name}/") or math.isnan(value):
            continue
        lo, hi = metrics.get(f"{key}_lo", math.nan), metrics.get(f"{key}_hi", math.nan)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= value + 1e-9 and value <= hi + 1e-9):
            problems.append(f"{key} = {value} [{lo}, {hi}]")
    return problems


def kinds(metrics: dict[str, float]) -> set[str]:
    """Which means hold a number: ours, baseline, delta, ratio."""
    return {key.split("/")[1] if key.split("/")[1] in ("baseline", "delta", "ratio") else "ours"
            for key, value in metrics.items() if key.endswith("/mean") and not math.isnan(value)}


def test_a_resumed_plain_loop_shows_the_last_reports_intervals_before_any_new_report(world_root, tmp_path):
    world = SimpleNamespace(**world_paths(world_root))

    def evaluator() -> DrafterEvaluator:
        return DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2,
                                scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc",
                                verbose=False, wait_timeout=300)

    plain_fit(world, 4, evaluator(), ckpt_dir=tmp_path / "ckpt", ckpt_every=4)
    seen = {}
    resumed = evaluator()

    def look(model, step):
        if step == 5:  # the resume's first step: no snapshot, nothing new to publish
            seen["first"] = dict(resumed.metrics)
            def published() -> bool:  # a repeated step only publishes: the baseline, once scored
                resumed.step(5)
                return resumed.baseline_report is not None

            wait_until(published, what="the baseline's report")
            seen["with baseline"] = dict(resumed.metrics)

    plain_fit(world, 5, resumed, resume=tmp_path / "ckpt" / "step=4.pt", after_step=look)
    assert seen["first"]["dflash/step"] == seen["with baseline"]["dflash/step"] == 4  # no report since the resume
    assert kinds(seen["first"]) >= {"ours"} and not bracketing_problems(seen["first"])
    assert kinds(seen["with baseline"]) == {"ours", "baseline", "delta", "ratio"}
    assert not bracketing_problems(seen["with baseline"])


class Look(pl.Callback):
    """The callback metrics at the resume's first step (after the eval callback's hook), and again once the
    baseline's report is in (a repeated step only publishes)."""

    def __init__(self, cb):
        self.cb, self.seen = cb, {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == 5:
            self.seen["first"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
            def published() -> bool:  # the same step again: it publishes
                self.cb.on_train_batch_end(trainer, pl_module, None, None, 0)
                return self.cb.baseline_report is not None

            wait_until(published, what="the baseline's report")
            self.seen["with baseline"] = {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_a_resumed_lightning_fit_shows_the_last_reports_intervals_before_any_new_report(world_root, tmp_path):
    def callback():
        return eval_cb(world_root, tmp_path, baseline=world_paths(world_root)["baseline"],
                       baseline_cache_dir=tmp_path / "bc")

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, filename="{step}")
    fit(world_root, tmp_path, [callback(), ckpt], max_steps=4, enable_checkpointing=True)
    resumed = callback()
    look = Look(resumed)
    fit(world_root, tmp_path, [resumed, look], max_steps=5, ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    assert look.seen["first"]["dflash/step"] == 4
    assert kinds(look.seen["first"]) >= {"ours"} and not bracketing_problems(look.seen["first"])
    assert kinds(look.seen["with baseline"]) == {"ours", "baseline", "delta", "ratio"}
    assert not bracketing_problems(look.seen["with baseline"])
