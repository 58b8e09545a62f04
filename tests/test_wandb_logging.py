import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from torch.utils.data import DataLoader

from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.training import CacheSequences, DFlashTrainingModule, collate_sequences

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
    # the run config tells two runs apart: cache fingerprint and block sizes
    config = run["config"]["dflash"]
    assert config["cache_fingerprint"] == cb.reports[0].cache["fingerprint"]
    assert config["block_size"] == config["drafter_block_size"] == world.config.block_size
    assert run["metrics"]["dflash/ddtree@4/live/mean"].step_metric == "dflash/step"
    best = max(r.value("ddtree@4/live") for r in cb.reports)
    assert run["summary"]["dflash/ddtree@4/live/mean"] == {"max": pytest.approx(best)}
