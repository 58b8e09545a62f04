"""MLflow as a destination of the reports (`engine/trackers/mlflow.py`), against a real tracking server on
127.0.0.1 (`mlflow server`, sqlite backend, started once for the file), read back with `MlflowClient`:
every key at every step with the value sent, the table and the plot as artifacts, no active run left to
the program; a run attached to by id is left as found; a server down from the start, killed mid-run and
brought back on its backend, or hung, loses nothing (the summary says what it missed, or that it got it
all in the end). Then the entry points, each on a real run, against results.jsonl: a plain loop's
reports through both trackers; Lightning's own TensorBoard and MLflow loggers, under the same names;
the transformers Trainer's own integrations (`report_to=["tensorboard", "mlflow"]`) as trackers, our
keys at our steps beside the Trainer's own, without a row of ours in its log history."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from transformers import Trainer, TrainerCallback, TrainingArguments

from dflash_callbacks import DrafterEvaluator
from dflash_callbacks.engine.trackers.delivery import Delivery
from dflash_callbacks.engine.trackers.flags import watcher_trackers
from dflash_callbacks.engine.trackers.mlflow import MlflowTracker, mlflow_name
from dflash_callbacks.engine.trackers.tensorboard import TensorBoardTracker
from dflash_callbacks.engine.trackers.trainer_integrations import calling_handler, trainer_trackers
from dflash_callbacks.scoring.report import EvalReport

from loops import LR, SCORING, DrafterModel, Sequences, one, plain_fit
from mlflow_server import MlflowServer, free_port
from runs import records
from tracker_reports import make_plot, read_events, report_keys, report_payload, scalars
from train_run import shared_world, world_paths


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> MlflowServer:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def plot(tmp_path_factory) -> Path:
    return make_plot(tmp_path_factory.mktemp("plot") / "plot.png")


@pytest.fixture
def live(server) -> MlflowServer:
    """The server, running (a test that killed it and failed midway leaves it down)."""
    if not server.running():
        server.start()
    return server


def experiment() -> str:
    return f"exp-{uuid.uuid4().hex[:8]}"


def history(client: MlflowClient, run_id: str, steps) -> tuple[dict, dict]:
    """(what the run holds, what was sent): {MLflow name: [(step, value)]} of every key of the reports."""
    sent: dict[str, list] = {}
    for step in steps:
        for key, value in report_payload(step)[0].items():
            sent.setdefault(mlflow_name(key), []).append((step, value))
    held = {name: sorted((m.step, m.value) for m in client.get_metric_history(run_id, name)) for name in sent}
    return held, sent


def table_of(client: MlflowClient, run_id: str, folder: Path) -> dict:
    """The run's one table, as MLflow keeps it (split JSON: columns and rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    return json.loads(Path(client.download_artifacts(run_id, "dflash/live_table.json", str(folder))).read_text())


def expected_table(steps) -> dict:
    """The tables of the reports of `steps`, one after the other, each row with its step first."""
    columns = ["step", *report_payload(steps[0])[1].columns]
    return {"columns": columns, "data": [[s, *row] for s in steps for row in report_payload(s)[1].rows]}


def test_every_key_and_step_reads_back_from_the_server_and_no_run_is_left_active(live, tmp_path, plot):
    name = experiment()
    tracker = MlflowTracker(live.url, name, run_name="watch")
    delivery = Delivery([tracker], pytest.fail)
    for step in (2, 4, 6):
        delivery.send(step, *report_payload(step))
    delivery.send_image("dflash/plot", plot)
    assert mlflow.active_run() is None  # the program's fluent API sees no run of ours
    assert delivery.finish() == []
    client = MlflowClient(live.url)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert run.info.run_id == tracker.run_id and run.info.run_name == "watch" and run.info.status == "FINISHED"
    held, sent = history(client, tracker.run_id, (2, 4, 6))
    assert held == sent and "dflash/ddtree4/live/py3.11" in held  # '@' dropped, as Lightning's MLFlowLogger does
    assert set(run.data.metrics) == set(sent)  # no other key
    assert table_of(client, tracker.run_id, tmp_path / "t") == expected_table((2, 4, 6))
    image = client.download_artifacts(tracker.run_id, "dflash/plot.png", str(tmp_path))
    assert Path(image).read_bytes() == plot.read_bytes()


