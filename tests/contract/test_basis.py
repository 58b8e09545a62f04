"""Numbers stand on one basis (scoring.basis): a report, a baseline or a resume scored with
another cache, block size, tasks or number-changing scoring field is an error, never a
number beside this run's. Also what a failed or unfinished report leaves behind: nothing
stale in callback_metrics, nothing lost when the fit raises, nothing scored before its copy
landed. Real runs, real files; every run folder goes through the audit (runs.py)."""

from __future__ import annotations

import math
import shutil
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.cache.extract import extract_cache
from dflash_callbacks.cache.tasks import Task
from dflash_callbacks.cli import build_parser, main as cli_main
from dflash_callbacks.cli.score import scoring_config
from dflash_callbacks.cli.watch import given_settings
from dflash_callbacks.engine.runners import external_scorer
from dflash_callbacks.engine.run_folder import RunFolder
from dflash_callbacks.engine.runners.background import BackgroundRunner
from dflash_callbacks.engine.runners.jobs import Job, SnapshotOutcome
from dflash_callbacks.engine.snapshot import Snapshot
from dflash_callbacks.model import DrafterConfig, load_drafter
from dflash_callbacks.model.target_head import head_fingerprint
from dflash_callbacks.scoring.basis import Basis
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec, preflight
from dflash_callbacks.watch.runs import Watcher, open_watcher

from fixtures_cache import save_random_target
from runs import assert_clean, records, run_dir, run_dirs, wait_until
from train_run import SCORING, eval_cb, fit, shared_world, write_cache
from watchers import HostileWatcher


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


def service(world: Path, baseline: Path | None = None, **scoring) -> ScoringService:
    return ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"),
                                      None if baseline is None else str(baseline), {**SCORING, **scoring}))


def other_baseline(world: Path, tmp_path: Path) -> Path:
    """A copy of the world's baseline drafter with other weights (its fc halved)."""
    from dflash_callbacks import save_drafter

    other = tmp_path / "other-baseline"
    shutil.copytree(world / "baseline", other)
    drafter = load_drafter(other)
    with torch.no_grad():
        drafter.fc.weight.mul_(0.5)
    save_drafter(other, drafter.config, drafter.state_dict())
    return other


