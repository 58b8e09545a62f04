"""`dflash-callbacks plot RUN`: the demo's picture for any run folder, from its results.jsonl and the
baseline's report (run.json's baseline, read from the baseline cache, or --baseline), with the stop's
rule and the step it stopped at, replayed on the reports as it decided while training."""

from __future__ import annotations

import re
import shutil
from types import SimpleNamespace

import pytest

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.cli import main

from loops import SCORING, plain_fit
from runs import run_dir, wait_until

from train_run import shared_world, world_paths

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> SimpleNamespace:
    """A plain loop's run, stopped by a stop that trails at every report (min_ratio 3, patience 2)."""
    world = SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))
    root = tmp_path_factory.mktemp("plot")
    with pytest.warns(UserWarning, match="min_ratio=3"):
        stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=3, patience=2, verbose=False)
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
    assert (runs / stopped_run.folder.name / "live_tau.png").read_bytes().startswith(PNG) and "the stop" not in said


def test_plot_without_the_baseline_in_the_cache_draws_ours_and_says_why(stopped_run, tmp_path, capsys):
    assert main(["plot", str(stopped_run.folder), "--out", str(tmp_path / "p.png"),
                 "--baseline-cache-dir", str(tmp_path / "empty")]) == 0
    said = capsys.readouterr().out
    assert f"plot: no report of the baseline {stopped_run.world.baseline} in the baseline cache" in said
    assert (tmp_path / "p.png").read_bytes().startswith(PNG)


def test_plot_refuses_what_it_can_not_draw_in_one_line_each(stopped_run, tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert f"error: {tmp_path} is not a run folder and holds none" in capsys.readouterr().err
    code = main(["plot", str(stopped_run.folder), "--monitor", "ddtree@8/live", "--out", str(tmp_path / "x.png")])
    assert code == 2 and "error: --monitor ddtree@8/live: the run scores only ['vanilla', 'ddtree@4']" in \
        capsys.readouterr().err
