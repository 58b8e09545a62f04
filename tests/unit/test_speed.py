"""The predicted speed-up: tau x T_target(1, L) / (T_draft(B) + T_target(n, L) + overhead) against a hand
computation on costs made by hand, its interval and the paired ratio with the baseline, the fastest line, the
logged keys, and `score --costs` end to end on the toy world."""

import dataclasses
import re

import pytest

from dflash_callbacks import load_drafter
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.demos.toy.world import toy_baseline_path
from dflash_callbacks.model import TargetHead
from dflash_callbacks.scoring.costs import Costs, CostsError
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.methods import Method
from dflash_callbacks.scoring.scorer import score_drafter
from dflash_callbacks.scoring.speed import (
    fastest, fastest_line, method_shape, speedup_metrics, speedup_values, task_contexts,
)

TASKS = ["fizzbuzz", "binary_search", "linked_list_reverse"]


def hand_costs(slope: float = 0.001, **kw) -> Costs:
    """T_target(n, 100) = 10 ms + slope (n - 1), at 300 4 ms more; a round of the drafter 4 ms at block 8, 3 ms at
    block 4; 0.5 ms of bookkeeping."""
    fields = dict(device="hand", device_type="cpu", dtype="float32", batch_size=1,
                  target={"hidden_size": 128, "vocab_size": 260, "num_layers": 4}, contexts=[100, 300],
                  verify={100: [0.010 + slope * n for n in range(15)], 300: [0.014 + slope * n for n in range(15)]},
                  draft={8: 0.004, 4: 0.003}, overhead=0.0005)
    fields.update(kw)
    return Costs(**fields)


@pytest.fixture(scope="module")
def report(toy_cache, toy_target):
    config = ScoringConfig(ddtree_budgets=[4, 8], topk=[2], block_sizes=[4], device="cpu", tasks=TASKS)
    return score_drafter(load_drafter(toy_baseline_path()), toy_cache, TargetHead.from_pretrained(toy_target), config)


def test_the_shape_of_each_method(report):
    assert [(str(m), tuple(vars(method_shape(report, m)).values())) for m in report.methods] == [
        ("vanilla", (8, 8, False)), ("ddtree@4", (8, 5, True)), ("ddtree@8", (8, 9, True)), ("top@2", (8, 15, True)),
        ("vanilla:b4", (4, 4, False)), ("ddtree@4:b4", (4, 5, True)), ("ddtree@8:b4", (4, 9, True)),
        ("top@2:b4", (4, 7, True))]


@pytest.mark.parametrize("method, draft, n", [("vanilla", 0.004, 8), ("ddtree@4", 0.004, 5), ("top@2", 0.004, 15),
                                              ("ddtree@8:b4", 0.003, 9)])
def test_the_speedup_is_the_formula_computed_by_hand(report, method, draft, n):
    costs = hand_costs()
    values = speedup_values(report, None, costs, contexts=200)
    t1, tn = (0.010 + 0.014) / 2, (0.010 + 0.014) / 2 + 0.001 * (n - 1)  # L = 200: half way between 100 and 300
    factor = t1 / (draft + tn + 0.0005)
    for task in [*TASKS, "mean"]:
        found = values[(method, "live", task)]
        lo, hi = report.interval(f"{method}/live", task)
        assert found.ours.value == pytest.approx(report.value(f"{method}/live", task) * factor)
        assert (found.ours.lo, found.ours.hi) == pytest.approx((lo * factor, hi * factor))
        assert found.baseline is None and found.ratio is None


def test_each_task_at_its_own_context(report, toy_cache_dir):
    contexts = task_contexts(toy_cache_dir, report)
    from dflash_callbacks.cache.format import read_manifest

    entries = {t["name"]: t for t in read_manifest(toy_cache_dir)["tasks"]}
    assert contexts == {t: entries[t]["prompt_len"] + (entries[t]["num_tokens"] - entries[t]["prompt_len"]) / 2
                        for t in TASKS}
    costs = hand_costs(contexts=[300, 500], verify={300: [0.010 + 0.001 * n for n in range(15)],
                                                    500: [0.020 + 0.001 * n for n in range(15)]})
    values = speedup_values(report, None, costs, contexts)
    for task, L in contexts.items():
        w = (L - 300) / 200
        t1 = 0.010 + 0.010 * w
        expected = report.value("vanilla/live", task) * t1 / (0.004 + t1 + 0.007 + 0.0005)
        assert values[("vanilla", "live", task)].ours.value == pytest.approx(expected)


