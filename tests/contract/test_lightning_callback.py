import csv
import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from dflash_callbacks import DFlashDrafter
from dflash_callbacks.callbacks import DrafterEvalCallback
from dflash_callbacks.engine.snapshot import StagingPool, capture
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.scoring.service import ScoringService, ServiceSpec
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences

from runs import assert_clean, records, run_dir, wait_until
from synthetic import build_world

SCORING = {"ddtree_budgets": [4, 8], "topk": [3], "device": "cpu"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("world"))


def loader(world):
    return DataLoader(CacheSequences(world.cache), batch_size=1, shuffle=True, collate_fn=collate_sequences,
                      generator=torch.Generator().manual_seed(0))


def trainer(tmp_path, callbacks, max_steps=20, **kwargs):
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=CSVLogger(tmp_path / "logs", name="run"), callbacks=callbacks,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, **kwargs,
    )


class StepRecorder(pl.Callback):
    """Records the global step at which each report reached the training thread (a subscriber)."""

    def __init__(self, cb: DrafterEvalCallback):
        self.arrivals, self.trainer = {}, None
        cb.subscribe(lambda report, baseline: self.arrivals.__setitem__(report.step, self.trainer.global_step))

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer


def test_scores_in_background_logs_and_matches_the_cli(world, tmp_path, capsys):
    torch.manual_seed(0)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    cb = DrafterEvalCallback(
        cache=world.cache, target=world.target, baseline=world.baseline, every_n_train_steps=5, scoring=SCORING,
        busy="queue", max_pending=8, keep_last=10, dirpath=tmp_path / "dflash", baseline_cache_dir=tmp_path / "bc",
    )
    recorder = StepRecorder(cb)
    t = trainer(tmp_path, [cb, recorder], max_steps=30)
    t.fit(module, loader(world))

    lines = records(tmp_path / "dflash")
    assert [r["step"] for r in lines] == [5, 10, 15, 20, 25, 30]
    assert all(r["score_seconds"] >= 0 and r["extra"] == {} for r in lines)  # once, not also in extra
    assert_clean(tmp_path / "dflash", cb.reports)
    # training went on while snapshots were being scored: reports reached the
    # training thread steps after their snapshot was taken
    assert any(recorder.arrivals[s] > s for s in (5, 10, 15, 20, 25))
    assert cb.baseline_report is not None and cb.errors == 0

    # the numbers equal `dflash-callbacks score` on the saved snapshot
    snap = run_dir(tmp_path / "dflash") / "snapshots" / "step-00000015"
    meta = json.loads((snap / "snapshot.json").read_text())
    assert meta["step"] == 15 and meta["snapshot_id"] == lines[2]["snapshot_id"]
    out = tmp_path / "cli.json"
    assert cli_main(["score", "--drafter", str(snap), "--cache", str(world.cache), "--target", str(world.target),
                     "--budgets", "4,8", "--topk", "3", "--device", "cpu", "--json", str(out)]) == 0
    assert "| **mean** |" in capsys.readouterr().out
    cli = json.loads(out.read_text())
    assert cli["tasks"] == lines[2]["tasks"] and cli["mean"] == lines[2]["mean"]
    assert (cli["step"], cli["snapshot_id"]) == (15, lines[2]["snapshot_id"])

    # logged at the snapshot's step, with deltas and ratios against the baseline
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    by_step = {int(r["step"]): r for r in rows if r.get("dflash/vanilla/live/mean")}
    assert sorted(by_step) == [5, 10, 15, 20, 25, 30]
    row = by_step[15]
    ours = lines[2]["mean"]["ddtree@8"]["live"]
    base = cb.baseline_report.value("ddtree@8/live")
    assert float(row["dflash/ddtree@8/live/mean"]) == pytest.approx(ours)
    assert float(row["dflash/delta/ddtree@8/live/mean"]) == pytest.approx(ours - base)
    assert float(row["dflash/ratio/ddtree@8/live/long"]) == pytest.approx(
        lines[2]["tasks"]["long"]["ddtree@8"]["live"] / cb.baseline_report.value("ddtree@8/live", "long"))
    assert float(row["dflash/step"]) == 15
    # the means are in callback_metrics for EarlyStopping / ModelCheckpoint
    assert t.callback_metrics["dflash/top@3/dense/mean"].item() == pytest.approx(lines[-1]["mean"]["top@3"]["dense"])
    # keep_last
    assert len(list((run_dir(tmp_path / "dflash") / "snapshots").iterdir())) == 6


