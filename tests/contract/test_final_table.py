"""The end of a run, as the demo ends: `close()` of the plain loop, the Trainer's on_train_end and Lightning's print
the last report's table per task against the baseline, with a verdict per method (the one function
the demo prints it with); `verbose=False` silences it, and a loop that raised prints none."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_callbacks import DrafterEvalTrainerCallback, DrafterEvaluator
from dflash_callbacks.engine.results_line import final_table

from loops import SCORING, hf_fit, plain_fit

from train_run import eval_cb, fit, shared_world, world_paths


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    return SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))


def settings(world, tmp_path: Path, **kwargs) -> dict:
    return dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2, scoring=SCORING,
                dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", **kwargs)


SAID_BY = ("dflash_callbacks", "lightning.pytorch.utilities.rank_zero")  # the loop's and Trainer's lines, Lightning's


def tables(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in SAID_BY and "| **mean** |" in r.getMessage()]


def assert_the_demos_table(said: list[str], view) -> None:
    (table,) = said
    assert table == final_table(view.reports, view.baseline_report)
    assert table.startswith("\nlive tau (tokens per target forward, 1 to 6; higher is better), block size 6, step 4;")
    assert re.search(r"\nddtree@4 live: \d+% \[\d+%, \d+%\] of the baseline, (behind|ahead of|not distinguishable from) it", table)
    assert max(r.step for r in view.reports) == 4


def test_the_plain_loops_close_prints_the_last_reports_table_and_verdict(world, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_callbacks")
    evaluator = DrafterEvaluator(**settings(world, tmp_path))
    plain_fit(world, 4, evaluator)
    assert_the_demos_table(tables(caplog), evaluator)


def test_the_trainers_end_prints_the_last_reports_table_and_verdict(world, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_callbacks")
    callback = DrafterEvalTrainerCallback(**settings(world, tmp_path))
    hf_fit(world, tmp_path / "out", 4, [callback])
    assert_the_demos_table(tables(caplog), callback)


def test_lightnings_end_prints_the_last_reports_table_and_verdict(world, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")  # rank_zero_info's
    root = world.cache.parent
    callback = eval_cb(root, tmp_path, baseline=world.baseline, baseline_cache_dir=tmp_path / "bc", verbose=True)
    fit(root, tmp_path, [callback], max_steps=4)
    assert_the_demos_table(tables(caplog), callback)


def test_verbose_false_or_a_loop_that_raised_prints_no_table(world, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_callbacks")
    quiet = DrafterEvaluator(**settings(world, tmp_path, verbose=False))
    plain_fit(world, 4, quiet)
    assert quiet.reports and not tables(caplog)

    def fail(model, step):
        if step == 4:
            raise RuntimeError("the loop failed")

    failed = DrafterEvaluator(**settings(world, tmp_path / "failed", busy="queue", max_pending=4))
    with pytest.raises(RuntimeError), pytest.warns(UserWarning):
        plain_fit(world, 4, failed, after_step=fail)
    assert not tables(caplog)
