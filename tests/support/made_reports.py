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


def judged_by(policy):
    """A run of one stop, as the engine keeps it (the history of the reports published, the stop's state,
    which `policy` reads through `follow`): `judge(report, baseline, now, info, warn, versus=None)` publishes
    `report` (`versus`: its paired comparison on the monitor) and has the stop evaluate it; returns the reason
    when it stops training."""
    from dflash_callbacks.engine.results_line import versus_record
    from dflash_callbacks.engine.run_state import history_entry
    from dflash_callbacks.engine.stop import StopState

    run = {"history": [], "state": StopState()}
    policy.follow(lambda: (run["history"], run["state"]))

    def judge(report, baseline, now, info, warn, versus=None):
        step = now.step if report.step is None else int(report.step)
        compared = versus_record({policy.monitor: {"mean": versus}}, digits=None) if versus is not None else None
        entry = {**history_entry(report, compared), "step": step}
        run["history"] = sorted([h for h in run["history"] if h["step"] != step] + [entry], key=lambda h: h["step"])
        verdict = policy.evaluate(run["history"], baseline, now, run["state"], step=step)
        run["state"] = verdict.state
        for level, line in verdict.said:
            (info if level == "info" else warn)(line)
        return verdict.reason if verdict.should_stop else None

    return judge