class Corrupt(pl.Callback):
    """Right after the eval callback started its snapshot, wreck the weights."""

    def __init__(self, step):
        self.step, self.saved = step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                for p in pl_module.drafter.parameters():
                    p.mul_(-3.0)


class Keep(pl.Callback):
    def __init__(self, step):
        self.step, self.state = step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.state = {k: v.detach().clone() for k, v in pl_module.drafter.state_dict().items()}


def test_report_holds_the_weights_of_the_captured_step(world, tmp_path):
    torch.manual_seed(0)
    module = DFlashTrainingModule(world.config, world.target)
    keep, cb, corrupt = Keep(4), DrafterEvalCallback(
        cache=world.cache, target=world.target, every_n_train_steps=4, scoring=SCORING, dirpath=tmp_path / "d",
    ), Corrupt(4)
    trainer(tmp_path, [keep, cb, corrupt], max_steps=6).fit(module, loader(world))
    report = next(r for r in cb.reports if r.step == 4)
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    expected = service.score(world.config, keep.state, step=4)
    assert report.tasks == expected.tasks
    wrecked = {k: v * -3.0 for k, v in keep.state.items()}
    assert service.score(world.config, wrecked, step=4).tasks != expected.tasks


def test_bad_arguments_fail_before_training(world, tmp_path):
    with pytest.raises(ValueError, match="every_n_train_steps must be an integer >= 1; got 0"):
        DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=0)
    with pytest.raises(ValueError, match=r"runner must be one of \['thread', 'process', 'external'\]"):
        DrafterEvalCallback(cache=world.cache, target=world.target, runner="gpu")
    with pytest.raises(ValueError, match=r"ddtree_budgets must be a list of integers >= 1; got 0 in \[0\]"):
        DrafterEvalCallback(cache=world.cache, target=world.target, scoring={"ddtree_budgets": [0]})
    with pytest.raises(ValueError, match=r"name must be letters, .*; got 'dflash\\n'"):  # '$' let a trailing newline in
        DrafterEvalCallback(cache=world.cache, target=world.target, name="dflash\n")
    with pytest.raises(ValueError, match=r"dirpath .*manifest.json is a file: give the folder"):
        DrafterEvalCallback(cache=world.cache, target=world.target, dirpath=world.cache / "manifest.json")
    module = DFlashTrainingModule(world.config, world.target)
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, drafter="nope", dirpath=tmp_path)
    with pytest.raises(AttributeError, match=r"has no attribute 'nope'; .*drafter-like submodules of .*: \['drafter'\]"):
        trainer(tmp_path, [cb], max_steps=2).fit(module, loader(world))
    # the default cadence (500) on a short run: say that nothing is scored while training
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, scoring=SCORING, dirpath=tmp_path / "d",
                             verbose=False)
    with pytest.warns(UserWarning, match=r"every_n_train_steps=500 is more than max_steps=2: no snapshot is taken "
                                         r"while training, only the last step's at the end"):
        trainer(tmp_path, [cb], max_steps=2).fit(module, loader(world))
    assert [r.step for r in cb.reports] == [2]
    # drafter= names a module that is not the drafter: say so, not only "pass drafter_config="
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, drafter="head", dirpath=tmp_path)
    with pytest.raises(ValueError, match=r"drafter='head'\) gives a TargetHead .* point drafter= at the drafter "
                                         r"\(drafter-like submodules: \['drafter'\]\)"):
        trainer(tmp_path, [cb], max_steps=2).fit(module, loader(world))


