import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from torch.utils.data import DataLoader

from dflash_callbacks import DFlashDrafter
from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.callbacks.host import LightningHost
from dflash_callbacks.engine.publisher import Publisher
from dflash_callbacks.engine.run_state import RunState
from dflash_callbacks.settings import EvalSettings
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences

from synthetic import build_world
from wandb_records import read_run


def test_offline_wandb_run_holds_keys_deltas_table_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    world = build_world(tmp_path / "world")
    torch.manual_seed(0)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    cb = DrafterEvalCallback(
        cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=4,
        scoring={"ddtree_budgets": [4], "device": "cpu"}, busy="queue", max_pending=4, dirpath=tmp_path / "dflash",
        baseline_cache_dir=tmp_path / "bc",
    )
    logger = WandbLogger(project="dflash-test", save_dir=str(tmp_path), offline=True)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=logger, callbacks=[cb], enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
    data = DataLoader(CacheSequences(world.cache), batch_size=1, collate_fn=collate_sequences)
    trainer.fit(module, data)
    import wandb
    wandb.finish()

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_run(run_dir)
    rows = [r for r in run["history"] if "dflash/vanilla/live/mean" in r]
    assert [r["dflash/step"] for r in rows] == [4, 8]
    assert [r["trainer/global_step"] for r in rows] == [4, 8]
    base = cb.baseline_report
    for row, report in zip(rows, cb.reports):
        for task in ("long", "short", "one_anchor", "mean"):
            ours = report.value("ddtree@4/live", task)
            assert row[f"dflash/ddtree@4/live/{task}"] == pytest.approx(ours)
            assert row[f"dflash/delta/ddtree@4/live/{task}"] == pytest.approx(ours - base.value("ddtree@4/live", task))
            assert row[f"dflash/ratio/ddtree@4/dense/{task}"] == pytest.approx(
                report.value("ddtree@4/dense", task) / base.value("ddtree@4/dense", task))
        assert row["dflash/live_table/_type"] == "table-file"
    table = json.loads((run_dir / "files" / rows[-1]["dflash/live_table/path"]).read_text())
    assert table["columns"][:5] == ["task", "vanilla live ours", "vanilla live baseline", "vanilla live delta",
                                    "vanilla live ratio"]
    assert [r[0] for r in table["data"]] == ["long", "short", "one_anchor", "mean"]
    # per report and method, the acceptance curve of ours and of the baseline, one line each
    curve = json.loads((run_dir / "files" / rows[-1]["dflash/curve/ddtree@4_table/path"]).read_text())
    series = {}
    assert curve["columns"] == ["step", "lineKey", "lineVal"]
    for x, key, y in curve["data"]:
        series.setdefault(key, []).append((x, y))
    assert sorted(series) == ["baseline", "ours"]
    depth = world.config.block_size - 1
    assert [x for x, _ in series["ours"]] == list(range(1, depth + 1))
    mean_curve = [sum(t["ddtree@4"]["curve"][d] for t in cb.reports[-1].tasks.values()) / 3 for d in range(depth)]
    assert [y for _, y in series["ours"]] == pytest.approx(mean_curve)
    # the run config tells two runs apart: cache and target head fingerprints, block sizes
    config = run["config"]["dflash"]
    assert config["cache_fingerprint"] == cb.reports[0].cache["fingerprint"]
    assert config["target_fingerprint"] == cb.reports[0].cache["target"] == base.cache["target"]
    assert config["block_size"] == config["drafter_block_size"] == world.config.block_size
    assert run["metrics"]["dflash/ddtree@4/live/mean"].step_metric == "dflash/step"
    best = max(r.value("ddtree@4/live") for r in cb.reports)
    assert run["summary"]["dflash/ddtree@4/live/mean"] == {"max": pytest.approx(best)}


