"""The watchers' tracker flags (`engine/trackers/flags.py`): each flag gives its tracker, every mistake is
named at once, and nothing is written before the first report."""

from __future__ import annotations

import pytest

from dflash_callbacks.engine.trackers.flags import watcher_trackers


def test_the_flags_give_their_trackers_and_write_nothing_yet(tmp_path):
    assert watcher_trackers() == []
    tb, ml = watcher_trackers(tensorboard=str(tmp_path / "tb"), mlflow_uri="http://127.0.0.1:1",
                              mlflow_experiment="e", run_name="run-1")
    assert (tb.name, tb.log_dir) == ("tensorboard", tmp_path / "tb") and not (tmp_path / "tb").exists()
    assert (ml.name, ml.tracking_uri, ml.experiment, ml.run_id, ml.run_name) == (
        "mlflow", "http://127.0.0.1:1", "e", None, "run-1")
    (attached,) = watcher_trackers(mlflow_uri=f"sqlite:///{tmp_path / 'x.db'}", mlflow_run_id="abc")
    assert (attached.run_id, attached.experiment) == ("abc", None)
    assert list(tmp_path.iterdir()) == []  # not even a sqlite URI's database


def test_every_mistake_in_the_flags_at_once():
    with pytest.raises(ValueError) as e:
        watcher_trackers(tensorboard="", mlflow_experiment="e")
    assert str(e.value) == ("--tensorboard needs a folder; --mlflow-experiment and --mlflow-run-id need --mlflow-uri "
                            "URI (http://host:port, sqlite:///path, ...)")
    with pytest.raises(ValueError, match="--mlflow-uri needs --mlflow-experiment NAME .* or --mlflow-run-id ID"):
        watcher_trackers(mlflow_uri="http://127.0.0.1:1")
