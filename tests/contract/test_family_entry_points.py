"""Every entry point with a drafter of each family beside DFlash (DFlash 2, DSpark, Domino, JetSpec, DFlare) on the
toy world: Lightning (`DrafterEvalCallback` + `TrailingBaselineStop`), the plain loop (`DrafterEvaluator`), the
transformers Trainer (`DrafterEvalTrainerCallback`), `watch --checkpoints` on the folders the family's trainer
saves (speculators' for DFlash 2 and DSpark, SpecForge's export for Domino, Automodel's consolidated export for
JetSpec, AngelSlim's save_pretrained folder for DFlare), `score` and `compare`. Each scores against a test-only
toy baseline of the same family (`toy_families.toy_family_baselines`), a DFlash 2 drafter also against the
shipped DFlash toy baseline, a DFlare one against a JetSpec baseline: every report names its family and carries
its intervals, the stop decides on a monitor the family scores, W&B gets the keys, where the two sides' families
differ `score`, `compare`, the table and the demo's line say which is which, and a JetSpec checkpoint's causality
mismatch is said in one line before scoring."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from dflash_callbacks import DrafterEvalCallback, DrafterEvaluator, DrafterEvalTrainerCallback, TrailingBaselineStop
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.demos.demo import report_line
from dflash_callbacks.demos.toy.world import toy_baseline_path, toy_target_path
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences
from dflash_callbacks.model import build_drafter
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.table import comparison_table
from dflash_callbacks.scoring.service import PreflightError

from dflash_callbacks.watch.checkpoint_files import hf_folder

from loops import hf_fit, plain_fit
from runs import assert_clean, run_dir
from toy_families import (FAMILY_SETTINGS, SPECULATORS_TEMPLATE, family_config, monitor, save_checkpoint, scoring,
                          scoring_flags, step_folder, train)
from wandb_records import read_run

FAMILIES = list(FAMILY_SETTINGS)
LR = 1e-5  # the drafter in training stays well behind its baseline: the stop decides within a few reports
MAX_STEPS = 200  # a bound, not a length: the stop ends training after a few reports (about step 20-40)
STEP_SECONDS = 0.1  # a training step as slow as this: reports (about a second each) arrive while it trains
TARGET = toy_target_path()


class SlowSteps(pl.Callback):
    """Each Lightning step takes STEP_SECONDS at least, as a real one takes longer than scoring's share."""

    def on_train_batch_end(self, *args) -> None:
        time.sleep(STEP_SECONDS)


def slow_trainer_steps():
    """The same for the transformers Trainer."""
    from transformers import TrainerCallback

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(STEP_SECONDS)

    return Slow()


def evaluation(family: str, tmp_path: Path, toy_cache_dir: Path, baseline: Path, **more) -> dict:
    """The settings every adapter takes: a report every 2 steps against `baseline`, scored as the family scores."""
    return dict(cache=toy_cache_dir, target=TARGET, baseline=baseline, every_n_steps=2, scoring=scoring(family),
                dirpath=tmp_path / "eval", baseline_cache_dir=tmp_path / "bc", verbose=False, **more)


MIN_RATIO = {"jetspec": 0.95}
"""The stop's bound where 0.9 is not decisive: the toy JetSpec baseline (block-causal, one layer) reaches ddtree@4
1.41 where the others reach 1.45 to 1.59, and a drafter in training sits at 0.85 to 0.9 of it, inside 0.9's
interval."""


def stop(family: str) -> TrailingBaselineStop:
    return TrailingBaselineStop(monitor=monitor(family), min_ratio=MIN_RATIO.get(family, 0.9), patience=2,
                                verbose=False)


def check_reports(reports: list[EvalReport], baseline: EvalReport, family: str, baseline_family: str | None = None):
    """Each report (and the baseline's) carries its intervals and reads back strictly; ours name their family,
    its settings and the tokens its block proposes, the monitored number within the family's bound; the
    baseline's report names its family."""
    assert reports, "no report"
    for report in reports + [baseline]:
        assert report.intervals is not None and report.scorer_version is not None
        EvalReport.from_dict(json.loads(report.to_json()))  # the strict reader takes it back
    for report in reports:
        assert report.family["name"] == family
        assert (report.family["settings"] is None) == (FAMILY_SETTINGS[family] is None)
        assert report.family["proposals"] == {"8": 8 if family == "dspark" else 7}
        assert 1 <= report.value(monitor(family)) <= report.max_tau(monitor(family).split("/")[0])
    assert baseline.family["name"] == (baseline_family or family)