class PoisonAt(pl.Callback):
    """NaN weights from `step` on: every later report is a NonFiniteError."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.drafter.fc.weight.fill_(float("nan"))


def test_basis_differences_name_each_field(world):
    run = service(world).basis(6)
    other = service(world, window=2, max_rounds=3, ddtree_budgets=[8]).basis(5)
    assert run.differences(run) == [] and Basis.from_dict(run.to_dict()) == run
    assert run.differences(other) == ["block size 5 (this run: 6)", "window 2 (this run: None)",
                                      "max_rounds 3 (this run: None)", "no ddtree@4 (this run scores vanilla, ddtree@4)"]
    assert service(world, ddtree_budgets=[4, 8]).basis(6).differences(run) == [
        "no ddtree@8 (this run scores vanilla, ddtree@4, ddtree@8)"]
    assert run.differences(service(world, ddtree_budgets=[4, 8]).basis(6)) == []  # more methods: fine
    assert service(world).basis(None).differences(other)[0] == "window 2 (this run: None)"  # block not known yet


def test_a_watcher_report_on_another_basis_is_an_error_never_a_number(world, tmp_path):
    """External runner: a watcher scoring with window=2 writes reports of the right steps
    and snapshots; each is an error for its step, and no mean reaches callback_metrics."""
    windowed = service(world, window=2)
    watcher = HostileWatcher(tmp_path / "d", [
        lambda step, i: windowed.score_folder(RunFolder(run_dirs(tmp_path / "d")[0]).snapshot_path(step)).to_dict()
    ] * 2)
    cb = eval_cb(world, tmp_path, runner="external", keep_last=4, wait_timeout=60, busy="queue", max_pending=4)
    with watcher:
        with pytest.warns(UserWarning, match=r"step 2 failed: .*scored with window 2 \(this run: None\); not recorded"):
            trainer = fit(world, tmp_path, [cb], max_steps=4)
    assert [("error" in r, r["step"]) for r in records(tmp_path / "d")] == [(True, 2), (True, 4)]
    assert cb.reports == [] and cb.errors == 2
    means = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("/mean")}
    assert means and all(math.isnan(v) for v in means.values())  # the placeholders: no number reached them
    assert "dflash/step" not in trainer.callback_metrics
    assert_clean(tmp_path / "d", cb.reports)


def test_the_watchers_baseline_must_be_this_runs_and_a_late_one_is_taken(world, tmp_path):
    """External runner: reports/baseline.json first holds a report of other weights (an
    error: the run goes on without a baseline), then the watcher's retry writes the right
    one: the reports after it carry deltas, the one before does not."""
    other = other_baseline(world, tmp_path)
    wrong = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), str(other), SCORING,
                                       str(tmp_path / "bc"))).baseline()
    right = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), str(world / "baseline"), SCORING,
                                       str(tmp_path / "bc"))).baseline()
    scorer = service(world)
    watcher = HostileWatcher(tmp_path / "d", [
        lambda step, i: scorer.score_folder(RunFolder(run_dirs(tmp_path / "d")[0]).snapshot_path(step)).to_dict()
    ] * 3)

    class Baselines(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            cb.run.reports_dir.mkdir(exist_ok=True)
            wrong.to_json(cb.run.report_path(None))

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 3:  # once step 2 is scored; the runner looks again before step 4
                wait_until(cb.run.report_path(2).is_file, what="the watcher's report of step 2")
                right.to_json(cb.run.report_path(None))

    cb = eval_cb(world, tmp_path, runner="external", keep_last=4, wait_timeout=60, baseline=world / "baseline",
                 busy="queue", max_pending=4)
    with watcher:
        with pytest.warns(UserWarning, match="the watcher.s baseline report is of weights") as caught:
            fit(world, tmp_path, [cb, Baselines()], max_steps=6)
    assert [r.step for r in cb.reports] == [2, 4, 6] and cb.baseline_report.to_dict() == right.to_dict()
    assert cb.errors == 1, [str(w.message) for w in caught]  # the wrong baseline
    assert_clean(tmp_path / "d", cb.reports)


def test_a_watcher_without_baseline_tells_a_run_that_expects_one(world, tmp_path):
    """`watch` without --baseline writes an error for a run whose run.json names a baseline,
    so the run does not wait for it; runs that expect none get nothing."""
    expects = RunFolder.create(tmp_path / "runs", "a", {"baseline": str(world / "baseline")})
    plain = RunFolder.create(tmp_path / "runs", "b", {"baseline": None})
    lines = []
    Watcher(service(world), tmp_path / "runs", log=lines.append).scan_once()
    found = expects.read_report(expects.report_path(None))
    assert "the watcher runs without --baseline, but this run expects the baseline" in found.message
    assert not plain.report_path(None).exists() and "expects the baseline" in lines[0]


class Watching(threading.Thread):
    """`dflash-callbacks watch --dir DIR --cache ... --target ... --device cpu FLAGS` in a thread:
    the CLI's own watcher, from its parsed command line, scanning every 50 ms; its log kept."""

    def __init__(self, world: Path, dirpath: Path, *flags: str, cache: Path | None = None):
        super().__init__(daemon=True)
        args = build_parser().parse_args(["watch", "--dir", str(dirpath), "--cache", str(cache or world / "cache"),
                                          "--target", str(world / "target"), "--device", "cpu", *flags])
        self.lines: list[str] = []
        self.watcher = open_watcher(args, scoring_config(args), given_settings(args), log=self.lines.append)
        self.stop, self.error, self.scans = threading.Event(), None, 0

    def run(self):
        try:
            while not self.stop.wait(0.05):  # a watcher polls: every 50 ms, until the test stops it
                self.watcher.scan_once()
                self.scans += 1
        except BaseException as e:  # the test fails on it, not the thread alone
            self.error = e

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()
        assert self.error is None, self.error


def test_a_watcher_scores_each_run_with_the_settings_its_run_json_records(world, tmp_path):
    """A watcher started without --topk 4 beside a run that scores top@4 (and one budget, not
    the default two) scores every snapshot, and the baseline, with the run's settings: no error
    line; the machine settings (--anchors-per-forward) are its own. A flag that agrees with the
    run (the drafter's block size, a budget list) refuses nothing, and runs of one setting share
    one service."""
    cb = eval_cb(world, tmp_path, runner="external", scoring={**SCORING, "topk": [4]}, keep_last=4, busy="queue",
                 max_pending=4, wait_timeout=60, baseline=world / "baseline", baseline_cache_dir=tmp_path / "bc")
    with Watching(world, tmp_path / "d", "--anchors-per-forward", "3", "--baseline", str(world / "baseline"),
                  "--baseline-cache-dir", str(tmp_path / "bc")) as watching:
        fit(world, tmp_path, [cb], max_steps=4)
    lines, run = records(tmp_path / "d"), RunFolder(run_dir(tmp_path / "d"))
    assert [(r["step"], "tasks" in r) for r in lines] == [(2, True), (4, True)] and cb.errors == 0, lines
    assert cb.baseline_report.methods == ["vanilla", "ddtree@4", "top@4"]
    assert all(list(r["mean"]) == ["vanilla", "ddtree@4", "top@4"] for r in lines)
    assert all(r["scoring"]["anchors_per_forward"] == 3 for r in lines)
    again = service(world, topk=[4], anchors_per_forward=3).score_folder(run.snapshot_path(4))
    assert lines[1]["tasks"] == again.to_dict()["tasks"]
    assert len(watching.watcher._services) == 2 and "scoring with its run.json's settings" in watching.lines[0]
    assert not any("refused" in line for line in watching.lines)
    assert_clean(tmp_path / "d", cb.reports)

    twin = RunFolder.create(tmp_path / "d", "twin", run.about())  # a second run with the same settings
    shutil.copytree(run.snapshot_path(2), twin.snapshot_path(2))
    twin.unlock()
    assert watching.watcher.scan_once() == 1 and len(watching.watcher._services) == 2
    agreeing = Watching(world, tmp_path / "d", "--block-size", "6", "--budgets", "4", "--topk", "4")
    agreeing.watcher.scan_once()
    assert not any("refused" in line for line in agreeing.lines), agreeing.lines


