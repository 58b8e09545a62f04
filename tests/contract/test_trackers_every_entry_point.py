"""TensorBoard and MLflow through every entry point, read back from what they wrote: the plain loop's
`trackers=`, the transformers Trainer's own `report_to` integrations, `watch --checkpoints --tensorboard/--mlflow-uri`, and `watch --dir` (the external runner:
the training process's trackers get what the watcher scored). Every report's keys at its step, with the
values the `log=` functions got (results.jsonl's numbers), the per-task table, the live-tau plot at the
end. A tracker that fails costs warnings, never the run nor the engine's error count, and gets what it
missed once it is back. Lightning reaches them through its own TensorBoardLogger and MLFlowLogger:
test_trackers_mlflow.py::test_lightnings_own_tensorboard_and_mlflow_loggers_hold_the_same_keys_as_the_trackers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import subprocess
import sys

import numpy as np
import pytest

from dflash_callbacks import DrafterEvaluator, MlflowTracker, TensorBoardTracker
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.hf import DrafterEvalTrainerCallback
from dflash_callbacks.model import DFlashDrafter, save_drafter

from loops import SCORING, hf_fit, plain_fit
from runs import records
from tracker_reports import read_events, scalars
from train_run import shared_world, world_paths


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """MLflow's sqlite store keeps a run's artifacts in ./mlruns: the test's folder, not the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    path = shared_world(tmp_path_factory.getbasetemp() / "reliability-world")
    return SimpleNamespace(path=path, **world_paths(path))


def engine_args(world, tmp_path: Path) -> dict:
    return dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2, scoring=SCORING,
                dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False, busy="queue",
                max_pending=8, wait_timeout=300)


def as_float32(logged: list[tuple[int, dict]]) -> dict[str, list[tuple[int, float]]]:
    """What the `log=` function got, as TensorBoard keeps it (float32), by key."""
    out: dict[str, list] = {}
    for step, metrics in logged:
        for key, value in metrics.items():
            out.setdefault(key, []).append((step, float(np.float32(value))))
    return out


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def every_artifact(client, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= every_artifact(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_a_plain_loop_sends_every_report_to_tensorboard_and_mlflow(world, tmp_path):
    """`trackers=[TensorBoardTracker(dir), MlflowTracker(uri, experiment)]`: every key of every report at its
    step, as `log=` got it; the table at each step; the plot once, at the end."""
    from mlflow.tracking import MlflowClient

    logged: list[tuple[int, dict]] = []
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow = MlflowTracker(uri, experiment="loop", run_name="loop-run")
    ev = DrafterEvaluator(**engine_args(world, tmp_path), max_steps=6, log=lambda m, s: logged.append((s, dict(m))),
                          trackers=[TensorBoardTracker(tmp_path / "tb"), mlflow])
    plain_fit(world, 6, ev)
    assert [r.step for r in ev.reports] == [2, 4, 6] and ev.errors == 0
    assert [s for s, _ in logged] == [2, 4, 6]
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6]

    events = read_events(tmp_path / "tb")
    assert scalars(events) == as_float32(logged)
    assert "dflash/ratio/ddtree@4/live/mean" in scalars(events)
    assert [t.step for t in events.Tensors("dflash/live_table/text_summary")] == [2, 4, 6]
    table = events.Tensors("dflash/live_table/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert all(task in table for task in ev.reports[-1].tasks)
    (image,) = events.Images("dflash/plot")
    assert image.step == 6 and image.width > 300
    assert (tmp_path / "d").glob("*/live_tau.png")

    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("loop").experiment_id])
    assert run.info.run_name == "loop-run"
    for key in ("dflash/ddtree@4/live/mean", "dflash/vanilla/live/mean", "dflash/ratio/ddtree@4/live/mean"):
        expected = [(s, m[key]) for s, m in logged]
        got = mlflow_history(uri, run.info.run_id, key.replace("@", ""))  # MLflow's names: '@' is not allowed
        assert [s for s, _ in got] == [2, 4, 6] and np.allclose([v for _, v in got], [v for _, v in expected])
    artifacts = every_artifact(MlflowClient(uri), run.info.run_id)
    assert any("live_table" in a for a in artifacts) and any("plot" in a for a in artifacts), artifacts


class Flaky:
    """A tracker of the user's own that refuses its first `failures` reports (a server still starting)."""

    name = "flaky"

    def __init__(self, failures: int):
        self.failures, self.got, self.closed = failures, [], False

    def log_metrics(self, metrics, step):
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("the server is still starting")
        self.got.append(step)

    def log_table(self, name, columns, rows, step):
        pass

    def log_image(self, name, path):
        assert Path(path).is_file()

    def close(self):
        self.closed = True


def test_a_tracker_that_fails_costs_warnings_never_the_run_and_gets_what_it_missed(world, tmp_path):
    flaky = Flaky(failures=2)
    ev = DrafterEvaluator(**engine_args(world, tmp_path), max_steps=6, trackers=[flaky])
    with pytest.warns(UserWarning) as said:
        plain_fit(world, 6, ev)
    lines = [str(w.message) for w in said]
    assert sum("flaky: step 2 not sent (ConnectionError: the server is still starting)" in line for line in lines) == 2
    assert any("flaky is back: sent the" in line and "(steps 2, 4)" in line for line in lines), lines
    assert any("flaky: 2 error(s); every report reached it in the end" in line for line in lines), lines
    assert flaky.got == [2, 4, 6] and flaky.closed
    assert ev.errors == 0 and [r.step for r in ev.reports] == [2, 4, 6]  # a tracker's failure is not the run's