# ---------------------------------------------------------------- Lightning


@pytest.mark.parametrize("family", FAMILIES)
def test_lightning_trains_scores_and_stops_a_drafter_of_each_family(family, tmp_path, toy_cache_dir,
                                                                  toy_training_cache_dir, toy_family_baselines):
    torch.manual_seed(0)
    module = DFlashTrainingModule(family_config(family), TARGET, lr=LR, blocks_per_sequence=4)
    cb = DrafterEvalCallback(**evaluation(family, tmp_path, toy_cache_dir, toy_family_baselines[family]))
    stop_cb = stop(family)
    data = DataLoader(CacheSequences(toy_training_cache_dir), batch_size=1, collate_fn=collate_sequences)
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", logger=False, callbacks=[cb, stop_cb, SlowSteps()],
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, data)
    assert cb.errors == 0
    check_reports(cb.reports, cb.baseline_report, family)
    assert stop_cb.stop_reason is not None and trainer.global_step < MAX_STEPS, [r.value(monitor(family)) for r in cb.reports]
    assert f"{monitor(family)} " in stop_cb.stop_reason
    assert_clean(tmp_path / "eval", cb.reports)


# ---------------------------------------------------------------- the plain loop


def world_of(family: str, training_data: Path):
    """What `loops.plain_fit` and `loops.hf_fit` train: the family's toy drafter on the toy training data."""
    from types import SimpleNamespace

    return SimpleNamespace(config=family_config(family), target=TARGET, cache=training_data)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plain_loop_scores_and_stops_a_drafter_of_each_family(family, tmp_path, toy_cache_dir,
                                                                toy_training_cache_dir, toy_family_baselines,
                                                                monkeypatch):
    monkeypatch.setattr("loops.LR", LR)
    logged = []
    evaluator = DrafterEvaluator(**evaluation(family, tmp_path, toy_cache_dir, toy_family_baselines[family]),
                                 stop=stop(family), max_steps=MAX_STEPS, log=lambda metrics, step: logged.append(step))
    plain_fit(world_of(family, toy_training_cache_dir), MAX_STEPS, evaluator,
              after_step=lambda model, step: time.sleep(STEP_SECONDS))
    assert evaluator.errors == 0 and evaluator.should_stop and evaluator.stop_reason is not None
    check_reports(evaluator.reports, evaluator.baseline_report, family)
    assert logged == [r.step for r in evaluator.reports] and max(logged) < MAX_STEPS
    assert_clean(tmp_path / "eval", evaluator.reports)


def test_ddtree_by_default_is_refused_for_a_family_that_scores_none_naming_the_fix(tmp_path, toy_cache_dir,
                                                                                 toy_family_baselines):
    """The adapters' default scoring (ddtree@4, ddtree@8) is refused for a DSpark drafter before the first step,
    in one line that names the fix; the same evaluation without DDTree attaches."""
    drafter = build_drafter(family_config("dspark"))
    settings = evaluation("dspark", tmp_path, toy_cache_dir, toy_family_baselines["dspark"])
    settings.pop("scoring")
    with pytest.raises(PreflightError, match=re.escape(
            "ddtree@N can not be scored for a DSpark drafter: DSpark's Markov head makes each slot's distribution "
            "depend on the token drafted before it") + r".*score it without DDTree \(scoring.ddtree_budgets=\[\]\) and "
            r"monitor vanilla or top@k \(e.g. the stop's monitor='vanilla/live'\)"):
        DrafterEvaluator(**settings, scoring={"device": "cpu"}).attach(drafter, torch.optim.SGD(drafter.parameters(),
                                                                                                lr=0.1))
    assert not (tmp_path / "eval").exists()
    evaluator = DrafterEvaluator(**settings, scoring=scoring("dspark"), stop=stop("dspark"))
    evaluator.attach(drafter, torch.optim.SGD(drafter.parameters(), lr=0.1))
    evaluator.close()


# ---------------------------------------------------------------- the transformers Trainer