def test_against_the_baseline_the_ratio_is_paired_and_carries_the_costs_difference(report):
    same = speedup_values(report, report, hand_costs(), 200)
    for method in report.methods:
        found = same[(method, "live", "mean")]
        assert found.baseline == found.ours
        assert (found.ratio.value, found.ratio.lo, found.ratio.hi) == pytest.approx((1, 1, 1))
    # a baseline whose draft costs 10 ms more per round: ours is faster by exactly the cost factors' ratio
    slower = speedup_values(report, report, hand_costs(baseline_draft={8: 0.014, 4: 0.013}), 200)
    found = slower[("ddtree@4", "live", "mean")]
    scale = (0.014 + 0.016 + 0.0005) / (0.004 + 0.016 + 0.0005)
    assert found.ratio.value == pytest.approx(scale) and found.ratio.lo == pytest.approx(scale)
    assert found.ours.value / found.baseline.value == pytest.approx(scale)


def test_the_fastest_is_the_best_servable_method_and_is_told_against_the_runner_up(report):
    costs = hand_costs(slope=0.004)  # verification grows steeply with the tree
    values = speedup_values(report, None, costs, 200)
    servable = [m for m in report.methods if not m.startswith("top@")]
    ranked = sorted(servable, key=lambda m: -values[(m, "live", "mean")].ours.value)
    found = fastest(report, costs, contexts=200)
    best, second = values[(ranked[0], "live", "mean")].ours, values[(ranked[1], "live", "mean")].ours
    assert found.method == str(Method.parse(ranked[0]).at(report.block(ranked[0]))) and found.speedup == best
    assert found.runner_up_speedup == second
    assert found.over_runner_up.value == pytest.approx(best.value / second.value)
    assert found.over_runner_up.lo <= found.over_runner_up.value <= found.over_runner_up.hi
    line = fastest_line(report, costs, contexts=200)
    pattern = (r"fastest: (\S+:b\d+), (\d+\.\d\d)× \[(\d+\.\d\d), (\d+\.\d\d)\] \((\S+:b\d+) (\d+\.\d\d)×; "
               r"(\d+\.\d\d) \[(\d+\.\d\d), (\d+\.\d\d)\] of it, (not distinguishable|distinguishable|too few tasks to tell)\)")
    match = re.fullmatch(pattern, line)
    assert match, line
    assert match.group(1) == found.method and float(match.group(2)) == pytest.approx(best.value, abs=0.005)
    assert match.group(10) == found.verdict


def test_a_round_ten_times_cheaper_is_distinguishable(report):
    """ddtree@8 at block 8 verified and drafted for nearly nothing, every other tree and chain at 50 ms: it wins
    clearly."""
    verify = {100: [0.001] * 9 + [0.05] * 6, 300: [0.001] * 9 + [0.05] * 6}
    verify = {L: [0.05 if n in (5, 8, 4) else t for n, t in enumerate(ts, 1)] for L, ts in verify.items()}
    costs = hand_costs(verify=verify, draft={8: 0.0001, 4: 0.05}, overhead=0.0)
    found = fastest(report, costs, contexts=200)
    assert found.method == "ddtree@8:b8" and found.verdict == "distinguishable" and found.over_runner_up.lo > 1


def test_a_budget_sweep_scores_every_budget_and_the_fastest_is_chosen_over_them(toy_cache, toy_target):
    config = ScoringConfig(ddtree_budgets=[], ddtree_sweep=6, device="cpu", tasks=TASKS)
    swept = score_drafter(load_drafter(toy_baseline_path()), toy_cache, TargetHead.from_pretrained(toy_target), config)
    assert swept.methods == ["vanilla"] + [f"ddtree@{n}" for n in range(1, 7)]
    taus = [swept.value(f"ddtree@{n}/dense") for n in range(1, 7)]
    assert taus == sorted(taus) and taus[-1] > taus[0]  # a larger tree never accepts less
    costs = hand_costs(slope=0.001)  # each token verified costs 1 ms more: tau rises, the speed-up peaks inside
    values = speedup_values(swept, None, costs, 200)
    best = max(swept.methods, key=lambda m: values[(m, "live", "mean")].ours.value)
    assert best.startswith("ddtree@") and best not in ("ddtree@1", "ddtree@6")
    assert fastest(swept, costs, contexts=200).method == f"{best}:b8"


def test_the_logged_keys(report):
    metrics = speedup_metrics("dflash", speedup_values(report, report, hand_costs(), 200))
    assert metrics["dflash/speedup/ddtree@8/live/mean"] > 0
    assert {"dflash/speedup/ddtree@8/live/mean_lo", "dflash/speedup/ddtree@8/live/mean_hi",
            "dflash/speedup/baseline/ddtree@8:b4/dense/fizzbuzz", "dflash/speedup/ratio/top@2/live/mean_hi"} <= set(metrics)
    assert "dflash/speedup/ddtree@8/live/fizzbuzz_lo" not in metrics


