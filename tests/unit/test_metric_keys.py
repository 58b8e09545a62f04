"""The one key grammar (engine/metric_keys.py): the interval keys beside each run-level mean, and the means a
resume restores, on simulated reports (no model)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dflash_callbacks.engine.metric_keys import (
    is_mean_key, key, mean_keys, report_bounds, report_metrics, restored_means,
)
from dflash_callbacks.scoring.intervals import paired_comparison, report_intervals
from simulated_caches import report_of


def reports():
    rng = np.random.default_rng(0)
    base = report_of(np.minimum(rng.geometric(0.3, size=(6, 40)) - 1, 7), block_size=8, name="base")
    ours = report_of(np.minimum(rng.geometric(0.45, size=(6, 40)) - 1, 7), block_size=8, name="ours")
    with_intervals = lambda r: dataclasses.replace(r, intervals=report_intervals(r, resamples=200))  # noqa: E731
    return with_intervals(ours), with_intervals(base)


def test_the_logged_interval_keys_sit_beside_each_run_level_mean():
    """Ours' mean_lo and _hi, and with the paired comparison the baseline's own and the delta's and ratio's;
    none for a report written before intervals."""
    ours, base = reports()
    versus = paired_comparison(ours, base, resamples=200)
    keys = report_bounds("dflash", ours, base, versus)
    monitors = [f"vanilla/{agg}" for agg in ("dense", "live", "pooled")]
    assert set(keys) == {f"dflash/{kind}{monitor}/mean_{end}" for kind in ("", "baseline/", "delta/", "ratio/")
                         for monitor in monitors for end in ("lo", "hi")}
    for monitor in monitors:
        assert (keys[f"dflash/{monitor}/mean_lo"], keys[f"dflash/{monitor}/mean_hi"]) == ours.interval(monitor)
        assert (keys[f"dflash/baseline/{monitor}/mean_lo"], keys[f"dflash/baseline/{monitor}/mean_hi"]) == \
            base.interval(monitor)
        ratio = versus[monitor]["mean"].ratio
        assert (keys[f"dflash/ratio/{monitor}/mean_lo"], keys[f"dflash/ratio/{monitor}/mean_hi"]) == (ratio.lo, ratio.hi)
        assert keys[f"dflash/delta/{monitor}/mean_lo"] < ours.value(monitor) - base.value(monitor) \
            < keys[f"dflash/delta/{monitor}/mean_hi"]
    assert set(report_bounds("dflash", ours, base, None)) == {k for k in keys if k.count("/") == 3}
    older = dataclasses.replace(ours, intervals=None)
    assert report_bounds("dflash", older, base, versus) == {}


def test_every_mean_key_a_report_logs_is_named_and_restored_alike():
    """mean_keys names each run-level key a report with a baseline logs (the baseline's aside: is_mean_key),
    and a resume's history entry gives back the same keys with the same values."""
    ours, base = reports()
    versus = paired_comparison(ours, base, resamples=200)
    logged = report_metrics("p", ours, base, versus)
    means = {k: v for k, v in logged.items() if is_mean_key("p", k)}
    assert set(means) == {k for k in mean_keys("p", ours.methods, True) if "/baseline/" not in k}
    assert key("p", "vanilla", "live", "mean", "ratio") == "p/ratio/vanilla/live/mean"
    entry = {"step": 3, "mean": ours.mean, "intervals": ours.intervals["mean"],
             "versus": {m: {"delta": [c["mean"].delta.value, c["mean"].delta.lo, c["mean"].delta.hi],
                            "ratio": [c["mean"].ratio.value, c["mean"].ratio.lo, c["mean"].ratio.hi]}
                        for m, c in versus.items()}}
    restored = restored_means("p", entry, base)
    assert restored.keys() == {k for k in logged if k.endswith(("/mean", "/mean_lo", "/mean_hi"))}
    assert all(restored[k] == logged[k] for k in restored if "/ratio/" not in k or not k.endswith("/mean"))