def test_a_watcher_whose_flags_or_cache_conflict_with_a_run_is_refused_and_writes_nothing_there(world, tmp_path,
                                                                                                  monkeypatch):
    """A watcher with --window 2 beside a run scoring window None, and one with another cache:
    each says so in one line naming the setting, both values and the fix, however often it
    polls, and writes nothing into the run's folder, not even a heartbeat: the run, which no
    watcher scores, says it has none."""
    monkeypatch.setattr(external_scorer, "WATCHER_TIMEOUT", 1.5)
    other = write_cache(world, tmp_path / "other-cache", [("other", 12, 3)])
    cb = eval_cb(world, tmp_path, runner="external", keep_last=2)
    with Watching(world, tmp_path / "d", "--window", "2") as flagged, \
            Watching(world, tmp_path / "d", cache=other) as elsewhere:
        with pytest.warns(UserWarning, match=r"no `dflash-callbacks watch` has written to .*; step 2 was not scored"):
            fit(world, tmp_path, [cb], max_steps=2)
        scans = flagged.scans, elsewhere.scans  # more polls: still one line each
        wait_until(lambda: flagged.scans >= scans[0] + 3 and elsewhere.scans >= scans[1] + 3,
                   what="three more scans of each watcher")
    folder = run_dir(tmp_path / "d")
    assert [(r["step"], "no `dflash-callbacks watch`" in r["error"]) for r in records(tmp_path / "d")] == [(2, True)]
    assert not (folder / "reports").exists() and not (folder / "watcher.json").exists()
    assert flagged.lines == [f"watch: {folder.name}: refused, nothing is written there: window 2 from --window, but "
                             "the run scores window None; drop --window (a watcher takes each run's scoring settings "
                             "from its run.json), or leave the run to a watcher without it"]
    (line,) = elsewhere.lines
    assert line.startswith(f"watch: {folder.name}: refused, nothing is written there: this watcher would score it with "
                           f"cache {elsewhere.watcher.service.cache.fingerprint} (this run: ")
    assert "start a watcher with the run's --cache, --target and dflash_callbacks version" in line
    assert_clean(tmp_path / "d", cb.reports)


def test_of_two_watchers_on_one_folder_the_one_whose_flags_conflict_is_refused(world, tmp_path):
    """Two watchers on one run folder, one with --window 2 (and a --topk that agrees): only
    the other's reports land, every one of them a report; the refused one logs one line, names
    only the setting that conflicts, and scores nothing."""
    cb = eval_cb(world, tmp_path, runner="external", scoring={**SCORING, "topk": [4]}, keep_last=4, busy="queue",
                 max_pending=4, wait_timeout=60)
    with Watching(world, tmp_path / "d", "--window", "2", "--topk", "4") as wrong, \
            Watching(world, tmp_path / "d", "--topk", "4") as right:
        fit(world, tmp_path, [cb], max_steps=4)
    lines = records(tmp_path / "d")
    assert [(r["step"], "tasks" in r, r.get("scoring", {}).get("window")) for r in lines] == [(2, True, None),
                                                                                            (4, True, None)]
    assert cb.errors == 0 and len(wrong.lines) == 1 and "window 2 from --window" in wrong.lines[0]
    assert "topk" not in wrong.lines[0] and len(wrong.watcher._services) == 1
    assert sum("live tau" in line for line in right.lines) == 2
    assert_clean(tmp_path / "d", cb.reports)


