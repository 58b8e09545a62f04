"""The intervals where the numbers appear while training: results.jsonl keeps each report's paired
comparison with the baseline, every logger and `callback_metrics` get `.../mean_lo` and `.../mean_hi`
beside each run-level mean, delta and ratio, W&B draws the bands, and TrailingBaselineStop counts a
report as trailing only when the whole ratio interval lies below `min_ratio` (`confidence=0.95`),
saying at setup when the cache is too small to ever resolve it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.scoring.intervals import interval_below, paired_comparison

from runs import assert_clean, records

from train_run import eval_cb, fit, shared_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def test_every_mean_delta_and_ratio_is_logged_with_its_interval(world, tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    import wandb
    from wandb_records import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    cb = eval_cb(world, tmp_path, baseline=world / "baseline", baseline_cache_dir=tmp_path / "bc", busy="queue",
                 max_pending=8)
    csv = CSVLogger(tmp_path / "logs", name="run")
    try:
        trainer = fit(world, tmp_path, [cb], max_steps=6,
                      logger=[WandbLogger(project="dflash-intervals", save_dir=str(tmp_path), offline=True), csv])
    finally:
        wandb.finish()
    assert [r.step for r in cb.reports] == [2, 4, 6]
    last, base = cb.reports[-1], cb.baseline_report
    versus = paired_comparison(last, base)["ddtree@4/live"]["mean"]
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert (metrics["dflash/ddtree@4/live/mean_lo"], metrics["dflash/ddtree@4/live/mean_hi"]) == pytest.approx(
        last.interval("ddtree@4/live"), rel=1e-6)
    assert (metrics["dflash/ratio/ddtree@4/live/mean_lo"], metrics["dflash/ratio/ddtree@4/live/mean_hi"]) == \
        pytest.approx((versus.ratio.lo, versus.ratio.hi), rel=1e-6)
    assert (metrics["dflash/baseline/ddtree@4/live/mean_lo"], metrics["dflash/baseline/ddtree@4/live/mean_hi"]) == \
        pytest.approx(base.interval("ddtree@4/live"), rel=1e-6)
    assert metrics["dflash/delta/ddtree@4/live/mean_lo"] <= metrics["dflash/delta/ddtree@4/live/mean"] <= \
        metrics["dflash/delta/ddtree@4/live/mean_hi"]
    line = records(tmp_path / "d")[-1]
    assert line["versus_baseline"]["ddtree@4/live"]["ratio"] == pytest.approx(
        [versus.ratio.value, versus.ratio.lo, versus.ratio.hi], abs=1e-6)
    assert line["versus_baseline"]["ddtree@4/live"]["verdict"] == versus.verdict

    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    history = [r for r in read_run(folder)["history"] if "dflash/ratio/ddtree@4/live/mean_hi" in r]
    assert [r["dflash/step"] for r in history] == [2, 4, 6]
    assert all(any(k.startswith("dflash/band/ddtree@4_table/") for k in r) for r in history)
    assert_clean(tmp_path / "d", cb.reports)


@pytest.mark.parametrize("confidence", [0.95, None])
def test_the_stop_counts_only_what_the_intervals_resolve(world, tmp_path, confidence):
    """The synthetic world's three tasks give wide intervals: a drafter whose point ratio is below min_ratio
    is trailing for `confidence=None` and, with the default, only where the whole ratio interval is below
    it; the setup warning says that three tasks can not resolve the threshold."""
    cb = eval_cb(world, tmp_path, baseline=world / "baseline", baseline_cache_dir=tmp_path / "bc", busy="queue",
                 max_pending=8)
    stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=0.999, patience=100, verbose=False,
                                confidence=confidence)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(world, tmp_path, [cb, stop], max_steps=6)
    warned = [str(w.message) for w in caught if "can not resolve min_ratio=0.999" in str(w.message)]
    assert len(warned) == (1 if confidence else 0)
    if confidence:
        assert warned[0].startswith("TrailingBaselineStop: the cache's 3 tasks can not resolve min_ratio=0.999 on "
                                    "ddtree@4/live") and "tasks would resolve it" in warned[0]
    base = cb.baseline_report
    expected = 0
    for report in cb.reports:
        point = report.value("ddtree@4/live") < 0.999 * base.value("ddtree@4/live")
        below = interval_below(paired_comparison(report, base)["ddtree@4/live"]["mean"], min_ratio=0.999)
        expected = expected + 1 if (point and (below or confidence is None)) else 0
    assert stop.wait_count == expected and (expected == 0) == (confidence is not None)  # the two rules part here
    assert sorted(stop.bounds) == [r.step for r in cb.reports]  # each report's upper end of the ratio's interval
    assert_clean(tmp_path / "d", cb.reports)
