"""Reports made by hand, for the tests of the stop: one task, one method, the value given."""

from __future__ import annotations

from dflash_callbacks.scoring.report import EvalReport

BASE = 5.2  # baseline ddtree@8/live; with min_ratio=0.9 the threshold is 4.68


def make_report(value: float, step: int | None, method: str = "ddtree@8") -> EvalReport:
    return EvalReport(
        drafter="test",
        cache={"path": "x", "fingerprint": "f"},
        block_size=8,
        tasks={"t": {method: {"dense": value, "live": value, "curve": []}}},
        step=step,
    )
