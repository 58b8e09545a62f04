"""TrailingBaselineStop's rule without a training run: the threshold, patience, grace, the projection, the
monitor's validation, its state, its hook. (In real Lightning runs: tests/contract/test_stop_in_lightning.py.)"""

import json
import math
import warnings

import pytest

from dflash_callbacks.callbacks.stopping import TrailingBaselineStop
from dflash_callbacks.engine.stop import fit_projection, projected_value, validate_monitor
from dflash_callbacks.engine.stop import Moment, StopState

from made_reports import BASE, judged_by, make_report


# ----- pure pieces ------------------------------------------------------------------------------------


def test_threshold_and_is_trailing_ratio_and_delta():
    ratio = TrailingBaselineStop(min_ratio=0.9)
    assert ratio.threshold(BASE) == pytest.approx(4.68)
    assert ratio.is_trailing(4.67, BASE) and not ratio.is_trailing(4.68, BASE) and not ratio.is_trailing(6.0, BASE)
    assert ratio.is_trailing(math.nan, BASE)
    delta = TrailingBaselineStop(min_delta=-0.5)
    assert delta.threshold(BASE) == pytest.approx(4.7)
    assert delta.is_trailing(4.69, BASE) and not delta.is_trailing(4.71, BASE)
    assert delta.describe_threshold(BASE) == "baseline 5.20 - 0.5 = 4.70"
    default = TrailingBaselineStop()
    assert default.min_ratio == 0.9 and default.min_delta is None
    assert default.is_trailing(4.67, BASE) and not default.is_trailing(4.68, BASE)


def test_trailing_for_patience_reports_stops():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3)
    two = cb.decide([(100, 3.0), (200, 3.1)], BASE)
    assert not two.stop and two.wait_count == 2 and "2/3" in two.reason
    three = cb.decide([(100, 3.0), (200, 3.1), (300, 3.2)], BASE)
    assert three.stop and three.wait_count == 3
    assert three.reason == "ddtree@8/live 3.20 < 0.9 x baseline 5.20 = 4.68 for 3 reports in a row (steps 100-300)"


def test_recovering_resets_the_count():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3)
    history = [(100, 3.0), (200, 3.1), (300, 5.0), (400, 3.2), (500, 3.3)]
    d = cb.decide(history, BASE)
    assert not d.stop and d.wait_count == 2
    d = cb.decide(history + [(600, 3.4)], BASE)
    assert d.stop and d.wait_count == 3 and "(steps 400-600)" in d.reason
    assert not cb.decide(history + [(600, 4.68)], BASE).stop  # equal to the threshold is not trailing
    # order of the history does not matter
    assert cb.decide(list(reversed(history + [(600, 3.4)])), BASE).stop


def test_grace_period_ignores_early_reports():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=2, grace_steps=300)
    early = [(100, 1.0), (200, 1.0)]
    d = cb.decide(early, BASE)
    assert not d.stop and d.wait_count == 0 and "grace_steps=300" in d.reason
    d = cb.decide(early + [(300, 1.0)], BASE)
    assert not d.stop and d.wait_count == 1
    assert cb.decide(early + [(300, 1.0), (400, 1.0)], BASE).stop


def test_min_delta_mode():
    cb = TrailingBaselineStop(min_delta=-0.5, patience=2)
    assert not cb.decide([(1, 4.75), (2, 4.71)], BASE).stop
    d = cb.decide([(1, 4.6), (2, 4.65)], BASE)
    assert d.stop and "< baseline 5.20 - 0.5 = 4.70 for 2 reports" in d.reason
    positive = TrailingBaselineStop(min_delta=0.25, patience=1)
    assert positive.decide([(1, 5.3)], BASE).stop  # must beat the baseline by 0.25
    assert not positive.decide([(1, 5.45)], BASE).stop


def test_fit_projection_recovers_a_log_curve():
    steps = [100, 200, 400, 800]
    values = [1.5 + 0.4 * math.log(s) for s in steps]
    a, b = fit_projection(steps, values)
    assert a == pytest.approx(1.5) and b == pytest.approx(0.4)
    assert projected_value(a, b, 5000) == pytest.approx(1.5 + 0.4 * math.log(5000))
    with pytest.raises(ValueError, match="positive"):
        fit_projection([0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="2 distinct"):
        fit_projection([5, 5], [1, 2])


def rising(a: float, b: float, steps=(400, 600, 800, 1000, 1200)) -> list[tuple[int, float]]:
    return [(s, a + b * math.log(s)) for s in steps]


def test_projection_catches_up_so_no_stop():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True)
    history = rising(-4.0, 1.0)  # 2.0 at 400 ... 3.09 at 1200; 4.52 at 5000, 5.21 at 10000
    assert cb.decide(history, BASE).stop is False  # horizon unknown and the curve rises
    far = cb.decide(history, BASE, max_steps=10_000)
    assert not far.stop and far.projected == pytest.approx(-4.0 + math.log(10_000))
    assert "reaches 5.21 by max_steps=10000 >= 4.68: not stopping" in far.reason


def test_projection_will_not_catch_up_so_stop():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True)
    history = rising(-4.0, 1.0)
    d = cb.decide(history, BASE, max_steps=5000)
    assert d.stop and d.projected == pytest.approx(-4.0 + math.log(5000))
    assert d.reason.endswith("projection a+b*log(step) reaches 4.52 by max_steps=5000 < 4.68")
    flat = cb.decide([(s, 3.0) for s in (400, 600, 800)], BASE)  # no horizon, but the curve does not rise
    assert flat.stop and "does not rise" in flat.reason