def test_a_baseline_report_scored_with_another_config_is_refused_everywhere(world, tmp_path, capsys):
    """A saved baseline report scored with window=2 or without a monitored method is
    refused before training by the callback, and `compare` refuses it without --force."""
    windowed = service(world, window=2).score_folder(world / "baseline")
    windowed.to_json(tmp_path / "windowed.json")
    cb = eval_cb(world, tmp_path, baseline=tmp_path / "windowed.json")
    with pytest.raises(PreflightError, match=r"baseline .*windowed.json was scored with window 2 \(this run: None\)"):
        fit(world, tmp_path, [cb], max_steps=2)
    cb = eval_cb(world, tmp_path, baseline=tmp_path / "windowed.json", scoring={**SCORING, "window": 2,
                                                                               "ddtree_budgets": [4, 8]})
    with pytest.raises(PreflightError, match=r"was scored with no ddtree@8"):
        fit(world, tmp_path, [cb], max_steps=2)
    ours = service(world).score_folder(world / "baseline")
    ours.to_json(tmp_path / "ours.json")
    assert cli_main(["compare", str(tmp_path / "ours.json"), str(tmp_path / "windowed.json")]) == 2
    assert "refusing to compare: the baseline" in capsys.readouterr().err
    assert cli_main(["compare", str(tmp_path / "ours.json"), str(tmp_path / "windowed.json"), "--force"]) == 0


def test_a_report_of_another_scorer_version_is_refused_and_its_cached_baseline_scored_again(world, tmp_path):
    """A report computed by an older library (before a fix of the definitions: it records no
    scorer_version, or another) stands on another basis: a saved baseline of it is refused
    before training, and the baseline cache never hands it out (its key holds the version)."""
    from dflash_callbacks.scoring.report import SCORER_VERSION, EvalReport

    run = service(world).basis(6)
    report = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), str(world / "baseline"), SCORING,
                                        baseline_cache_dir=str(tmp_path / "bc"))).baseline()
    assert report.scorer_version == SCORER_VERSION and run.mismatches(report, "it") == []
    older = EvalReport.from_dict({k: v for k, v in report.to_dict().items() if k != "scorer_version"})
    assert run.mismatches(older, "the baseline") == [
        f"the baseline was scored with scorer version unrecorded (a report from before versions were recorded) (this run: {SCORER_VERSION})"]
    older.to_json(tmp_path / "older.json")
    cb = eval_cb(world, tmp_path, baseline=tmp_path / "older.json")
    with pytest.raises(PreflightError, match=r"older.json was scored with scorer version unrecorded"):
        fit(world, tmp_path, [cb], max_steps=2)
    (cached,) = (tmp_path / "bc").glob("baseline-*.json")
    assert EvalReport.load(cached).extra["baseline_key"]["scorer"] == SCORER_VERSION