def test_the_watchers_flags_reach_both_trackers(live, tmp_path):
    """--tensorboard DIR --mlflow-uri URI --mlflow-experiment NAME: the same keys at the same steps in both."""
    name = experiment()
    trackers = watcher_trackers(tensorboard=str(tmp_path / "tb"), mlflow_uri=live.url, mlflow_experiment=name,
                                run_name="run-1")
    delivery = Delivery(trackers, pytest.fail)
    for step in (5, 10):
        delivery.send(step, *report_payload(step))
    assert delivery.finish() == []
    held, sent = history(MlflowClient(live.url), trackers[1].run_id, (5, 10))
    assert held == sent and table_of(MlflowClient(live.url), trackers[1].run_id, tmp_path / "t") == expected_table((5, 10))
    logged = scalars(read_events(tmp_path / "tb"))
    assert {mlflow_name(k): [(s, pytest.approx(v, rel=1e-6)) for s, v in pairs] for k, pairs in logged.items()} == sent


def test_a_run_attached_to_by_id_gets_the_reports_and_is_left_running(live):
    client = MlflowClient(live.url)
    name = experiment()
    run_id = client.create_run(client.create_experiment(name)).info.run_id
    delivery = Delivery([MlflowTracker(live.url, name, run_id=run_id)], pytest.fail)
    for step in (3, 6):
        delivery.send(step, *report_payload(step))
    assert delivery.finish() == []
    held, sent = history(client, run_id, (3, 6))
    assert held == sent and client.get_run(run_id).info.status == "RUNNING"

    other = client.create_run(client.create_experiment(experiment())).info.run_id
    warnings: list[str] = []
    delivery = Delivery([MlflowTracker(live.url, name, run_id=other)], warnings.append)
    delivery.send(3, *report_payload(3))
    assert warnings[0].startswith(f"mlflow: step 3 not sent (ValueError: the MLflow run {other} is in the experiment")
    assert delivery.finish()[0].startswith("mlflow: 2 error(s); it lacks the reports of steps 3")
    assert client.get_run(other).data.metrics == {}


@pytest.mark.slow  # a kill: the server's restart takes 7 to 10 s on 2 busy cores
def test_a_server_killed_mid_run_loses_nothing_once_it_is_back(live, tmp_path):
    """Steps 2 and 4 reach the server; it is killed (SIGKILL): step 6 is a warning and an error, quickly;
    brought back on the same backend, step 8 brings 6 first: every key at every step, once."""
    name = experiment()
    tracker = MlflowTracker(live.url, name)
    warnings: list[str] = []
    delivery = Delivery([tracker], warnings.append)
    for step in (2, 4):
        delivery.send(step, *report_payload(step))
    live.kill()
    delivery.send(6, *report_payload(6))
    assert delivery.errors == {"mlflow": 1} and "Connection refused" in warnings[0]
    live.start()
    delivery.send(8, *report_payload(8))
    assert warnings[1:] == ["mlflow is back: sent the 2 item(s) it had missed (steps 6)"]
    assert delivery.finish() == ["mlflow: 1 error(s); every report reached it in the end"]
    client = MlflowClient(live.url)
    held, sent = history(client, tracker.run_id, (2, 4, 6, 8))
    assert held == sent
    assert table_of(client, tracker.run_id, tmp_path) == expected_table((2, 4, 6, 8))


def test_a_table_sent_again_after_a_try_that_appended_it_is_not_appended_twice(live, tmp_path):
    """The state a try leaves that appended step 4's rows and then failed (the server gone before it
    answered): the rows are in the table and the tracker knows its last try of step 4 failed. Sent again,
    step 4 is not appended a second time; step 6 is."""
    tracker = MlflowTracker(live.url, experiment())
    for step in (2, 4):
        tracker.log_table(*report_payload(step)[1], step)
    tracker._tried["dflash/live_table.json"] = {4}  # noqa: SLF001  (the failed try's mark)
    for step in (4, 6):
        tracker.log_table(*report_payload(step)[1], step)
    assert table_of(MlflowClient(live.url), tracker.run_id, tmp_path) == expected_table((2, 4, 6))
    assert tracker._tried["dflash/live_table.json"] == set()


def test_a_hung_server_costs_a_report_its_bounded_wait_and_loses_nothing(live):
    """The server stopped (SIGSTOP: connections are taken, nothing answers): the report waits timeout_s per
    try, not MLflow's minutes of retries; resumed, the next report brings it."""
    import time

    tracker = MlflowTracker(live.url, experiment(), timeout_s=1, retries=0)
    warnings: list[str] = []
    delivery = Delivery([tracker], warnings.append)
    delivery.send(2, *report_payload(2))
    live.pause(True)
    try:
        start = time.monotonic()
        delivery.send(4, *report_payload(4))
        waited = time.monotonic() - start
    finally:
        live.pause(False)
    assert delivery.errors == {"mlflow": 1} and 0.9 < waited < 5, waited
    delivery.send(6, *report_payload(6))
    assert delivery.finish() == ["mlflow: 1 error(s); every report reached it in the end"]
    held, sent = history(MlflowClient(live.url), tracker.run_id, (2, 4, 6))
    assert held == sent