def test_snapshot_buffers_are_allocated_once_reused_and_hold_their_steps_weights(world, tmp_path):
    """The host buffers a snapshot is copied into are allocated once (before training, off the
    training thread) and reused by every snapshot; scoring reads them directly (keep_last=0),
    and each report still equals the weights of its own step."""
    torch.manual_seed(0)
    module = DFlashTrainingModule(world.config, world.target, lr=3e-3)
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=2, scoring=SCORING,
                             keep_last=0, dirpath=tmp_path / "d", verbose=False)

    class AtCapture(pl.Callback):  # after cb: sees each snapshot right after its copy
        def __init__(self):
            self.buffers, self.weights, self.pools = {}, {}, set()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.pools.add(cb.engine.schedule.pool)
            if cb.engine.schedule.staging is not None and cb.engine.schedule.staging.step == trainer.global_step:
                self.buffers[trainer.global_step] = tuple(t.data_ptr() for t in cb.engine.schedule.staging.state.values())
                self.weights[trainer.global_step] = {k: v.detach().clone()
                                                     for k, v in pl_module.drafter.state_dict().items()}
                # scored before the next snapshot is due, under any load: busy="skip" skips none
                wait_until(lambda: not cb.engine.runner._outbox.empty(), what=f"the report of step {trainer.global_step}")

    seen = AtCapture()
    trainer(tmp_path, [cb, seen], max_steps=12).fit(module, loader(world))
    during = [r for r in cb.reports if r.step in seen.buffers]  # not the final one, taken in on_train_end
    (pool,) = seen.pools  # one pool for the fit
    assert len(during) >= 3 and pool.allocations == 1  # busy="skip": one set, allocated once
    assert cb.engine.schedule.pool is None  # released when fit ends
    assert len({seen.buffers[r.step] for r in during}) == 1  # the same buffers for every snapshot
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    for report in during:
        assert report.tasks == service.score(world.config, seen.weights[report.step], step=report.step).tasks
    assert_clean(tmp_path / "d", cb.reports)


def test_a_capture_that_fails_gives_its_buffers_back_to_the_pool(world):
    """A copy that fails partway (here: a pool set of another shape) must not cost the pool its
    set: later snapshots would allocate fresh (on CUDA pinned, seconds) buffers instead."""
    drafter = DFlashDrafter(world.config)
    state = drafter.state_dict()
    first = next(iter(state))
    pool = StagingPool(1)
    pool.allocate({**state, first: state[first][:1]}, pin=False)
    with pytest.raises(RuntimeError):
        capture(drafter, world.config, 1, 0, pool)
    assert pool.acquire() is not None and pool.allocations == 1


class ReadsResultsWhenLogged(CSVLogger):
    """A real CSV logger that, each time dflash metrics reach it, reads results.jsonl."""

    def __init__(self, cb: DrafterEvalCallback, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cb, self.seen = cb, []

    def log_metrics(self, metrics, step=None):
        if "dflash/step" in metrics:
            on_disk = [r.step for r in self.cb.run.read_results().reports]
            self.seen.append((int(metrics["dflash/step"]), on_disk))
        super().log_metrics(metrics, step)


def test_scoring_runs_on_the_runners_thread_and_each_report_is_on_disk_before_it_is_logged(world, tmp_path,
                                                                                           monkeypatch):
    """Who scores: `score_drafter` (the real one, wrapped to note its thread) never runs on
    the training thread. When a report's numbers reach a logger, its line is already in
    results.jsonl."""
    import threading

    from dflash_callbacks.scoring import service

    threads, real = [], service.score_drafter

    def noting_thread(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "score_drafter", noting_thread)
    torch.manual_seed(0)
    cb = DrafterEvalCallback(cache=world.cache, target=world.target, every_n_train_steps=3, scoring=SCORING,
                             busy="queue", max_pending=4, dirpath=tmp_path / "dflash", verbose=False)
    logger = ReadsResultsWhenLogged(cb, tmp_path / "logs", name="run")
    t = pl.Trainer(max_steps=9, accelerator="cpu", logger=logger, callbacks=[cb], enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False)
    t.fit(DFlashTrainingModule(world.config, world.target, lr=3e-3), loader(world))
    assert threads == ["dflash-eval"] * 3 and threading.current_thread().name not in threads
    assert [step for step, _ in logger.seen] == [3, 6, 9]
    assert all(step in on_disk for step, on_disk in logger.seen)