def test_projection_uses_only_the_last_window():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True, projection_window=3)
    # a steep early rise, then flat: the full history would project a catch-up, the window does not
    history = [(10, 0.5), (20, 2.0), (40, 3.0), (1000, 3.5), (1100, 3.5), (1200, 3.5)]
    assert TrailingBaselineStop(min_ratio=0.9, patience=3, projection=True, projection_window=6).decide(
        history, BASE, max_steps=100_000
    ).stop is False
    assert cb.decide(history, BASE, max_steps=100_000).stop


def test_too_few_points_for_projection_does_not_stop():
    cb = TrailingBaselineStop(min_ratio=0.9, patience=2, projection=True)
    d = cb.decide([(100, 1.0), (200, 1.0)], BASE, max_steps=1000)
    assert not d.stop and d.wait_count == 2 and "needs 3 reports" in d.reason and d.projected is None
    # non-finite values do not count as projection points (but still trail)
    d = cb.decide([(100, 1.0), (200, math.nan), (300, 1.0)], BASE, max_steps=1000)
    assert not d.stop and d.wait_count == 3 and "has 2" in d.reason
    assert cb.decide([(100, 1.0), (200, 1.0), (300, 1.0)], BASE, max_steps=1000).stop


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"monitor": "ddtree8/live"}, "vanilla, ddtree@N (node budget N >= 1) or top@K (width K >= 1), optionally :bB "
                                      "(block size B >= 2), then optionally :RULE (an attention rule: auto, causal, "
                                      "bidirectional, anchored-causal, anchored-bidirectional, no-window, vllm, vllm-as-written, "
                                      "sglang, "
                                      "trained); got 'ddtree8'"),
        ({"monitor": "ddtree@8"}, "METHOD/AGGREGATE"),
        ({"monitor": "top@0/live"}, "got 'top@0'"),
        ({"monitor": "vanilla/mean"}, "an aggregate is one of ['dense', 'live', 'pooled']; got 'mean'"),
        ({"min_ratio": 0.9, "min_delta": -0.5}, "not both"),
        ({"min_ratio": 0.0}, "`min_ratio` must be None or a finite number > 0"),
        ({"min_ratio": "0.9"}, "`min_ratio` must be None or a finite number > 0; got '0.9'"),
        ({"min_delta": math.inf}, "`min_delta` must be None or a finite number"),
        ({"patience": 0}, "`patience` must be an integer >= 1; got 0"),
        ({"patience": 2.0}, "`patience` must be an integer >= 1; got 2.0"),
        ({"grace_steps": -1}, "`grace_steps` must be an integer >= 0"),
        ({"projection": "false"}, "`projection` must be true or false; got 'false'"),
        ({"projection_window": 2}, "`projection_window` must be an integer >= 3"),
        ({"action": "halt"}, "`action` must be one of ['stop', 'warn']; got 'halt'"),
    ],
)


def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        TrailingBaselineStop(**kwargs)
    assert message in str(err.value)


def test_valid_monitors():
    for monitor in ("vanilla/live", "vanilla/dense", "ddtree@8/live", "ddtree@128/dense", "top@4/live"):
        assert validate_monitor(monitor) == monitor


def test_state_dict_round_trip():
    """The stop's state (its count, its reason, the step its stop reached) as primitives; the history is
    the run's, rebuilt from results.jsonl on a resume, and an earlier version's history key is read past."""
    cb = TrailingBaselineStop(monitor="top@4/dense", min_ratio=0.9, patience=3)
    cb.follow(None, kept=([], StopState(wait_count=2, stop_reason="why", stopped_step=7)))
    state = cb.state_dict()
    assert json.loads(json.dumps(state)) == state == {"wait_count": 2, "stopped_step": 7, "stop_reason": "why"}
    restored = TrailingBaselineStop(monitor="top@4/dense", min_ratio=0.9, patience=3)
    restored.load_state_dict(json.loads(json.dumps({**state, "history": [[100, 3.0]], "bounds": []})))
    assert restored.wait_count == 2 and restored.stopped_step == 7 and restored.state_dict() == state
    assert "top@4/dense" in cb.state_key and cb.state_key != TrailingBaselineStop().state_key


# ----- the hook, without a Trainer run ---------------------------------------------------------------


def say(text: str) -> None:
    warnings.warn(text, UserWarning)


def test_no_baseline_records_and_warns_once(tmp_path):
    cb = TrailingBaselineStop(min_ratio=0.9, patience=1)
    now = Moment(step=1, horizon=10)
    judge = judged_by(cb)
    with pytest.warns(UserWarning, match="no baseline report"):
        assert judge(make_report(1.0, 1), None, now, print, say) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second report without a baseline warns no more
        assert judge(make_report(1.0, 2), None, now, print, say) is None
    assert cb.history == [(1, 1.0), (2, 1.0)] and cb.stop_reason is None
    reason = judge(make_report(1.0, 3), make_report(BASE, None), now, print, say)
    assert reason.startswith("dflash: stopping at step 3:")


def test_missing_monitor_names_what_exists():
    cb = TrailingBaselineStop(monitor="ddtree@16/live")
    with pytest.raises(RuntimeError, match=r"ddtree@16/live is not in this report; it holds the methods \['ddtree@8'\]"):
        judged_by(cb)(make_report(1.0, 1), make_report(BASE, None), Moment(step=1), print, say)


def test_defaults_without_a_threshold_is_ninety_percent_and_delta_alone_is_accepted():
    assert (TrailingBaselineStop().min_ratio, TrailingBaselineStop().min_delta) == (0.9, None)
    alone = TrailingBaselineStop(min_delta=-0.5)  # the YAML defect: this was refused as "not both"
    assert (alone.min_ratio, alone.min_delta) == (None, -0.5) and alone.threshold(BASE) == BASE - 0.5