def test_a_server_that_never_answers_is_named_with_every_step_it_lacks():
    """Nothing listens at the address: each report is a warning and an error, none waits MLflow's own
    minutes of retries, and the summary names every step."""
    delivery = Delivery([MlflowTracker(f"http://127.0.0.1:{free_port()}", "never")], lambda _: None)
    for step in (2, 4, 6):
        delivery.send(step, *report_payload(step))
    assert delivery.finish() == ["mlflow: 4 error(s); it lacks the reports of steps 2, 4, 6 and the tables of "
                                 "steps 2, 4, 6 (results.jsonl has them)"]


def test_wrong_arguments_are_refused():
    with pytest.raises(ValueError, match="needs an experiment to make the run in"):
        MlflowTracker("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="tracking_uri is required"):
        MlflowTracker(None, "x")
    with pytest.raises(ValueError, match="experiment must be a non-empty string"):
        MlflowTracker("http://127.0.0.1:1", "")
    with pytest.raises(ValueError, match="are both 'dflash/ab' in MLflow"):
        MlflowTracker("http://127.0.0.1:1", "x").log_metrics({"dflash/a@b": 1.0, "dflash/ab": 2.0}, 1)


# ---------------------------------------------------------------- the transformers Trainer's integrations


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    path = shared_world(tmp_path_factory.getbasetemp() / "reliability-world")
    return SimpleNamespace(path=path, **world_paths(path))


def test_a_plain_loops_reports_reach_both_trackers_with_every_key_and_step_of_results_jsonl(world, live, tmp_path):
    """A real plain loop (DrafterEvaluator, a snapshot every 2 steps, a baseline) whose `log=` hands each report
    to the delivery: TensorBoard and MLflow hold, for every line of results.jsonl, every number of its report
    and its comparison with the baseline, at its step, and nothing at another step."""
    name = experiment()
    delivery = Delivery([TensorBoardTracker(tmp_path / "tb"), MlflowTracker(live.url, name)], pytest.fail)
    ev = DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2,
                          scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False,
                          busy="queue", max_pending=8, wait_timeout=300, max_steps=4,
                          log=lambda metrics, step: delivery.send(step, metrics))
    plain_fit(world, 4, ev)
    assert delivery.finish() == [] and ev.errors == 0
    lines = records(tmp_path / "d")
    steps = [line["step"] for line in lines]
    assert steps == [2, 4]
    expected: dict[str, list] = {}
    for line in lines:
        for key, value in report_keys("dflash", EvalReport.from_dict(line), ev.baseline_report).items():
            expected.setdefault(key, []).append((line["step"], value))
    assert any(k.startswith("dflash/ratio/ddtree@4/") for k in expected)  # the comparison with the baseline too
    logged = scalars(read_events(tmp_path / "tb"))
    assert {k: logged[k] for k in expected} == {k: [(s, pytest.approx(v, rel=1e-6)) for s, v in pairs]
                                                for k, pairs in expected.items()}
    assert all([s for s, _ in pairs] == steps for pairs in logged.values())
    client = MlflowClient(live.url)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    held = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_name(k)))
            for k in expected}
    assert held == {k: [(s, pytest.approx(v)) for s, v in pairs] for k, pairs in expected.items()}
    assert set(run.data.metrics) == {mlflow_name(k) for k in logged}  # the same keys in both


