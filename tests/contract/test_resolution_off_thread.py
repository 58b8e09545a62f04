"""The stop's setup warning (the cache is too small to resolve min_ratio) never blocks training: it is
worked out on the runner's thread, not the training thread, whatever the threshold (a threshold near 1
asked for millions of tasks, counted one at a time for 20 s on the training thread). How the number it
names is found: tests/unit/test_tasks_to_resolve.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.engine import publisher
from dflash_callbacks.scoring.report import EvalReport

from loops import SCORING, DrafterModel
from runs import DEADLINE

from train_run import shared_world, world_paths


def test_the_setup_warning_is_made_on_the_runners_thread(tmp_path_factory, tmp_path, monkeypatch):
    world = SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))
    made_on, original = [], publisher.resolution_warning

    def slow_warning(baseline: EvalReport, monitor: str, min_ratio: float) -> str | None:
        made_on.append(threading.current_thread().name)
        time.sleep(1.0)  # as long as counting tasks one at a time took
        return original(baseline, monitor, min_ratio)

    monkeypatch.setattr(publisher, "resolution_warning", slow_warning)
    stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=1 - 1e-9, action="warn", verbose=False)
    evaluator = DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=100,
                                 scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc",
                                 verbose=False, stop=stop)
    model = DrafterModel(world.config, world.target)
    optimizer = torch.optim.AdamW(model.drafter.parameters())
    evaluator.attach(model.drafter, optimizer)
    longest, step = 0.0, 0
    with pytest.warns(UserWarning, match=r"TrailingBaselineStop: the cache's 3 tasks can not resolve min_ratio=0.999999999 on "
                                         r"ddtree@4/live: .* about \d+ tasks would resolve it"):
        deadline = time.monotonic() + DEADLINE
        while evaluator.baseline_report is None and time.monotonic() < deadline:
            step += 1
            optimizer.step()
            started = time.perf_counter()
            evaluator.step(step)
            longest = max(longest, time.perf_counter() - started)
        evaluator.close()
    assert made_on == ["dflash-eval"] and longest < 0.5