def test_a_resume_with_another_scoring_config_goes_on_in_a_new_run_folder(world, tmp_path):
    """Resumed with ddtree_budgets [4] -> [4, 8] and a stop on ddtree@8: the first run's
    numbers (without ddtree@8) are not taken; the resume writes a new run folder, and the
    stop's history holds only numbers of the new config."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    fit(world, tmp_path, [eval_cb(world, tmp_path), ckpt], max_steps=4, enable_checkpointing=True)
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "ddtree_budgets": [4, 8]})
    stop = TrailingBaselineStop(monitor="ddtree@8/live", verbose=False)
    with pytest.warns(UserWarning, match=r"was scored with no ddtree@8 .* goes on in a new run folder"):
        fit(world, tmp_path, [cb, stop], max_steps=8, ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    second = cb.run.path
    (first,) = [p for p in run_dirs(tmp_path / "d") if p != second]
    steps = [[r.step for r in RunFolder(folder).read_results().reports] for folder in (first, second)]
    assert steps == [[2, 4], [6, 8]]
    assert [s for s, _ in stop.history] == [6, 8]
    assert RunFolder(second).about()["basis"]["methods"] == ["vanilla", "ddtree@4", "ddtree@8"]
    assert_clean(tmp_path / "d", cb.reports)


def test_a_resume_on_another_basis_whose_run_folder_is_gone_drops_the_checkpoints_history(world, tmp_path):
    """The checkpoint travels, its run folder does not (another machine, another dirpath): the
    folder is recreated, and the history held in the checkpoint (scored without ddtree@8) was
    taken as this run's: the stop on ddtree@8 died at on_train_start with a KeyError, and with
    the same methods the old numbers stood beside the new ones. The checkpoint records its basis."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    fit(world, tmp_path, [eval_cb(world, tmp_path), ckpt], max_steps=4, enable_checkpointing=True)
    saved = torch.load(tmp_path / "ckpt" / "step=4.ckpt", weights_only=False)["callbacks"]
    assert [s["basis"]["methods"] for s in saved.values() if "basis" in s] == [["vanilla", "ddtree@4"]]
    shutil.rmtree(tmp_path / "d")
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "ddtree_budgets": [4, 8]})
    stop = TrailingBaselineStop(monitor="ddtree@8/live", verbose=False)
    with pytest.warns(UserWarning, match=r"was scored with no ddtree@8 .* goes on in a new run folder"):
        fit(world, tmp_path, [cb, stop], max_steps=6, ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    assert [h["step"] for h in cb.history] == [s for s, _ in stop.history] == [6]
    assert [r.step for r in RunFolder(cb.run.path).read_results().reports] == [6]


def test_a_non_finite_report_leaves_nan_means_and_a_resume_restores_the_last(world, tmp_path):
    """NaN weights from step 3: the report of step 4 is an error, and the means in
    callback_metrics become NaN (ModelCheckpoint ranks it worst) with dflash/step 4, the
    baseline's means untouched. A resume puts the last report's means back before training."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    cb = eval_cb(world, tmp_path, baseline=world / "baseline", baseline_cache_dir=tmp_path / "bc")
    with pytest.warns(UserWarning, match="step 4 failed: NonFiniteError"):
        trainer = fit(world, tmp_path, [PoisonAt(3), cb, ckpt], max_steps=4, enable_checkpointing=True)
    metrics = trainer.callback_metrics
    assert math.isnan(metrics["dflash/ddtree@4/live/mean"]) and math.isnan(metrics["dflash/ratio/ddtree@4/live/mean"])
    assert metrics["dflash/baseline/ddtree@4/live/mean"] == pytest.approx(cb.baseline_report.value("ddtree@4/live"))
    assert metrics["dflash/step"] == 4

    seen = {}

    class AtStart(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.setdefault("metrics", dict(trainer.callback_metrics))

    step2 = cb.reports[0].value("ddtree@4/live")
    cb = eval_cb(world, tmp_path, baseline=world / "baseline", baseline_cache_dir=tmp_path / "bc")
    fit(world, tmp_path, [cb, AtStart()], max_steps=4, ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert seen["metrics"]["dflash/ddtree@4/live/mean"] == pytest.approx(step2) and seen["metrics"]["dflash/step"] == 2
    # the resume reached step 4 again: its report follows the error line of step 4
    assert [("error" in r, r["step"]) for r in records(tmp_path / "d")] == [(False, 2), (True, 4), (False, 4)]
    assert_clean(tmp_path / "d", cb.reports)


def test_a_report_finished_when_the_fit_raises_is_kept_whole(world, tmp_path):
    """The fit raises while a finished report waits to be drained: results.jsonl keeps it
    as a report (never an error line without an error)."""

    class Boom(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:  # once step 2's report waits to be drained
                wait_until(lambda: not cb.engine.runner._outbox.empty(), what="the report of step 2")
                raise RuntimeError("the training step failed")

    cb = eval_cb(world, tmp_path)
    with pytest.raises(RuntimeError, match="the training step failed"):
        fit(world, tmp_path, [Boom(), cb], max_steps=6)
    (line,) = records(tmp_path / "d")
    assert line["step"] == 2 and "tasks" in line and "error" not in line
    assert_clean(tmp_path / "d")


class CopyLandsOnWait:
    """Stands in for the CUDA event of a side-stream copy (no GPU here): the snapshot's
    buffers hold their real values only once someone waits for it."""

    def __init__(self, snapshot: Snapshot, values: dict):
        self.snapshot, self.values = snapshot, values

    def synchronize(self):
        for name, value in self.values.items():
            self.snapshot.state[name].copy_(value)


def test_the_runner_scores_a_snapshot_only_after_its_copy_lands(world, tmp_path):
    """keep_last=0 (nothing written, so nothing else waits): the report is of the
    captured weights, not of the buffers before the copy landed."""
    weights = load_drafter(world / "baseline").state_dict()
    config = DrafterConfig.from_file(world / "baseline")
    snapshot = Snapshot(2, 0, config, {k: torch.zeros_like(v) for k, v in weights.items()})
    snapshot.event = CopyLandsOnWait(snapshot, weights)
    spec = ServiceSpec(str(world / "cache"), str(world / "target"), None, SCORING)
    run = RunFolder.create(tmp_path / "d", "run")
    runner = BackgroundRunner("thread", spec, run, keep_last=0, basis=preflight(spec, config))
    runner.submit(Job(2, snapshot.snapshot_id, snapshot=snapshot))
    outcomes = []
    wait_until(lambda: outcomes.extend(runner.poll()) or outcomes, what="the outcome of step 2")
    runner.close(wait=True, timeout=10, reason="done")
    (outcome,) = outcomes
    assert isinstance(outcome, SnapshotOutcome) and outcome.error is None
    expected = service(world).score(config, weights, step=2)
    assert outcome.report.tasks == expected.tasks
    run.unlock()


@pytest.mark.parametrize("wait_on_end", [True, False])
def test_the_last_snapshots_copy_has_landed_before_a_later_callback_ends_training(world, tmp_path, wait_on_end):
    """max_steps a multiple of every_n_train_steps: the last snapshot is taken in the last step's
    on_train_batch_end and no optimizer step follows to wait for its copy (on CUDA, beside
    training). It is waited for before any callback's on_train_end writes the weights in place
    (WeightAveraging); it was only for a snapshot on_train_end took itself."""
    cb = eval_cb(world, tmp_path, wait_on_end=wait_on_end)
    in_flight = []

    class WritesTheWeightsAtEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            in_flight.append(cb.engine.schedule.staging)

    fit(world, tmp_path, [WritesTheWeightsAtEnd(), cb], max_steps=2)
    assert in_flight == [None]


def test_the_last_snapshot_holds_the_live_weights_with_weight_averaging_listed_first(world, tmp_path):
    """WeightAveraging listed before the eval callback (as a callback that writes the weights
    should be): its on_train_end copies the averaged weights into the drafter. The snapshot
    of the last step (3, not a multiple of 2) holds the drafter's weights of step 3; it held
    the averaged model's, reported as step 3."""
    from lightning.pytorch.callbacks import WeightAveraging
    from safetensors.torch import load_file

    live = {}

    class Averaging(WeightAveraging):
        def on_train_end(self, trainer, pl_module):
            live.update({k: v.clone() for k, v in pl_module.drafter.state_dict().items()})
            super().on_train_end(trainer, pl_module)

    cb = eval_cb(world, tmp_path, keep_last=4)
    trainer = fit(world, tmp_path, [Averaging(), cb], max_steps=3)
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 3]
    snapshot = load_file(str(run_dirs(tmp_path / "d")[0] / "snapshots" / "step-00000003" / "model.safetensors"))
    averaged = trainer.lightning_module.drafter.state_dict()
    assert all(torch.equal(snapshot[k], live[k]) for k in live) and not all(torch.equal(averaged[k], live[k]) for k in live)
    assert_clean(tmp_path / "d", cb.reports)