@pytest.mark.parametrize("family", FAMILIES)
def test_the_transformers_trainer_scores_and_stops_a_drafter_of_each_family(family, tmp_path, toy_cache_dir,
                                                                          toy_training_cache_dir,
                                                                          toy_family_baselines, monkeypatch):
    monkeypatch.setattr("loops.LR", LR)
    cb = DrafterEvalTrainerCallback(**evaluation(family, tmp_path, toy_cache_dir, toy_family_baselines[family]),
                                    stop=stop(family))
    trainer, _ = hf_fit(world_of(family, toy_training_cache_dir), tmp_path / "hf", MAX_STEPS, [cb, slow_trainer_steps()])
    assert cb.errors == 0 and cb.stop_reason is not None and trainer.state.global_step < MAX_STEPS
    check_reports(cb.reports, cb.baseline_report, family)
    assert_clean(tmp_path / "eval", cb.reports)


# ---------------------------------------------------------------- watch --checkpoints, score, compare


def watched(family: str, tmp_path: Path, toy_training_cache_dir: Path) -> Path:
    """Checkpoints at steps 2, 4, 6 as the family's trainer saves them (speculators', SpecForge's export,
    Automodel's consolidated export inside the step folder, AngelSlim's save_pretrained folder)."""
    root = tmp_path / "ckpts"
    config = family_config(family)
    for step in (2, 4, 6):
        save_checkpoint(root / step_folder(family, step), config,
                        train(config, toy_training_cache_dir, step, LR).state_dict())
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_watch_checkpoints_scores_each_familys_trainer_folders_stops_and_logs_to_wandb(
        family, tmp_path, toy_cache_dir, toy_training_cache_dir, toy_family_baselines, capsys):
    root = watched(family, tmp_path, toy_training_cache_dir)
    if family in SPECULATORS_TEMPLATE:
        assert json.loads((root / "checkpoint-2" / "config.json").read_text())["speculators_model_type"] == family
    args = ["watch", "--checkpoints", str(root), "--cache", str(toy_cache_dir), "--target", str(TARGET),
            "--baseline", str(toy_family_baselines[family]), "--baseline-cache-dir", str(tmp_path / "bc"),
            *scoring_flags(family), "--once",
            "--settle-seconds", "0", "--monitor", monitor(family), "--min-ratio", str(stop(family).min_ratio),
            "--patience", "2", "--wandb-project", "families"]
    assert cli_main(args) == 0, capsys.readouterr().err
    said = [line for line in capsys.readouterr().err.splitlines() if "JetSpec attention:" in line]
    assert len(said) == 2 * (family == "jetspec"), said  # ours and the baseline: as Automodel saves them
    assert all(line.endswith("scoring.attentions=['vllm'] scores both") for line in said)  # scored: trained
    out = root / "dflash-eval"
    reports = [EvalReport.from_dict(json.loads(line)) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r.step for r in reports] == [2, 4, 6]
    baseline = EvalReport.load(next((tmp_path / "bc").glob("baseline-*.json")))
    check_reports(reports, baseline, family)
    decision = json.loads((out / "STOP.json").read_text())
    assert decision["stop"] is True and monitor(family) in decision["reason"]

    (run,) = (out / "wandb").glob("offline-run-*")
    rows = [r for r in read_run(run)["history"] if f"dflash/{monitor(family)}/mean" in r]
    assert [r["dflash/step"] for r in rows] == [2, 4, 6]
    assert [r[f"dflash/{monitor(family)}/mean"] for r in rows] == [r.value(monitor(family)) for r in reports]
    assert all(f"dflash/ratio/{monitor(family)}/mean" in r for r in rows)

    # `score` of a checkpoint equals the watcher's report of it; `compare` reads the watcher's results back
    ours, base = tmp_path / "ours.json", tmp_path / "base.json"
    assert cli_main(["score", "--drafter", str(hf_folder(root / step_folder(family, 4))), "--cache", str(toy_cache_dir),
                     "--target", str(TARGET), "--baseline", str(toy_family_baselines[family]), "--baseline-cache-dir",
                     str(tmp_path / "bc"), *scoring_flags(family), "--json", str(ours), "--baseline-json", str(base)]) == 0
    scored = EvalReport.load(ours)
    assert scored.tasks == reports[1].tasks and scored.family == reports[1].family
    assert cli_main(["compare", str(out / "results.jsonl"), str(base)]) == 0
    table = capsys.readouterr()
    assert f"{monitor(family).split('/')[0]} live:" in table.out and "two families" not in table.err


# ---------------------------------------------------------------- a DFlash baseline against a DFlash 2 drafter


