"""`dflash-callbacks plot RUN`: the demo's picture for any run folder, from its results.jsonl and the
baseline's report (run.json's baseline, read from the baseline cache, or --baseline), with the stop's
rule and the step it stopped at, replayed on the reports as it decided while training."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.cli import main
from dflash_callbacks.engine.live_tau_plot import live_tau_figure

from loops import SCORING, plain_fit
from runs import run_dir, wait_until

from train_run import shared_world, world_paths

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> SimpleNamespace:
    """A plain loop's run, stopped by a stop that trails at every report judged (min_ratio 3, patience 2, judged
    from step 6): it acts at step 8 or later, where a stop of the default grace (0) acts earlier."""
    world = SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))
    root = tmp_path_factory.mktemp("plot")
    with pytest.warns(UserWarning, match="min_ratio=3"):
        stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=3, patience=2, grace_steps=6, verbose=False)
    evaluator = DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2,
                                 scoring=SCORING, dirpath=root / "d", baseline_cache_dir=root / "bc", verbose=False,
                                 stop=stop, max_steps=20, busy="queue", max_pending=10)

    def scored(model, step: int) -> None:  # each report comes back before the next step: the stop acts while it trains
        def published() -> bool:
            evaluator.step(step)  # a repeated step only publishes
            return any(report.step == step for report in evaluator.reports)

        if step % 2 == 0:
            wait_until(published, what=f"the report of step {step}")

    plain_fit(world, 20, evaluator, after_step=scored)
    return SimpleNamespace(world=world, root=root, folder=run_dir(root / "d"), evaluator=evaluator, stop=stop)


def test_plot_draws_a_run_with_its_baseline_and_the_step_its_stop_stopped_at(stopped_run, tmp_path, capsys):
    acted = int(re.search(r"stopping at step (\d+)", stopped_run.stop.stop_reason).group(1))
    out = tmp_path / "run.png"
    code = main(["plot", str(stopped_run.folder), "--out", str(out), "--baseline-cache-dir", str(stopped_run.root / "bc"),
                 "--monitor", "ddtree@4/live", "--min-ratio", "3", "--patience", "2", "--max-steps", "20"])
    said = capsys.readouterr().out
    assert code == 0 and out.read_bytes().startswith(PNG)
    reports = len(stopped_run.evaluator.reports)
    assert said.strip().endswith(f"plot: {reports} reports of {stopped_run.folder}, the stop at step {acted}: {out}")


def test_plot_takes_a_folder_of_runs_and_a_saved_baseline_report(stopped_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(stopped_run.folder, runs / stopped_run.folder.name)
    saved = tmp_path / "baseline.json"
    stopped_run.evaluator.baseline_report.to_json(saved)
    assert main(["plot", str(runs), "--baseline", str(saved)]) == 0
    said = capsys.readouterr().out
    assert (runs / stopped_run.folder.name / "live_tau.png").read_bytes().startswith(PNG)
    acted = int(re.search(r"stopping at step (\d+)", stopped_run.stop.stop_reason).group(1))
    assert f", the stop at step {acted}: " in said  # the run's own stop, as run.json records it


def test_plot_without_the_baseline_in_the_cache_draws_ours_and_says_why(stopped_run, tmp_path, capsys):
    assert main(["plot", str(stopped_run.folder), "--out", str(tmp_path / "p.png"),
                 "--baseline-cache-dir", str(tmp_path / "empty")]) == 0
    said = capsys.readouterr().err  # a diagnostic: stderr
    assert f"warning: plot: no report of the baseline {stopped_run.world.baseline} in the baseline cache" in said
    assert (tmp_path / "p.png").read_bytes().startswith(PNG)


def test_plot_refuses_what_it_can_not_draw_in_one_line_each(stopped_run, tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert f"error: {tmp_path} is not a run folder and holds none" in capsys.readouterr().err
    code = main(["plot", str(stopped_run.folder), "--monitor", "ddtree@8/live", "--out", str(tmp_path / "x.png")])
    assert code == 2 and capsys.readouterr().err.splitlines() == [
        "error: --monitor='ddtree@8/live', but the run scores only ['vanilla', 'ddtree@4']: monitor one of those; did "
        "you mean 'ddtree@4/live'?"]
    # a folder holding the callbacks' dirpath (the demo's runs/demo beside runs/demo/dflash): the one meant
    shutil.copytree(stopped_run.folder, tmp_path / "runs" / "dflash" / stopped_run.folder.name)
    assert main(["plot", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / 'runs'} is not a run folder and holds none; did you mean {tmp_path / 'runs' / 'dflash'}?"]
    # every problem at once
    code = main(["plot", str(stopped_run.folder), "--monitor", "ddtree@8/live", "--max-steps", "0", "--patience", "0",
                 "--baseline", str(tmp_path / "nope")])
    assert code == 2 and capsys.readouterr().err.splitlines() == [
        "error: --max-steps must be an integer >= 1; got 0",
        f"error: --baseline {tmp_path / 'nope'} does not exist: give a saved report JSON or a drafter folder",
        "error: patience must be an integer >= 1; got 0"]


def test_a_run_folder_records_what_plot_needs_and_plot_replays_the_runs_own_stop(stopped_run, tmp_path, capsys):
    """run.json records where the baseline's report was cached, the stop's settings and the run's last step: `plot
    RUN` alone draws the baseline (not looked for in the home cache), the stop as the run took it (its grace period
    too: not the earlier step a stop judging from step 0 acts at) and the projection out to step 20; a flag replaces one setting of the run's stop."""
    about = json.loads((stopped_run.folder / "run.json").read_text())
    assert about["baseline_cache_dir"] == str((stopped_run.root / "bc").resolve()) and about["max_steps"] == 20
    assert about["stops"] == [stopped_run.stop.settings.to_dict()]
    acted = int(re.search(r"stopping at step (\d+)", stopped_run.stop.stop_reason).group(1))
    assert acted >= 8  # judged from step 6, patience 2
    out = tmp_path / "own.png"
    assert main(["plot", str(stopped_run.folder), "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert said.err == "" and said.out.strip().endswith(f", the stop at step {acted}: {out}")
    assert main(["plot", str(stopped_run.folder), "--out", str(out), "--grace-steps", "0"]) == 0
    earlier = int(re.search(r"the stop at step (\d+)", capsys.readouterr().out).group(1))
    assert earlier < acted


def test_the_picture_is_drawn_out_to_the_last_step(stopped_run):
    """--max-steps (or the run's) sets how far the x-axis goes, with or without a projection to draw."""
    reports = stopped_run.evaluator.reports
    for stop in (None, stopped_run.stop):
        fig = live_tau_figure(reports, stopped_run.evaluator.baseline_report, title="t", stop=stop, horizon=40)
        assert fig.axes[0].get_xlim()[1] >= 40 > max(r.step for r in reports)


def test_a_folder_copied_back_without_run_json_is_drawn_against_a_baseline_drafter_folder(stopped_run, tmp_path,
                                                                                          capsys):
    """results.jsonl alone (copied back from a cluster) with --baseline DRAFTER_FOLDER: the baseline's report is
    found in the baseline cache by the last report's cache, target head and scoring settings (it ended in
    `internal error KeyError: 'basis'`)."""
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copy(stopped_run.folder / "results.jsonl", copied)
    code = main(["plot", str(copied), "--baseline", str(stopped_run.world.baseline), "--baseline-cache-dir",
                 str(stopped_run.root / "bc"), "--monitor", "ddtree@4/live", "--min-ratio", "3", "--patience", "2",
                 "--grace-steps", "6"])
    said = capsys.readouterr()
    assert code == 0 and said.err == "", said.err
    acted = int(re.search(r"stopping at step (\d+)", stopped_run.stop.stop_reason).group(1))
    assert said.out.strip().endswith(f", the stop at step {acted}: {copied / 'live_tau.png'}")