def test_lightnings_own_tensorboard_and_mlflow_loggers_hold_the_same_keys_as_the_trackers(world, live, tmp_path):
    """Lightning reaches TensorBoard and MLflow through its own loggers: every number of every results.jsonl
    line at its step, under the names the trackers give them elsewhere (`mlflow_name`: the MLFlowLogger
    drops what MLflow refuses, as the tracker does), so a run's keys are the same under every entry point."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

    from dflash_callbacks.callbacks import DrafterEvalCallback
    from train_run import make_loader, make_module

    name = experiment()
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=2,
                             scoring=SCORING, busy="queue", max_pending=4, dirpath=tmp_path / "d",
                             baseline_cache_dir=tmp_path / "bc", verbose=False)
    loggers = [TensorBoardLogger(str(tmp_path / "tb"), name="", version=""),
               MLFlowLogger(experiment_name=name, tracking_uri=live.url)]
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=loggers, callbacks=[cb], enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
    with pytest.warns(RuntimeWarning, match="MLFlow only allows"):
        trainer.fit(make_module(world.path), make_loader(world.path))
    lines = records(tmp_path / "d")
    assert [line["step"] for line in lines] == [2, 4] and cb.errors == 0
    expected: dict[str, list] = {}
    for line in lines:
        for key, value in report_keys("dflash", EvalReport.from_dict(line), cb.baseline_report).items():
            expected.setdefault(key, []).append((line["step"], pytest.approx(value, rel=1e-6)))
    logged = scalars(read_events(tmp_path / "tb"))
    assert {k: logged[k] for k in expected} == expected
    client = MlflowClient(live.url)
    held = {k: sorted((m.step, m.value) for m in client.get_metric_history(loggers[1].run_id, mlflow_name(k)))
            for k in expected}
    assert held == expected


class Reports(TrainerCallback):
    """After the integrations (as ours is): the made reports of steps 2 and 4 at the end of those steps,
    and that of the last step in on_train_end, after the integrations let go of their writer and run. The
    trackers come from the handler that runs on_train_begin, found as the eval callback finds it."""

    def __init__(self, plot: Path):
        self.plot, self.warnings = plot, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.handler = calling_handler()
        self.trackers = trainer_trackers(self.handler)
        self.delivery = Delivery(self.trackers, self.warnings.append)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (2, 4):
            self.delivery.send(state.global_step, *report_payload(state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.delivery.send(state.global_step, *report_payload(state.global_step))
        self.delivery.send_image("dflash/plot", self.plot)
        self.lines = self.delivery.finish()


def trainer(world, out: Path, report_to: list[str], callbacks: list) -> Trainer:
    args = TrainingArguments(output_dir=str(out), max_steps=5, per_device_train_batch_size=1, learning_rate=LR,
                             logging_steps=1, report_to=report_to, save_strategy="no", use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=DrafterModel(world.config, world.target), args=args,
                   train_dataset=Sequences(world.cache, 20), data_collator=one, callbacks=callbacks)


def test_the_trainers_tensorboard_and_mlflow_get_our_keys_at_our_steps_beside_their_own(world, live, tmp_path,
                                                                                      monkeypatch, plot):
    name = experiment()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", live.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    reports = Reports(plot)
    run = trainer(world, tmp_path / "out", ["tensorboard", "mlflow"], [reports])
    run.train()
    assert reports.handler is run.callback_handler
    assert [t.name for t in reports.trackers] == ["tensorboard", "mlflow"]
    assert reports.warnings == [] and reports.lines == []

    rows = run.state.log_history  # the Trainer's own rows only: one per step, then its summary
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5] and len(rows) == 6
    assert not any(k.startswith("dflash/") for r in rows for k in r)

    ours = {k: [(s, float(np.float32(report_payload(s)[0][k]))) for s in (2, 4, 5)] for k in report_payload(2)[0]}
    events = read_events(tmp_path / "tb")
    logged = scalars(events)
    assert {k: v for k, v in logged.items() if k.startswith("dflash/")} == ours
    assert [s for s, _ in logged["train/loss"]] == [1, 2, 3, 4, 5]
    assert [t.step for t in events.Tensors("dflash/live_table/text_summary")] == [2, 4, 5]
    assert [i.step for i in events.Images("dflash/plot")] == [5]

    client = MlflowClient(live.url)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])  # no second run
    held, sent = history(client, run.info.run_id, (2, 4, 5))
    assert held == sent
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5]
    assert client.download_artifacts(run.info.run_id, "dflash/plot.png", str(tmp_path / "got"))
    assert table_of(client, run.info.run_id, tmp_path / "t") == expected_table((2, 4, 5))


def test_only_the_integrations_report_to_names_become_trackers(world, tmp_path):
    """Built, not trained: report_to=["tensorboard"] is the TensorBoard tracker alone, "none" is none."""
    assert [t.name for t in trainer_trackers(trainer(world, tmp_path / "a", ["tensorboard"], []).callback_handler)] \
        == ["tensorboard"]
    assert trainer_trackers(trainer(world, tmp_path / "b", [], []).callback_handler) == []
    with pytest.raises(TypeError, match="takes a Trainer's callback_handler"):
        trainer_trackers(object())
    with pytest.raises(RuntimeError, match="only from inside a TrainerCallback hook"):
        calling_handler()
