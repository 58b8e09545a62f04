"""Logging to an offline W&B run changes nothing of the process's environment while it runs (the training
loop's threads, and W&B's own, read it): no variable is set, changed or removed, before, during or after
the reports. Where W&B keeps its copies of the tables is W&B's own setting (WANDB_DATA_DIR)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from dflash_callbacks import DrafterEvaluator

from loops import SCORING, plain_fit

from train_run import shared_world, world_paths


def test_logging_to_an_offline_run_leaves_the_environment_untouched(tmp_path_factory, tmp_path, monkeypatch):
    import wandb

    world = SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))
    data = tmp_path / "home-data"
    monkeypatch.setenv("WANDB_DATA_DIR", str(data / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(project="dflash-staging", dir=str(tmp_path / "wandb-runs"))
    before = dict(os.environ)
    during = []
    evaluator = DrafterEvaluator(world.cache, world.target, world.baseline, every_n_steps=2, scoring=SCORING,
                                 dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False,
                                 log=lambda metrics, step: during.append(dict(os.environ)))
    evaluator.subscribe(lambda report, baseline: during.append(dict(os.environ)))  # after W&B got the report
    plain_fit(world, 4, evaluator)
    run.finish()
    assert len(evaluator.reports) == 2 and len(during) == 4
    assert all(seen == before for seen in during) and dict(os.environ) == before
    assert wandb.env.get_data_dir() == str(data / "wandb")