def published_to_offline_wandb(tmp_path, prefix: str, reports_and_baselines) -> tuple[dict, list, list[bool]]:
    """Each (report, baseline) published under `prefix` to the offline W&B run of a Lightning WandbLogger, as
    the callback's publisher does: the run read back, the publisher's failures, what each publish returned."""
    import wandb

    logger = WandbLogger(project="dflash-test", save_dir=str(tmp_path), offline=True)
    trainer = pl.Trainer(logger=logger, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    failures = []
    host = LightningHost(trainer)
    settings = EvalSettings(tmp_path / "cache", tmp_path / "target", name=prefix, verbose=False)
    publisher = Publisher(settings, host, RunState(prefix, [], False), [], [], lambda: None)
    publisher.fail = failures.append
    publisher.start(RunFolder.create(tmp_path / "d", "r"), [])
    published = [publisher.write(report, base, 1.0) for report, base in reports_and_baselines]
    wandb.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    return read_run(run_dir), failures, published


def test_keys_first_seen_after_the_first_report_are_defined_with_their_summary(tmp_path, monkeypatch):
    """The baseline may come after the first report (a watcher that writes it late, a retried
    baseline): its baseline/delta/ratio keys first appear with the second report, and get the
    x axis and the max summary there too, not W&B's default (the last value)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    world = build_world(tmp_path / "world")
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), str(world.baseline),
                                         {"ddtree_budgets": [4], "device": "cpu"}, str(tmp_path / "bc")))
    baseline = service.baseline()
    other = DFlashDrafter(world.config)  # a fresh drafter: further from the target's text than the baseline
    reports = [service.score_folder(world.baseline), service.score_folder(world.baseline),
               service.score(world.config, other.state_dict())]
    for step, report in zip((4, 8, 12), reports):
        report.step, report.snapshot_id = step, f"{step:016d}"
    run, failures, _ = published_to_offline_wandb(tmp_path, "dflash", zip(reports, [None, baseline, baseline]))
    ratios = [report.value("ddtree@4/live") / baseline.value("ddtree@4/live") for report in reports[1:]]
    assert failures == [] and ratios[0] == 1.0 > ratios[1]  # the max is not the last value
    for key, best in [("dflash/ratio/ddtree@4/live/mean", 1.0), ("dflash/baseline/ddtree@4/live/long", None),
                      ("dflash/ddtree@4/live/mean", max(r.value("ddtree@4/live") for r in reports))]:
        assert run["metrics"][key].step_metric == "dflash/step" and run["metrics"][key].summary.max, key
        if best is not None:
            assert run["summary"][key] == {"max": pytest.approx(best)}, key


def test_keys_with_a_dot_keep_their_axis_and_best_value(tmp_path, monkeypatch):
    """A task name may hold '.' (`py3.11`), and so may the callback's name: W&B reads an
    unescaped '.' in define_metric as a nested path, and such keys got no max summary (the
    run table showed the last value as if it were the best)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    world = build_world(tmp_path / "world")
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), str(world.baseline),
                                         {"ddtree_budgets": [4], "device": "cpu"}, str(tmp_path / "bc")))
    reports = [service.score_folder(world.baseline) for _ in range(3)]
    for step, report in zip((4, 8, 12), reports):
        report.step, report.snapshot_id = step, f"{step:016d}"
        report.tasks = {("py3.11" if task == "long" else task): v for task, v in report.tasks.items()}
        report.intervals = None  # numbers edited by hand: no streaks for them to be checked against
        for numbers in (n for per_method in report.tasks.values() for n in per_method.values()):
            numbers.pop("streaks")
    reports[1].tasks["py3.11"]["vanilla"]["live"] += 0.5  # the best value is not the last one
    run, failures, published = published_to_offline_wandb(tmp_path, "eval.v2", ((r, None) for r in reports))
    assert failures == [] and all(published)
    best = reports[1].value("vanilla/live", "py3.11")
    assert best > reports[2].value("vanilla/live", "py3.11")
    assert run["summary"]["eval.v2/vanilla/live/py3.11"] == {"max": pytest.approx(best)}
    assert run["summary"]["eval.v2/vanilla/live/short"] == {"max": pytest.approx(reports[0].value("vanilla/live", "short"))}
    assert run["metrics"]["eval\\.v2/vanilla/live/py3\\.11"].step_metric == "eval\\.v2/step"