def test_a_method_the_costs_do_not_cover_is_named(report):
    costs = hand_costs(verify={100: [0.01] * 8, 300: [0.01] * 8})
    with pytest.raises(CostsError, match="verify forwards of 1 to 8 tokens, not 9"):
        speedup_values(report, None, costs)


# ---------------------------------------------------------------------- score --costs, end to end
def score_argv(toy_cache_dir, toy_target, tmp_path, *more) -> list[str]:
    baseline = str(toy_baseline_path())
    return ["score", "--drafter", baseline, "--baseline", baseline, "--cache", str(toy_cache_dir), "--target",
            str(toy_target), "--budgets", "4,8", "--device", "cpu", "--tasks", ",".join(TASKS),
            "--baseline-cache-dir", str(tmp_path / "baselines"), *more]


def test_score_with_costs_prints_the_speedups_and_the_fastest_line(toy_cache_dir, toy_target, tmp_path, capsys):
    path = tmp_path / "costs.json"
    hand_costs().to_json(path)
    ours, base = tmp_path / "ours.json", tmp_path / "base.json"
    assert cli_main(score_argv(toy_cache_dir, toy_target, tmp_path, "--json", str(ours), "--baseline-json",
                               str(base))) == 0
    without = capsys.readouterr().out
    assert "speed-up" not in without and "fastest" not in without
    assert cli_main(score_argv(toy_cache_dir, toy_target, tmp_path, "--costs", str(path))) == 0
    out = capsys.readouterr().out
    assert out.startswith(without)  # the report's own table is as it was without costs
    added = out[len(without):].splitlines()
    assert added[0].startswith("predicted speed-up (live) on hand, float32, batch 1, at context ")
    assert [row.split()[0] for row in added[1:-1]] == ["vanilla", "ddtree@4", "ddtree@8"]
    assert all("ratio 1.00 [1.00, 1.00]" in row for row in added[1:-1])  # the baseline is ours: the same speed
    assert re.fullmatch(r"fastest: ddtree@[48]:b8, .*", added[-1])
    # compare reads the same costs: the same speed-ups from the saved reports
    assert cli_main(["compare", str(ours), str(base), "--costs", str(path)]) == 0
    compared = capsys.readouterr().out.splitlines()
    assert compared[-len(added):] == added


def test_compare_falls_back_on_the_costs_the_report_was_scored_with(report, tmp_path, capsys):
    """No --costs: the costs file our report's scoring names (scoring.costs); --costs wins over it; a recorded
    file gone since is one warning line and no speed-up, not a failure."""
    recorded, other = tmp_path / "recorded.json", tmp_path / "other.json"
    hand_costs().to_json(recorded)
    hand_costs(slope=0.004).to_json(other)
    ours, base = tmp_path / "ours.json", tmp_path / "base.json"
    dataclasses.replace(report, scoring={**report.scoring, "costs": str(recorded)}).to_json(ours)
    report.to_json(base)

    def compare(*more: str) -> tuple[str, str]:
        code = cli_main(["compare", str(ours), str(base), *more])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return captured.out, captured.err

    fallback, err = compare()
    assert "predicted speed-up (live) on hand" in fallback and "fastest: " in fallback and err == ""
    assert compare("--costs", str(recorded)) == (fallback, "")
    given = compare("--costs", str(other))[0]
    table = fallback.split("predicted speed-up")[0]
    assert given != fallback and given.startswith(table)  # the same tau table, other speed-ups
    recorded.unlink()
    out, err = compare()
    assert out == table and err.splitlines() == [
        f"warning: no predicted speed-up: the costs {ours} was scored with ({recorded}) is not here; give the costs "
        "file with --costs FILE"]
    assert compare("--costs", str(other)) == (given, "")


def test_score_refuses_costs_of_another_dtype_or_target_in_one_line_unless_forced(toy_cache_dir, toy_target, tmp_path,
                                                                                   capsys):
    path = tmp_path / "costs.json"
    hand_costs(dtype="bfloat16", target={"hidden_size": 5120, "vocab_size": 260, "num_layers": 4}).to_json(path)
    assert cli_main(score_argv(toy_cache_dir, toy_target, tmp_path, "--costs", str(path))) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --costs {path}: the costs file does not fit: ")
    assert "measured in bfloat16, scored in float32" in err[0] and "hidden_size 128" not in err[0]
    assert "another target shape: hidden_size 5120 (measured) vs 128" in err[0]
    assert cli_main(score_argv(toy_cache_dir, toy_target, tmp_path, "--costs", str(path), "--force-costs")) == 0
    captured = capsys.readouterr()
    assert "fastest: " in captured.out and "warning: --costs" in captured.err
