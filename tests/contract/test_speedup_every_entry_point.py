"""The predicted speed-up through every entry point (the plain loop, Lightning, the transformers Trainer,
`watch --checkpoints`, `watch --dir`) with `scoring.costs`: the speed-up keys each logs equal
`speedup_values` of the report read back from results.jsonl, on the costs file and the cache's contexts, paired
with the baseline; the fastest line with every report; a report without costs logs exactly today's keys; a
costs file that does not fit is refused before the first step in one line naming the mismatch (forced: one
warning); a stop on a speed-up monitor stops where its ratio to the baseline's speed-up says, and `plot`
replays it."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.engine.metric_keys import report_bounds, report_values, run_counts
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.hf import DrafterEvalTrainerCallback
from dflash_callbacks.model import DFlashDrafter, save_drafter
from dflash_callbacks.scoring.costs import Costs
from dflash_callbacks.scoring.intervals import paired_comparison
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec
from dflash_callbacks.scoring.speed import speedup_metrics, speedup_values, task_contexts
from dflash_callbacks.watch.runs import Watcher

from loops import SCORING, hf_fit, plain_fit
from runs import run_dir, wait_until
from speed_costs import write_costs
from tracker_reports import read_events, scalars
from wandb_records import read_run
from train_run import eval_cb, fit, shared_world, world_paths


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    path = shared_world(tmp_path_factory.getbasetemp() / "reliability-world")
    return SimpleNamespace(path=path, **world_paths(path), bc=tmp_path_factory.mktemp("speedup-bc"))


@pytest.fixture(scope="module")
def costs(tmp_path_factory) -> Path:
    return write_costs(tmp_path_factory.mktemp("speedup-costs") / "costs.json")


def engine_args(world, tmp_path: Path, costs: Path | None, **scoring) -> dict:
    return dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2,
                scoring={**SCORING, **({"costs": str(costs)} if costs else {}), **scoring}, dirpath=tmp_path / "d",
                baseline_cache_dir=world.bc, verbose=False, busy="queue", max_pending=8, wait_timeout=300)


def read_back(folder: Path) -> tuple[list[EvalReport], EvalReport]:
    """The run's reports from its results.jsonl, and the baseline's report in its folder."""
    run = RunFolder(run_dir(folder) if not (folder / "results.jsonl").is_file() else folder)
    baseline = EvalReport.load(run.report_path(None)) if run.report_path(None).is_file() else None
    return run.read_results().reports, baseline


def expected_speedups(report: EvalReport, baseline: EvalReport, costs: Path, cache: Path) -> dict[str, float]:
    """`speedup_metrics` of the report as results.jsonl holds it, computed here from the parts."""
    values = speedup_values(report, baseline, Costs.load(costs), task_contexts(cache, report),
                            comparisons=paired_comparison(report, baseline))
    return speedup_metrics("dflash", values)


def speedup_keys(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("dflash/speedup/")}


def assert_same_speedups(logged: dict[str, float], expected: dict[str, float], rel: float = 1e-9) -> None:
    assert set(logged) == set(expected)
    assert all(logged[k] == pytest.approx(expected[k], rel=rel, abs=1e-12) for k in expected), \
        [(k, logged[k], expected[k]) for k in expected if logged[k] != pytest.approx(expected[k], rel=rel, abs=1e-12)][:4]


def baseline_of(world, tmp_path, report: EvalReport, costs: Path | None) -> EvalReport:
    """The baseline's report as the run's service scores it (the same cache, config and baseline folder)."""
    scoring = dict(report.scoring)
    spec = ServiceSpec(str(world.cache), str(world.target), str(world.baseline), scoring, str(world.bc))
    return ScoringService(spec).baseline()


# ------------------------------------------------------------------ the keys, entry point by entry point
def test_the_plain_loop_logs_the_speedups_of_every_report_and_says_the_fastest(world, tmp_path, costs, caplog):
    logged: list[tuple[int, dict]] = []
    ev = DrafterEvaluator(**{**engine_args(world, tmp_path, costs), "verbose": True}, max_steps=4,
                          log=lambda m, s: logged.append((s, dict(m))))
    with caplog.at_level(logging.INFO, logger="dflash_callbacks"):
        plain_fit(world, 4, ev)
    reports = {r.step: r for r in RunFolder(ev.run.path).read_results().reports}
    baseline = ev.baseline_report
    assert sorted(reports) == [2, 4] and [s for s, _ in logged] == [2, 4]
    for step, metrics in logged:
        assert_same_speedups(speedup_keys(metrics), expected_speedups(reports[step], baseline, costs, world.cache))
    # the run-level ones are held beside the tau means, and results.jsonl keeps them (the stop's, a resume's)
    last = speedup_keys(logged[-1][1])
    held = {k: v for k, v in ev.metrics.items() if k.startswith("dflash/speedup/")}
    assert held == {k: v for k, v in last.items() if k.endswith(("/mean", "/mean_lo", "/mean_hi"))} and held
    kept = reports[4].extra["speedup"]["ddtree@4/live"]
    assert kept["ours"][0] == pytest.approx(last["dflash/speedup/ddtree@4/live/mean"], abs=1e-6)
    assert kept["ratio"][2] == pytest.approx(last["dflash/speedup/ratio/ddtree@4/live/mean_hi"], abs=1e-6)
    said = "\n".join(r.getMessage() for r in caplog.records).splitlines()
    for step in (2, 4):
        assert any(line.startswith(f"dflash step {step}: fastest: ") and "×" in line for line in said), said
    assert any("predicted speed-up (live) on hand-made, float32, batch 1" in line for line in said), said


def test_a_run_without_costs_logs_exactly_the_keys_it_did(world, tmp_path):
    logged: list[tuple[int, dict]] = []
    ev = DrafterEvaluator(**engine_args(world, tmp_path, None), max_steps=2, log=lambda m, s: logged.append((s, m)))
    plain_fit(world, 2, ev)
    (report,) = RunFolder(ev.run.path).read_results().reports
    baseline = ev.baseline_report
    versus = paired_comparison(report, baseline)
    today = {**report_values("dflash", report, baseline, versus), **report_bounds("dflash", report, baseline, versus),
             **run_counts("dflash", report.step, 0.0, 0)}
    ((_, metrics),) = logged
    assert set(metrics) == set(today)
    assert "speedup" not in report.extra and not any("speedup" in k for k in ev.metrics)


def test_lightning_logs_the_speedups_to_wandb_and_holds_their_means_in_callback_metrics(world, tmp_path, costs,
                                                                                        monkeypatch):
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    cb = eval_cb(world.path, tmp_path, baseline=world.baseline, baseline_cache_dir=world.bc, busy="queue",
                 max_pending=8, scoring={**SCORING, "costs": str(costs)})
    logger = WandbLogger(project="dflash-test", save_dir=str(tmp_path), offline=True)
    trainer = fit(world.path, tmp_path, [cb], max_steps=4, logger=logger)
    wandb.finish()
    reports, _ = read_back(tmp_path / "d")
    run = read_run(next((tmp_path / "wandb").glob("offline-run-*")))
    rows = {r["dflash/step"]: r for r in run["history"] if "dflash/step" in r}
    assert sorted(rows) == [2, 4] == sorted(r.step for r in reports)
    for report in reports:
        expected = expected_speedups(report, cb.baseline_report, costs, world.cache)
        assert_same_speedups(speedup_keys(rows[report.step]), expected)
    key = "dflash/speedup/ratio/ddtree@4/live/mean"
    assert run["metrics"][key].step_metric == "dflash/step"
    assert run["summary"][key] == {"max": pytest.approx(max(rows[s][key] for s in rows))}
    last = max(reports, key=lambda r: r.step)
    expected = expected_speedups(last, cb.baseline_report, costs, world.cache)
    held = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("dflash/speedup/")}
    assert_same_speedups(held, {k: v for k, v in expected.items() if k.endswith(("/mean", "/mean_lo", "/mean_hi"))},
                         rel=1e-6)  # Lightning keeps float32 tensors


def test_a_resume_puts_the_speedup_means_back_before_any_new_report(world, tmp_path, costs):
    first: list[tuple[int, dict]] = []
    ev = DrafterEvaluator(**engine_args(world, tmp_path, costs), max_steps=5, log=lambda m, s: first.append((s, m)))
    plain_fit(world, 4, ev, ckpt_dir=tmp_path / "ckpt", ckpt_every=4)
    seen = {}
    again = DrafterEvaluator(**engine_args(world, tmp_path, costs), max_steps=5)
    plain_fit(world, 5, again, resume=tmp_path / "ckpt" / "step=4.pt",
              after_step=lambda model, step: seen.update(again.metrics))
    assert again.run_id == ev.run_id and seen["dflash/step"] == 4.0
    logged = {k: v for k, v in first[-1][1].items() if k.startswith("dflash/speedup/") and k.endswith(
        ("/mean", "/mean_lo", "/mean_hi"))}
    restored = {k: v for k, v in seen.items() if k.startswith("dflash/speedup/")}
    if math.isnan(seen["dflash/baseline/ddtree@4/live/mean"]):  # the baseline's report not back yet: as tau's
        assert all(math.isnan(v) for k, v in restored.items() if k.startswith(("dflash/speedup/baseline/",
                                                                                  "dflash/speedup/ratio/")))
        restored = {k: v for k, v in restored.items() if not math.isnan(v)}
        logged = {k: v for k, v in logged.items() if k in restored}
    assert len(restored) >= 12
    assert_same_speedups(restored, logged, rel=1e-5)  # results.jsonl keeps them to 6 digits


def test_the_transformers_trainer_logs_the_speedups(world, tmp_path, costs):
    logged: list[tuple[int, dict]] = []
    cb = DrafterEvalTrainerCallback(**engine_args(world, tmp_path, costs), log=lambda m, s: logged.append((s, dict(m))))
    hf_fit(world, tmp_path / "out", 4, [cb])
    reports = {r.step: r for r in read_back(tmp_path / "d")[0]}
    assert sorted(reports) == [2, 4] and [s for s, _ in logged] == [2, 4]
    for step, metrics in logged:
        assert_same_speedups(speedup_keys(metrics), expected_speedups(reports[step], cb.baseline_report, costs,
                                                                      world.cache))


def test_watch_checkpoints_sends_the_speedups_to_its_trackers_and_says_the_fastest(world, tmp_path, costs, capsys):
    import numpy as np

    root = tmp_path / "ckpts"
    for step in (2, 4):
        save_drafter(root / f"checkpoint-{step}", world.config, DFlashDrafter(world.config).state_dict())
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    code = cli_main(["watch", "--checkpoints", str(root), "--cache", str(world.cache), "--target", str(world.target),
                     "--budgets", "4", "--device", "cpu", "--once", "--settle-seconds", "0", "--costs", str(costs),
                     "--baseline", str(world.baseline), "--baseline-cache-dir", str(world.bc),
                     "--tensorboard", str(tmp_path / "tb"), "--monitor", "speedup/ddtree@4/live"])
    out = capsys.readouterr().out
    assert code == 0, out
    reports, baseline = read_back(root / "dflash-eval")
    baseline = baseline or baseline_of(world, tmp_path, reports[0], costs)
    events = scalars(read_events(tmp_path / "tb"))
    for report in reports:
        expected = expected_speedups(report, baseline, costs, world.cache)
        got = {k: dict(v)[report.step] for k, v in events.items() if k.startswith("dflash/speedup/")}
        assert_same_speedups(got, {k: float(np.float32(v)) for k, v in expected.items()}, rel=1e-6)
        assert f"dflash step {report.step}: fastest: " in out
    assert "speedup/ddtree@4/live" in out.splitlines()[-1]  # the exit summary: the monitored speed-up


def test_watch_dir_scores_a_run_whose_engine_logs_the_speedups_on_its_own_costs(world, tmp_path, costs):
    """runner="external": the watcher takes the run's costs from its run.json (the watcher's flags have none),
    says the fastest per snapshot; the training process logs the keys."""
    logged: list[tuple[int, dict]] = []
    ev = DrafterEvaluator(**{**engine_args(world, tmp_path, costs), "runner": "external"}, max_steps=4,
                          log=lambda m, s: logged.append((s, dict(m))))
    spec = ServiceSpec(str(world.cache), str(world.target), str(world.baseline), SCORING, str(world.bc))
    lines: list[str] = []
    watcher, done = Watcher(ScoringService(spec), tmp_path / "d", log=lines.append), threading.Event()

    def watch():
        while not done.wait(0.05):
            watcher.scan_once()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        plain_fit(world, 4, ev)
    finally:
        done.set()
        thread.join()
    reports = {r.step: r for r in RunFolder(ev.run.path).read_results().reports}
    assert sorted(reports) == [2, 4] and [s for s, _ in logged] == [2, 4] and ev.errors == 0
    for step, metrics in logged:
        assert reports[step].scoring["costs"] == str(costs)
        assert_same_speedups(speedup_keys(metrics), expected_speedups(reports[step], ev.baseline_report, costs,
                                                                      world.cache))
        assert any(line.startswith(f"watch: {ev.run.path.name} step {step}: fastest: ") for line in lines), lines


# ------------------------------------------------------------------ a costs file that does not fit
MISMATCHES = [
    ({"dtype": "bfloat16"}, "measured in bfloat16, scored in float32"),
    ({"device_type": "cuda", "device": "NVIDIA H200"}, "measured on NVIDIA H200 (cuda), scored for cpu"),
    ({"target": {"hidden_size": 5120, "vocab_size": 16, "num_layers": 4}},
     "another target shape: hidden_size 5120 (measured) vs 32"),
    ({"drafter": {"family": "dflash", "hidden_size": 32, "num_layers": 8}},
     "another drafter shape: num_layers 8 (measured) vs 2"),
    ({"verify": {8: [0.01] * 3, 40: [0.02] * 3}}, "ddtree@4: the costs hold verify forwards of 1 to 3 tokens, not 5"),
]


@pytest.mark.parametrize("change, says", MISMATCHES)
def test_the_plain_loop_refuses_a_costs_file_that_does_not_fit_before_the_first_step(world, tmp_path, change, says):
    costs = write_costs(tmp_path / "costs.json", **change)
    steps = []
    with pytest.raises(PreflightError) as refused:
        plain_fit(world, 2, DrafterEvaluator(**engine_args(world, tmp_path, costs), max_steps=2),
                  before_eval=lambda model, step: steps.append(step))
    lines = [line for line in str(refused.value).splitlines() if "scoring.costs" in line]
    assert len(lines) == 1 and says in lines[0], str(refused.value)
    assert steps == [] and not (tmp_path / "d").exists()


def test_every_other_entry_point_refuses_it_too_and_force_costs_warns_once(world, tmp_path, capsys):
    costs = write_costs(tmp_path / "costs.json", dtype="bfloat16")
    says = "measured in bfloat16, scored in float32"
    cb = eval_cb(world.path, tmp_path, scoring={**SCORING, "costs": str(costs)})
    with pytest.raises(PreflightError, match=says):
        fit(world.path, tmp_path, [cb], max_steps=2)
    with pytest.raises(PreflightError, match=says):
        hf_fit(world, tmp_path / "out", 2, [DrafterEvalTrainerCallback(**engine_args(world, tmp_path, costs))])
    root = tmp_path / "ckpts"
    save_drafter(root / "checkpoint-2", world.config, DFlashDrafter(world.config).state_dict())
    code = cli_main(["watch", "--checkpoints", str(root), "--cache", str(world.cache), "--target", str(world.target),
                     "--budgets", "4", "--device", "cpu", "--once", "--settle-seconds", "0", "--costs", str(costs)])
    assert code != 0 and says in capsys.readouterr().err
    assert not (root / "dflash-eval" / "results.jsonl").exists()
    with pytest.warns(UserWarning, match=f"does not fit, used anyway \\(scoring.force_costs\\): {says}") as said:
        ev = DrafterEvaluator(**engine_args(world, tmp_path, costs, force_costs=True), max_steps=2)
        plain_fit(world, 2, ev)
    assert sum("force_costs" in str(w.message) for w in said) == 1 and [r.step for r in ev.reports] == [2]


# ------------------------------------------------------------------ the stop on a speed-up monitor
def test_a_stop_on_a_speedup_monitor_stops_where_its_ratio_says_and_plot_replays_it(world, tmp_path, costs, capsys):
    with pytest.warns(UserWarning, match="must reach 5x the baseline"):
        stop = TrailingBaselineStop(monitor="speedup/ddtree@4/live", min_ratio=5, patience=2, verbose=False)
    ev = DrafterEvaluator(**engine_args(world, tmp_path, costs), max_steps=12, stop=stop)

    def scored(model, step):  # training waits for the snapshots of steps 2 and 4: their reports come at 3 and 5
        if step in (2, 4):
            wait_until(lambda: not ev.engine.runner._outbox.empty(), what=f"the report of step {step}")

    plain_fit(world, 12, ev, after_step=scored)
    reports = {r.step: r for r in RunFolder(ev.run.path).read_results().reports}
    assert stop.stop_reason is not None and "dflash: stopping at step 4: speedup/ddtree@4/live " in stop.stop_reason
    kept = reports[4].extra["speedup"]["ddtree@4/live"]
    assert f"speedup/ddtree@4/live {kept['ours'][0]:.2f} < 5 x baseline {kept['baseline'][0]:.2f}" in stop.stop_reason
    assert f"the ratio's 95% interval reaches {kept['ratio'][2]:.2f}" in stop.stop_reason
    assert max(reports) < 12  # training stopped
    assert cli_main(["plot", str(ev.run.path), "--baseline", str(world.baseline),
                     "--baseline-cache-dir", str(world.bc)]) == 0
    assert "the stop at step 4" in capsys.readouterr().out
    # the live reports (no results.jsonl line at hand) are drawn too: the threshold from their costs, in tau
    from dflash_callbacks.engine.live_tau_plot import live_tau_figure

    fig = live_tau_figure(ev.reports, ev.baseline_report, title="t", stop=stop, stop_step=4)
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    threshold = 5 * kept["baseline"][0]
    assert any(f"stop threshold (5 x baseline {kept['baseline'][0]:.2f} = {threshold:.2f} speed-up, drawn in tau)"
               in label for label in labels), labels


def test_a_speedup_monitor_without_costs_is_refused_naming_the_forms(world, tmp_path, capsys):
    stop = TrailingBaselineStop(monitor="speedup/ddtree@4/live", verbose=False)
    with pytest.raises(ValueError, match=r"no costs to predict it from: give its scoring costs=PATH .*the forms are "
                                         r"METHOD/AGGREGATE \(tau\) and speedup/METHOD/AGGREGATE"):
        DrafterEvaluator(**engine_args(world, tmp_path, None), stop=stop)
    with pytest.raises(ValueError, match=r"or speedup/METHOD/AGGREGATE, e.g. 'speedup/ddtree@8/live'"):
        TrailingBaselineStop(monitor="speed/ddtree@4/live")
    with pytest.raises(ValueError, match="judged on its ratio to the baseline's speed-up: give min_ratio"):
        TrailingBaselineStop(monitor="speedup/ddtree@4/live", min_delta=-0.1)
    code = cli_main(["watch", "--checkpoints", str(tmp_path), "--cache", str(world.cache), "--target",
                     str(world.target), "--baseline", str(world.baseline), "--budgets", "4", "--once",
                     "--monitor", "speedup/ddtree@4/live"])
    assert code == 2 and "needs --costs PATH" in capsys.readouterr().err