def test_the_last_snapshot_at_max_epochs_leaves_lightnings_epoch_counter_alone(world, tmp_path):
    """The last snapshot is taken in the last on_train_epoch_end, found by Lightning's
    fit_loop.done, which at max_epochs also moved the epoch counter on: the hooks after ours
    (ModelCheckpoint's included) saw the last epoch of 2 as epoch 2, its checkpoint was named
    epoch=2-step=6.ckpt and recorded epoch 2. The snapshot of step 6 is still taken there."""

    class Seen(pl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.seen.append((trainer.current_epoch, cb.engine.schedule.last_taken))

    cb, seen = eval_cb(world, tmp_path, every_n_train_steps=4), Seen()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}-{step}", save_top_k=-1, every_n_epochs=1)
    fit(world, tmp_path, [cb, seen, ckpt], max_steps=-1, max_epochs=2, limit_train_batches=3, enable_checkpointing=True)
    assert seen.seen == [(0, None), (1, 6)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "epoch=1-step=6.ckpt", weights_only=False)["epoch"] == 1
    assert [r["step"] for r in records(tmp_path / "d")] == [4, 6]
    assert_clean(tmp_path / "d", cb.reports)


def test_a_target_other_than_the_caches_is_refused_before_any_work(random_target_dir, tmp_path):
    """The cache records its target's head fingerprint at extraction: scoring it with
    another target of the same shapes (a re-trained one) is refused up front by the
    preflight every entry point runs, naming both heads."""
    from fixtures_cache import save_random_target

    from dflash_callbacks.cache.extract import extract_cache
    from dflash_callbacks.cache.tasks import Task
    from dflash_callbacks.model.target_head import head_fingerprint
    from dflash_callbacks.scoring.service import preflight

    other = save_random_target(tmp_path / "other-target", seed=1)
    cache = extract_cache(random_target_dir, tmp_path / "cache", [Task("t", "def f(x):")], [1, 2],
                          max_new_tokens=12, chat_template=False, progress=False)
    assert cache.target.head == head_fingerprint(random_target_dir)
    preflight(ServiceSpec(str(cache.path), str(random_target_dir), None, SCORING), None)  # its own target: fine
    with pytest.raises(PreflightError, match=f"has head {head_fingerprint(other)}, but the cache was extracted "
                                             f"from a target with head {cache.target.head}"):
        preflight(ServiceSpec(str(cache.path), str(other), None, SCORING), None)


