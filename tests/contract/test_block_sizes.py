"""A second block size in one run, end to end: `scoring.block_sizes=[3]` scores every method again at
block 3 (a drafter trained at 6 served with num_speculative_tokens 2), each a method of its own,
`METHOD:b3`. Its numbers reach results.jsonl, the loggers and W&B under their own keys, with paired
intervals against the baseline scored the same way; the stop monitors one of them; `compare` shows
both block sizes. One entry in ScoringConfig, nothing else to add."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from torch.utils.data import DataLoader

from dflash_callbacks.callbacks import DrafterEvalCallback, TrailingBaselineStop
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.service import PreflightError

from adapters import ADAPTERS
from runs import records, run_dir
from synthetic import build_world
from train_run import shared_world
from wandb_records import read_run

SCORING = {"ddtree_budgets": [4], "block_sizes": [3], "device": "cpu"}
METHODS = ["vanilla", "ddtree@4", "vanilla:b3", "ddtree@4:b3"]


def test_a_second_block_size_runs_through_reports_loggers_wandb_the_stop_and_compare(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    world = build_world(tmp_path / "world")
    torch.manual_seed(0)
    logged = []

    class Rows(pl.loggers.Logger):  # every logged row, as any Lightning logger gets it
        name, version, experiment = "rows", 0, None

        def log_metrics(self, metrics, step=None):
            logged.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    cb = DrafterEvalCallback(cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=4,
                             scoring=SCORING, busy="queue", max_pending=4, dirpath=tmp_path / "dflash",
                             baseline_cache_dir=tmp_path / "bc", verbose=False)
    stop = TrailingBaselineStop(monitor="ddtree@4:b3/dense", min_ratio=0.5, patience=5, verbose=False)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", callbacks=[cb, stop], enable_progress_bar=False,
                         logger=[Rows(), WandbLogger(project="dflash-test", save_dir=str(tmp_path), offline=True)],
                         enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(DFlashTrainingModule(world.config, world.target, lr=3e-3),
                DataLoader(CacheSequences(world.cache), batch_size=1, collate_fn=collate_sequences))
    import wandb

    wandb.finish()

    # results.jsonl: each report holds both block sizes, the smaller bounded by its own block
    reports = [EvalReport.from_dict(r) for r in records(tmp_path / "dflash") if "tasks" in r]
    assert [r.step for r in reports] == [4, 8] and all(r.methods == METHODS for r in reports)
    assert reports[0].family["proposals"] == {"6": 5, "3": 2} and reports[0].max_tau("ddtree@4:b3") == 3
    assert all(t["ddtree@4:b3"]["live"] <= 3 for r in reports for t in r.tasks.values())
    assert cb.baseline_report.methods == METHODS
    # the loggers and W&B: the same keys as any method, paired intervals included
    rows = [m for step, m in logged if "dflash/step" in m]
    base = cb.baseline_report
    assert len(rows) == len(reports)
    for row, report in zip(rows, reports):
        assert row["dflash/ddtree@4:b3/live/mean"] == pytest.approx(report.value("ddtree@4:b3/live"))
        assert row["dflash/ratio/ddtree@4:b3/live/mean"] == pytest.approx(
            report.value("ddtree@4:b3/live") / base.value("ddtree@4:b3/live"))
        assert row["dflash/baseline/vanilla:b3/dense/mean"] == pytest.approx(base.value("vanilla:b3/dense"))
        assert row["dflash/ratio/ddtree@4:b3/live/mean_lo"] <= row["dflash/ratio/ddtree@4:b3/live/mean"] <= \
            row["dflash/ratio/ddtree@4:b3/live/mean_hi"]
    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = [r for r in read_run(wandb_dir)["history"] if "dflash/ddtree@4:b3/live/mean" in r]
    assert [r["dflash/ddtree@4:b3/live/mean"] for r in history] == pytest.approx(
        [r.value("ddtree@4:b3/live") for r in reports])
    # the stop follows the monitored block size's number
    assert stop.history == [(r.step, pytest.approx(r.value("ddtree@4:b3/dense"))) for r in reports]
    # compare: both block sizes, a verdict for each
    assert cli_main(["compare", str(run_dir(tmp_path / "dflash") / "results.jsonl"),
                     str(tmp_path / "baseline.json")]) == 2  # no such file yet: refused
    cb.baseline_report.to_json(tmp_path / "baseline.json")
    capsys.readouterr()
    assert cli_main(["compare", str(run_dir(tmp_path / "dflash") / "results.jsonl"),
                     str(tmp_path / "baseline.json")]) == 0
    out = capsys.readouterr().out
    assert "ddtree@4 ours" in out and "ddtree@4:b3 ours" in out
    assert "ddtree@4 live:" in out and "ddtree@4:b3 live:" in out


RUN_BLOCK = ("block_sizes holds 6, but 6 is already the run's block (the drafter's block size, as scoring.block_size "
             "is unset): every method is scored at it already; leave 6 out of block_sizes")


@pytest.mark.parametrize("entry", list(ADAPTERS))
def test_block_sizes_holding_the_drafters_own_block_is_refused_by_every_adapter_before_training(entry, tmp_path,
                                                                                              tmp_path_factory):
    """A user listing the blocks vLLM serves at includes the trained one (6, the synthetic drafter's), with
    block_size unset: refused in one line before the first step, as an explicit block_size is, never a run of
    error lines (each report then lacked the `:b6` methods the basis promised)."""
    adapter = ADAPTERS[entry](shared_world(tmp_path_factory.getbasetemp() / "reliability-world"))
    evaluation = adapter.evaluation(tmp_path, baseline=adapter.paths.baseline,
                                    scoring={"ddtree_budgets": [4], "block_sizes": [6, 3], "device": "cpu"})
    with pytest.raises(PreflightError) as refused:
        adapter.train(evaluation, tmp_path / "out", 4)
    lines = [line.strip() for line in str(refused.value).splitlines()[1:]]
    assert lines == [RUN_BLOCK + " (its methods are the ones without :b6)"]
    assert not (tmp_path / "d").exists()


def test_score_refuses_block_sizes_holding_the_drafters_own_block_before_scoring_anything(tmp_path, capsys):
    """`score --block-sizes 6` exited 0 and dropped the `:b6` methods; `--block-sizes 6,3` scored the baseline for
    a minute first. Both: one line, exit status 2, nothing scored (the baseline cache stays empty); an explicit
    --block-size 6 beside them is the same line, naming scoring.block_size."""
    world = build_world(tmp_path / "world")
    base = ["score", "--drafter", str(world.baseline), "--cache", str(world.cache), "--target", str(world.target),
            "--baseline", str(world.baseline), "--baseline-cache-dir", str(tmp_path / "bc"), "--budgets", "4",
            "--device", "cpu"]
    for sizes in ("6", "6,3"):
        assert cli_main([*base, "--block-sizes", sizes]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {RUN_BLOCK} (its methods are the ones without :b6)"]
    assert not (tmp_path / "bc").exists()
    assert cli_main([*base, "--block-sizes", "6,3", "--block-size", "6"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: block_sizes holds 6, but 6 is already the run's block (scoring.block_size): every method is scored at "
        "it already; leave 6 out of block_sizes (its methods are the ones without :b6)"]