def test_trackers_that_are_not_trackers_are_refused_when_the_evaluator_is_made(world, tmp_path):
    with pytest.raises(TypeError, match="trackers: each needs name, log_metrics"):
        DrafterEvaluator(**engine_args(world, tmp_path), trackers=[print])
    with pytest.raises(ValueError, match=r"trackers: two have one name .*\['tensorboard', 'tensorboard'\]"):
        DrafterEvaluator(**engine_args(world, tmp_path),
                         trackers=[TensorBoardTracker(tmp_path / "a"), TensorBoardTracker(tmp_path / "b")])


def test_the_trainers_own_tensorboard_integration_gets_our_keys_in_its_folder(world, tmp_path, monkeypatch):
    """report_to="tensorboard": the Trainer's TensorBoardCallback writes its loss; ours go through its
    writer into its folder, at the snapshot's steps, beside the Trainer's own."""
    logged: list[tuple[int, dict]] = []
    cb = DrafterEvalTrainerCallback(**{**engine_args(world, tmp_path), "busy": "queue"},
                                    log=lambda m, s: logged.append((s, dict(m))))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # the callback's folder (default: under out/)
    hf_fit(world, tmp_path / "out", 5, [cb], report_to="tensorboard", logging_steps=1)
    assert [r.step for r in cb.reports] == [2, 4, 5]
    events = read_events(tmp_path / "tb")
    found = scalars(events)
    assert [s for s, _ in found["train/loss"]] == [1, 2, 3, 4, 5]  # the Trainer's own rows
    ours = {k: v for k, v in found.items() if k.startswith("dflash/")}
    assert ours == as_float32(logged)
    assert [t.step for t in events.Tensors("dflash/live_table/text_summary")] == [2, 4, 5]
    assert [i.step for i in events.Images("dflash/plot")] == [5]


def test_watch_checkpoints_sends_its_reports_to_the_tensorboard_and_mlflow_flags(world, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "ckpts"
    for step in (2, 4):
        save_drafter(root / f"checkpoint-{step}", world.config, DFlashDrafter(world.config).state_dict())
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = cli_main(["watch", "--checkpoints", str(root), "--cache", str(world.cache), "--target", str(world.target),
                     "--budgets", "4", "--device", "cpu", "--once", "--settle-seconds", "0",
                     "--tensorboard", str(tmp_path / "tb"), "--mlflow-uri", uri, "--mlflow-experiment", "watched"])
    assert code == 0, capsys.readouterr()
    reports = {r.step: r.value("ddtree@4/live") for r in RunFolder(root / "dflash-eval").read_results().reports}
    assert sorted(reports) == [2, 4]
    tb = scalars(read_events(tmp_path / "tb"))["dflash/ddtree@4/live/mean"]
    assert tb == [(s, float(np.float32(reports[s]))) for s in (2, 4)]
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("watched").experiment_id])
    assert run.info.run_name == "dflash-eval"
    ml = mlflow_history(uri, run.info.run_id, "dflash/ddtree4/live/mean")
    assert [s for s, _ in ml] == [2, 4] and np.allclose([v for _, v in ml], [reports[s] for s in (2, 4)])


def test_the_watchers_tracker_flags_are_checked_before_anything_is_scored(world, tmp_path, capsys):
    code = cli_main(["watch", "--checkpoints", str(tmp_path), "--cache", str(world.cache), "--target",
                     str(world.target), "--once", "--mlflow-experiment", "x"])
    assert code == 2
    assert "--mlflow-experiment and --mlflow-run-id need --mlflow-uri URI" in capsys.readouterr().err


def test_with_the_external_runner_the_training_process_trackers_get_what_watch_dir_scored(world, tmp_path):
    """`runner="external"`: a `watch --dir` process scores the snapshots; the loop's `trackers=` get each
    report at its step, with the numbers results.jsonl holds."""
    logged: list[tuple[int, dict]] = []
    (tmp_path / "d").mkdir()
    watcher = subprocess.Popen([sys.executable, "-m", "dflash_callbacks.cli", "watch", "--dir", str(tmp_path / "d"),
                                "--cache", str(world.cache), "--target", str(world.target), "--budgets", "4",
                                "--device", "cpu", "--poll-seconds", "0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ev = DrafterEvaluator(**{**engine_args(world, tmp_path), "baseline": None}, runner="external", keep_last=4,
                              max_steps=4, log=lambda m, s: logged.append((s, dict(m))),
                              trackers=[TensorBoardTracker(tmp_path / "tb")])
        plain_fit(world, 4, ev)
    finally:
        watcher.kill()
        watcher.wait()
    assert [r.step for r in ev.reports] == [2, 4] and ev.errors == 0
    assert scalars(read_events(tmp_path / "tb")) == as_float32(logged)
    values = {r.step: r.value("ddtree@4/live") for r in RunFolder(ev.run.path).read_results().reports}
    assert [(s, m["dflash/ddtree@4/live/mean"]) for s, m in logged] == [(s, values[s]) for s in (2, 4)]