def test_a_stop_that_can_never_judge_or_a_percentage_ratio_is_said_before_training(world, tmp_path):
    """A stop linked to an eval callback without a baseline never decides: said at setup,
    before the first batch. min_ratio=90 (a percentage typed for a fraction) is said at once."""
    with pytest.warns(UserWarning, match=r"min_ratio=90\): the drafter must reach 90x the baseline"):
        TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=90)
    batches = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            batches.append(1)
            assert not batches[1:], "setup warned late"

    stop = TrailingBaselineStop(monitor="ddtree@4/live", verbose=False)
    with pytest.warns(UserWarning, match="'dflash' has no baseline, so ddtree@4/live is recorded but never judged"):
        fit(world, tmp_path, [eval_cb(world, tmp_path), stop, Count()], max_steps=1)


def test_a_report_nested_past_the_parsers_depth_is_an_error_not_a_crash(tmp_path):
    """A watcher report or a results.jsonl line nested deeper than json can parse is named,
    never a RecursionError out of the run."""
    run = RunFolder.create(tmp_path / "d", "run")
    run.reports_dir.mkdir()
    deep = "[" * 100_000 + "]" * 100_000
    run.report_path(2).write_text(deep)
    assert "unreadable report" in run.read_report(run.report_path(2)).message
    run.results_path.write_text(deep + "\n")
    assert run.read_results().skipped[0].startswith("line 1:")
    run.unlock()


def test_on_error_raise_keeps_every_polled_outcome_on_disk(world, tmp_path, monkeypatch):
    """Step 5's scoring is slow (the real scorer, held until training has taken step 8's
    snapshot), so the reports of steps 5 to 8 reach the training thread together at the end;
    a subscriber that raises on step 5 (on_error="raise") ends the fit, and steps 6 to 8 are
    still in results.jsonl."""
    real, step_8_taken = ScoringService.score, threading.Event()

    def slow_at_5(self, *args, **kwargs):
        if kwargs.get("step") == 5:
            assert step_8_taken.wait(300), "training never took step 8's snapshot"
        return real(self, *args, **kwargs)

    class AtStep8(pl.Callback):  # after cb: its snapshot of step 8 is taken
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 8:
                step_8_taken.set()

    monkeypatch.setattr(ScoringService, "score", slow_at_5)
    cb = eval_cb(world, tmp_path, on_error="raise", busy="queue", max_pending=8, every_n_train_steps=1)

    def fails_from_5(report, baseline):
        if report.step >= 5:
            raise ValueError("a subscriber fails")

    cb.subscribe(fails_from_5)
    with pytest.raises(RuntimeError, match="subscriber .* raised on step 5"):
        fit(world, tmp_path, [cb, AtStep8()], max_steps=8)
    assert [r["step"] for r in records(tmp_path / "d") if "tasks" in r] == list(range(1, 9))
    assert_clean(tmp_path / "d")


def test_a_snapshot_baseline_is_taken_from_the_watcher_and_another_watchers_is_replaced(world, tmp_path):
    """External runner: a baseline drafter folder that is a snapshot (its report names a
    snapshot id) is taken; a watcher finds another watcher's baseline report (other weights)
    in a run and replaces it with its own."""
    import threading

    from dflash_callbacks.engine.runners.external_scorer import ExternalScorer
    from dflash_callbacks.scoring.service import weights_fingerprint

    other = other_baseline(world, tmp_path)
    spec = ServiceSpec(str(world / "cache"), str(world / "target"), str(world / "baseline"), SCORING, str(tmp_path / "bc"))
    own = ScoringService(spec).baseline()
    run = RunFolder.create(tmp_path / "runs", "run", {"runner": "external", "baseline": str(world / "baseline")})
    run.reports_dir.mkdir()
    as_snapshot = own.to_dict() | {"snapshot_id": "a" * 16, "step": 40}
    run.write_report(None, as_snapshot)
    scorer = ExternalScorer(spec, run, threading.Event(), threading.Event())
    taken = scorer.baseline()
    assert taken.snapshot_id == "a" * 16 and taken.extra["baseline_key"]["weights"] == weights_fingerprint(world / "baseline")

    wrong = ScoringService(ServiceSpec(str(world / "cache"), str(world / "target"), str(other), SCORING,
                                       str(tmp_path / "bc"))).baseline()
    run.write_report(None, wrong.to_dict())
    lines = []
    watcher = Watcher(ScoringService(spec), tmp_path / "runs", log=lines.append)
    watcher.scan_once()
    assert run.read_report(run.report_path(None)).tasks == own.tasks and "replaced another watcher's" in lines[-1]
    watcher.scan_once()
    assert sum("replaced another watcher's" in line for line in lines) == 1  # once

    # a run that expects the other baseline is another watcher's business; the same weights
    # scored with another (equal-numbered) key are this watcher's: neither is touched
    theirs = RunFolder.create(tmp_path / "runs", "theirs", {"runner": "external", "baseline": str(other)})
    theirs.reports_dir.mkdir()
    theirs.write_report(None, wrong.to_dict())
    key = {**own.extra["baseline_key"], "scoring": {**own.extra["baseline_key"]["scoring"], "block_size": 6}}
    run.write_report(None, own.to_dict() | {"extra": {"baseline_key": key}})
    watcher.scan_once()
    assert theirs.read_report(theirs.report_path(None)).tasks == wrong.tasks
    assert run.read_report(run.report_path(None)).extra["baseline_key"] == key
    assert sum("replaced another watcher's" in line for line in lines) == 1
    run.unlock()
    theirs.unlock()