def test_a_dflash_baseline_against_a_dflash2_drafter_in_training_names_each_sides_family(
        tmp_path, toy_cache_dir, toy_training_cache_dir, capsys):
    """Lightning trains a DFlash 2 drafter against the shipped DFlash toy baseline: the reports, the stop and the
    ratio stand as for one family; the demo's line, the comparison table, `score` and `compare` name each side's
    family."""
    torch.manual_seed(0)
    module = DFlashTrainingModule(family_config("dflash2"), TARGET, lr=LR, blocks_per_sequence=4)
    cb = DrafterEvalCallback(**evaluation("dflash2", tmp_path, toy_cache_dir, toy_baseline_path(), keep_last=100))
    stop_cb = stop("dflash2")
    data = DataLoader(CacheSequences(toy_training_cache_dir), batch_size=1, collate_fn=collate_sequences)
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", logger=False, callbacks=[cb, stop_cb, SlowSteps()],
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, data)
    check_reports(cb.reports, cb.baseline_report, "dflash2", baseline_family="dflash")
    assert stop_cb.stop_reason is not None and trainer.global_step < MAX_STEPS
    last = cb.reports[-1]
    line = report_line(last, cb.baseline_report, stop_cb, "")
    assert re.match(rf"step +{last.step} \| DFlash 2 ddtree@4 \d\.\d\d = \d+% \[\d+%, \d+%\] of the DFlash baseline's "
                    r"\d\.\d\d, behind \| vanilla", line), line
    assert "; ours a DFlash 2 drafter, the baseline a DFlash one" in comparison_table(last, cb.baseline_report).splitlines()[0]

    snapshot = run_dir(tmp_path / "eval") / "snapshots" / f"step-{last.step:08d}"
    ours, base = tmp_path / "ours.json", tmp_path / "base.json"
    note = "the drafters are of two families (ours: DFlash 2; the baseline: DFlash)"
    assert cli_main(["score", "--drafter", str(snapshot), "--cache", str(toy_cache_dir), "--target", str(TARGET),
                     "--baseline", str(toy_baseline_path()), "--baseline-cache-dir", str(tmp_path / "bc"),
                     "--budgets", "4", "--topk", "2", "--device", "cpu", "--json", str(ours),
                     "--baseline-json", str(base)]) == 0
    printed = capsys.readouterr()
    assert note in printed.err and "ours a DFlash 2 drafter, the baseline a DFlash one" in printed.out
    assert EvalReport.load(ours).tasks == last.tasks  # the snapshot's numbers, as the run logged them
    assert EvalReport.load(base).tasks == cb.baseline_report.tasks  # the cached baseline: not scored again
    assert cli_main(["compare", str(run_dir(tmp_path / "eval") / "results.jsonl"), str(base)]) == 0
    printed = capsys.readouterr()
    assert note in printed.err and "a DFlash 2 drafter" in printed.out


# ---------------------------------------------------------------- a JetSpec baseline against a DFlare drafter


def test_a_jetspec_baseline_against_a_dflare_drafter_names_each_side(tmp_path, toy_cache_dir, toy_family_baselines,
                                                                     capsys):
    """`score` of the toy DFlare drafter against the toy JetSpec baseline: the baseline's causality is said in one
    line before scoring, naming the baseline; the note and the table name each side's family; `compare` reads the
    two reports back."""
    ours, base, baseline = tmp_path / "ours.json", tmp_path / "base.json", toy_family_baselines["jetspec"]
    assert cli_main(["score", "--drafter", str(toy_family_baselines["dflare"]), "--cache", str(toy_cache_dir),
                     "--target", str(TARGET), "--baseline", str(baseline), "--baseline-cache-dir", str(tmp_path / "bc"),
                     "--budgets", "4", "--topk", "2", "--device", "cpu", "--json", str(ours),
                     "--baseline-json", str(base)]) == 0
    printed = capsys.readouterr()
    warned = [line for line in printed.err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 2, warned
    assert warned[0].startswith(f"warning: baseline {baseline}: JetSpec attention: the checkpoint says is_causal false, "
                                "dflash_config.causal true; its trainer meant every layer block-causal")
    note = "the drafters are of two families (ours: DFlare; the baseline: JetSpec)"
    assert warned[1].startswith(f"warning: {note}")
    assert "ours a DFlare drafter, the baseline a JetSpec one" in printed.out
    # the toy target slides on every layer: vLLM serves the full layer with its window of 64 (docs/numbers.md)
    assert EvalReport.load(base).attention_patterns == {"trained": ["causal"], "vllm": ["bidirectional, window 64 from the query"]}
    assert cli_main(["compare", str(ours), str(base)]) == 0
    printed = capsys.readouterr()
    assert note in printed.err and "a DFlare drafter" in printed.out