def test_a_non_finite_failure_reads_alike_from_every_runner():
    """A worker's or a watcher's failure keeps its own words, so a NaN there is known as one."""
    from dflash_callbacks.engine.runners.jobs import ScorerError, describe, is_non_finite
    from dflash_callbacks.scoring.scorer import NonFiniteError

    here = describe(NonFiniteError("the drafter's logits are NaN"))
    assert is_non_finite(here) and describe(ScorerError(here)) == here and is_non_finite(describe(ScorerError(here)))
    assert not is_non_finite(describe(RuntimeError("the scoring worker died (exit code -9)")))


def test_a_baseline_drafter_of_another_block_size_is_refused_before_training(world, tmp_path):
    import json

    baseline = shutil.copytree(world / "baseline", tmp_path / "baseline-b4")
    config = json.loads((baseline / "config.json").read_text())
    config["block_size"] = 4
    (baseline / "config.json").write_text(json.dumps(config))
    cb = eval_cb(world, tmp_path, baseline=baseline)
    with pytest.raises(PreflightError, match=r"is a drafter of block size 4, this run scores block size 6"):
        fit(world, tmp_path, [cb], max_steps=2)


def test_a_watcher_survives_run_folders_it_can_not_read(world, tmp_path):
    """A run.json whose baseline is not a path, or a baseline report whose key is not an
    object, is left alone: the watcher goes on scoring every other run."""
    spec = ServiceSpec(str(world / "cache"), str(world / "target"), str(world / "baseline"), SCORING, str(tmp_path / "bc"))
    own = ScoringService(spec).baseline()
    odd = RunFolder.create(tmp_path / "runs", "odd", {"runner": "external", "baseline": ["not", "a", "path"]})
    keyless = RunFolder.create(tmp_path / "runs", "keyless", {"runner": "external", "baseline": str(world / "baseline")})
    for run in (odd, keyless):
        run.reports_dir.mkdir()
        run.write_report(None, own.to_dict() | {"extra": {"baseline_key": "x"}})
    Watcher(ScoringService(spec), tmp_path / "runs", log=lambda line: None).scan_once()
    assert odd.read_report(odd.report_path(None)).extra == {"baseline_key": "x"}  # not its business
    assert keyless.read_report(keyless.report_path(None)).extra == own.extra  # another's: replaced
    odd.unlock()
    keyless.unlock()


def test_the_baseline_is_cached_per_target_head_and_every_report_names_its_target(random_target_dir, zlab_tiny, tmp_path):
    """Two real tiny targets of the same shapes and other weights (a re-trained target): the
    baseline scored against one is never taken from the shared baseline cache for the other;
    each report names the head it was scored with, and two reports of two heads are not
    comparable (`scoring.basis`). A report written before the target was recorded still loads and compares."""
    other = save_random_target(tmp_path / "other-target", seed=1)
    cache = extract_cache(random_target_dir, tmp_path / "cache", [Task("t", "def f(x):")], [1, 2, 4],
                          max_new_tokens=12, chat_template=False, progress=False)

    def baseline(target: Path, cache_dir: str) -> EvalReport:
        spec = ServiceSpec(str(cache.path), str(target), str(zlab_tiny), SCORING, str(tmp_path / cache_dir))
        return ScoringService(spec).baseline()

    first, second = baseline(random_target_dir, "bc"), baseline(other, "bc")
    assert first.cache["target"] == head_fingerprint(random_target_dir) != second.cache["target"] == head_fingerprint(other)
    assert len(list((tmp_path / "bc").glob("baseline-*.json"))) == 2  # one per head, none reused
    assert baseline(other, "bc").to_dict() == second.to_dict()  # each head's is reused
    assert baseline(other, "fresh").tasks == second.tasks
    def differences(a: EvalReport, b: EvalReport) -> list[str]:
        return Basis.of_report(a).differences(Basis.of_report(b))

    assert any(d.startswith("target head ") for d in differences(second, first))
    old = EvalReport.from_dict({**first.to_dict(), "cache": {k: v for k, v in first.cache.items() if k != "target"}})
    assert differences(second, old) == [] and differences(first, first) == []
