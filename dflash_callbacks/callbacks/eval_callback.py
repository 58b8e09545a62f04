"""DrafterEvalCallback: score the live drafter against a baseline while training runs.

On the training thread it only starts weight copies and drains finished reports:

    setup:                 check that drafter, cache, target, scoring config, device and
                           baseline fit together (scoring.service.preflight), every rank
    on_train_start:        rank 0 opens the run folder: a fresh one for a fresh run, the
                           same one on a resume (run_folder.RunFolder), and starts the runner
    on_train_batch_end, step % every_n_train_steps == 0:
                           rank 0 starts a copy of the drafter's weights into reused host
                           buffers (snapshot.capture) and submits it to the runner
    on_before_optimizer_step:
                           wait for that copy, so the weights scored are those of the step
    on_train_batch_end:    publish every finished report (publish.Publisher)
    on_train_epoch_end, the last (or else on_train_end):
                           the last step's snapshot, with wait_on_end, before any callback's
                           on_train_end can write the weights (WeightAveraging)

A failure in snapshotting, scoring, writing or logging is a warning and an error count,
unless `on_error="raise"`. Every submitted snapshot ends as a report or an error line in
results.jsonl, also when `wait_timeout` runs out; when the fit fails, a snapshot written
and not scored is left on disk instead, for a resume to score.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..checks import check_bool, check_choice, check_int, check_number
from ..model import DrafterConfig
from ..scoring.config import ScoringConfig
from ..scoring.basis import Basis
from ..scoring.report import EvalReport
from ..scoring.service import ServiceSpec, preflight
from .publish import Publisher, ReportSource, Subscriber, metric_keys, report_sources
from .run_folder import RunFolder, new_run_id
from .runners import RUNNERS, BackgroundRunner, BaselineOutcome, Job, SnapshotOutcome, is_non_finite
from .snapshot import StagingPool, capture, is_sharded

BUSY_POLICIES = ("skip", "queue")
ON_ERROR = ("warn", "raise")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def drafters_in(pl_module: nn.Module) -> list[str]:
    """The attribute paths of the submodules that look like a DFlash drafter (a DrafterConfig at
    `.config`, or the published `fc` and `hidden_norm`): what `drafter=` may name."""
    return [name for name, m in pl_module.named_modules() if name and (
        isinstance(getattr(m, "config", None), DrafterConfig)
        or (isinstance(getattr(m, "fc", None), nn.Module) and isinstance(getattr(m, "hidden_norm", None), nn.Module)))]


def resolve_drafter(pl_module: nn.Module, drafter: str | Callable) -> nn.Module:
    if callable(drafter):
        module = drafter(pl_module)
    else:
        module = pl_module
        for part in drafter.split("."):
            if not hasattr(module, part):
                raise AttributeError(
                    f"DrafterEvalCallback(drafter={drafter!r}): {type(module).__name__} has no attribute {part!r}; "
                    f"pass the attribute path of the drafter (drafter-like submodules of {type(pl_module).__name__}: "
                    f"{drafters_in(pl_module)}) or a function module -> drafter"
                )
            module = getattr(module, part)
    if not isinstance(module, nn.Module):
        raise TypeError(f"DrafterEvalCallback(drafter={drafter!r}): the drafter must be an nn.Module; "
                        f"got {type(module).__name__}")
    return module


def drafter_config_of(module: nn.Module, given: DrafterConfig | str | os.PathLike | None,
                      pl_module: nn.Module | None = None, drafter: str | Callable = "drafter") -> DrafterConfig:
    if isinstance(given, DrafterConfig):
        return given
    if given is not None:
        return DrafterConfig.from_file(given)
    config = getattr(module, "config", None)
    if isinstance(config, DrafterConfig):
        return config
    if hasattr(config, "to_dict"):  # a transformers config of the published model class
        return DrafterConfig.from_dict(config.to_dict())
    found = drafters_in(pl_module) if pl_module is not None else []
    raise ValueError(f"DrafterEvalCallback(drafter={drafter!r}) gives a {type(module).__name__} with no DrafterConfig at "
                     ".config: if it is the drafter, pass drafter_config=DrafterConfig or a config.json path; if not, "
                     f"point drafter= at the drafter (drafter-like submodules: {found})")


def should_snapshot(step: int, every_n_train_steps: int) -> bool:
    return step > 0 and step % every_n_train_steps == 0


def fit_ends(trainer: pl.Trainer) -> bool:
    """Whether the fit loop ends after this epoch: Lightning's `FitLoop.done` without its side
    effects (at max_epochs it moves the epoch counter on before the epoch has completed, so
    ModelCheckpoint and the hooks after ours saw the last epoch as the next one, and it logs)."""
    def reached(current: int, limit: int | None) -> bool:
        return limit is not None and limit != -1 and current >= limit

    epochs, step = trainer.fit_loop.epoch_progress.current.processed, trainer.global_step
    return (reached(step, trainer.max_steps) or reached(epochs, trainer.max_epochs)
            or (trainer.should_stop and epochs >= (trainer.min_epochs or 0) and step >= (trainer.min_steps or 0)))


def _path(name: str, value: Any, optional: bool = False) -> Path | None:
    if optional and value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike); got {type(value).__name__}")
    return Path(value)


class DrafterEvalCallback(ReportSource):
    """Snapshot the drafter every `every_n_train_steps` steps and score it in the background.

    Args:
        cache: hidden-state cache folder (`dflash-callbacks extract`).
        target: the target's folder; only `embed_tokens` and `lm_head` are read.
        baseline: a published drafter folder (scored once, cached) or a saved report JSON.
        every_n_train_steps: snapshot cadence in optimizer steps (>= 1).
        drafter: attribute path on the LightningModule, or a function module -> drafter.
        drafter_config: a DrafterConfig or config.json path, when the drafter has none at `.config`.
        scoring: a ScoringConfig or a dict (or OmegaConf DictConfig) of its fields (copied, never changed).
        runner: "thread" | "process" | "external".
        device: where scoring runs ("auto": cuda when available); overrides scoring.device.
        busy: "skip" (no new snapshot while one is pending) or "queue" (up to `max_pending`).
        max_pending: snapshots pending at once with busy="queue" (>= 1).
        keep_last: snapshots kept on disk (0: none written; runner "thread" only).
        on_error: "warn" (training goes on) or "raise".
        wait_on_end: score and log the last step before `fit` returns.
        dirpath: the folder that holds this callback's runs, one subfolder per run
            (default: <default_root_dir>/<name>).
        baseline_cache_dir: where baseline reports are cached across runs
            (default: $XDG_CACHE_HOME/dflash_callbacks/baselines, ~/.cache/... without it).
        wait_timeout: seconds `fit` waits at the end for pending reports (> 0); what is
            still pending then is recorded as an error.
        name: the metric prefix, the default folder name, and what TrailingBaselineStop(eval_callback=...) names.
        verbose: print a one-line summary per report.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        target: str | os.PathLike,
        baseline: str | os.PathLike | None = None,
        every_n_train_steps: int = 500,
        drafter: str | Callable[[pl.LightningModule], nn.Module] = "drafter",
        drafter_config: DrafterConfig | str | os.PathLike | None = None,
        scoring: ScoringConfig | Mapping | None = None,
        runner: str = "thread",
        device: str | None = None,
        busy: str = "skip",
        max_pending: int = 1,
        keep_last: int = 2,
        on_error: str = "warn",
        wait_on_end: bool = True,
        dirpath: str | os.PathLike | None = None,
        baseline_cache_dir: str | os.PathLike | None = None,
        wait_timeout: float = 3600.0,
        name: str = "dflash",
        verbose: bool = True,
    ):
        super().__init__()
        self.cache, self.target = _path("cache", cache), _path("target", target)
        self.baseline_source = _path("baseline", baseline, optional=True)
        self.every_n_train_steps = check_int("every_n_train_steps", every_n_train_steps, 1)
        if not (isinstance(drafter, str) or callable(drafter)):
            raise TypeError("drafter must be an attribute name or a function LightningModule -> drafter")
        if not (drafter_config is None or isinstance(drafter_config, (DrafterConfig, str, os.PathLike))):
            raise TypeError("drafter_config must be a DrafterConfig, a config.json path or None")
        self.drafter, self.drafter_config = drafter, drafter_config
        self.scoring = _scoring_copy(scoring, device)
        self.runner_kind = check_choice("runner", runner, RUNNERS)
        self.busy = check_choice("busy", busy, BUSY_POLICIES)
        self.max_pending = check_int("max_pending", max_pending, 1)
        self.keep_last = check_int("keep_last", keep_last, 0)
        if keep_last == 0 and runner != "thread":
            raise ValueError(f"runner={runner!r} reads snapshots from disk, so keep_last must be >= 1")
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        self.wait_on_end = check_bool("wait_on_end", wait_on_end)
        self.dirpath = _path("dirpath", dirpath, optional=True)
        if self.dirpath is not None and self.dirpath.exists() and not self.dirpath.is_dir():
            raise ValueError(f"dirpath {self.dirpath} is a file: give the folder that holds this callback's runs "
                             "(it is made if it does not exist)")
        self.baseline_cache_dir = _path("baseline_cache_dir", baseline_cache_dir, optional=True)
        self.wait_timeout = check_number("wait_timeout", wait_timeout, above=0)
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"name must be letters, digits, '_', '-' or '.', starting with a letter or digit; got {name!r}")
        self.name = name
        self.verbose = check_bool("verbose", verbose)

        self.run_id: str | None = None
        self.run: RunFolder | None = None
        self.history: list[dict] = []  # this run's reports, by step: {"step", "mean": {method: {agg: value}}}
        self.errors = 0
        self.skipped = 0
        self.baseline_report: EvalReport | None = None
        self.reports: list[EvalReport] = []  # reports published by this process, in arrival order
        self._subscribers: list[Subscriber] = []
        self._runner: BackgroundRunner | None = None
        self._publisher: Publisher | None = None
        self._pool: StagingPool | None = None
        self._staging = None
        self._restored: dict | None = None
        self._opened = False
        self._taken: set[int] = set()  # steps with a report, or queued: never snapshotted again
        self._recovered: list[EvalReport] = []  # watcher reports a killed run never picked up
        self._rejected: list[SnapshotOutcome] = []  # ... and those on another basis, as errors
        self._baseline_settled = False
        self._last_capture_step: int | None = None
        self._last_taken_step: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name, cache=str(self.cache))

    def scored_methods(self) -> list[str]:
        return self.scoring.methods

    def has_baseline(self) -> bool:
        return self.baseline_source is not None

    def run_history(self, trainer, pl_module) -> list[dict]:
        self.open_run(trainer, pl_module)
        return list(self.history)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(report, baseline)` on the training thread for every new report; returns a
        function that unsubscribes it. A subscriber that raises is reported like any failure."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        report_sources(trainer.callbacks)  # no other one of this name
        module = resolve_drafter(pl_module, self.drafter)
        self._config = drafter_config_of(module, self.drafter_config, pl_module, self.drafter)
        self._spec = ServiceSpec(
            cache=str(self.cache), target=str(self.target),
            baseline=None if self.baseline_source is None else str(self.baseline_source),
            scoring=self.scoring.to_dict(),
            baseline_cache_dir=None if self.baseline_cache_dir is None else str(self.baseline_cache_dir),
        )
        self._basis = preflight(self._spec, self._config, {k: tuple(v.shape) for k, v in module.state_dict().items()})
        if 0 < trainer.max_steps < self.every_n_train_steps:
            rank_zero_warn(f"{self.name}: every_n_train_steps={self.every_n_train_steps} is more than max_steps="
                           f"{trainer.max_steps}: no snapshot is taken while training"
                           + (", only the last step's at the end" if self.wait_on_end else "")
                           + "; set every_n_train_steps= to a cadence that fits the run")
        self._restored, self._opened = None, False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def on_train_start(self, trainer, pl_module) -> None:
        self.open_run(trainer, pl_module)

    def open_run(self, trainer, pl_module) -> None:
        """Rank 0: open this run's folder, recover what a killed run left, start the runner.
        Idempotent within a fit (TrailingBaselineStop calls it to read the history)."""
        if self._opened:
            return
        self._opened = True
        self._fresh_state(self._restored)
        if not trainer.is_global_zero:
            return
        root = self.dirpath or Path(trainer.default_root_dir) / self.name
        watcher_baseline = (str(self.baseline_source.resolve())  # read by a watcher started elsewhere
                            if self.baseline_source and self.baseline_source.is_dir() else None)
        about = {"runner": self.runner_kind, "basis": self._basis.to_dict(), "baseline": watcher_baseline}
        self._publisher = None
        jobs = []
        if self._restored is not None and self._restored.get("run_id"):
            self.run_id = self._restored["run_id"]
            self.run = RunFolder.reopen(root, self.run_id, about)
            changed = self._basis_changes()
            if changed:
                self.run.unlock()
                self._fresh_state({k: v for k, v in self._restored.items() if k in ("errors", "skipped")})
                self.run = None
                rank_zero_warn(f"{self.name}: run {self._restored['run_id']} was scored with {'; '.join(changed)}; its "
                               "numbers can not stand beside this resume's, so the resume goes on in a new run folder")
            else:  # a watcher reads the runner and the baseline of the resume, not those of the killed run
                self.run.update_about(about)
                jobs = self._recover()
        if self.run is None:
            self.run_id = new_run_id()
            self.run = RunFolder.create(root, self.run_id, about)
            rank_zero_info(f"{self.name}: new run {self.run_id}, writing to {self.run.path}")
        self._publisher = Publisher(self.name, self.run, self._fail, self.verbose, self._subscribers)
        self._restore_metrics(trainer)
        try:
            for outcome in self._rejected:  # every line on disk first: on_error="raise" raises at the first
                self._record_outcome(trainer, outcome)
            for outcome in self._rejected:
                self._fail(trainer, f"step {outcome.step} failed: {outcome.error}")
        except Exception:  # before the runner starts: nothing queued is cancelled, the folder is let go
            self.run.unlock()
            raise
        self._runner = BackgroundRunner(self.runner_kind, self._spec, self.run, self.keep_last, self._basis)
        for job in jobs:
            self._runner.submit(job)
        module = resolve_drafter(pl_module, self.drafter)
        if not is_sharded(module):
            self._pool = StagingPool(1 if self.busy == "skip" else self.max_pending)
            state = {k: v.detach() for k, v in module.state_dict().items()}
            pin = any(t.is_cuda for t in state.values())
            threading.Thread(target=self._pool.allocate, args=(state, pin), name="dflash-staging", daemon=True).start()

    def _fresh_state(self, restored: dict | None) -> None:
        restored = restored or {}
        self.run_id, self.run = None, None
        self.history = list(restored.get("history", []))
        self.errors, self.skipped = restored.get("errors", 0), restored.get("skipped", 0)
        self.baseline_report, self.reports = None, []
        self._taken = {h["step"] for h in self.history}
        self._recovered, self._rejected, self._baseline_settled = [], [], self.baseline_source is None
        self._metrics_restored = False  # callback_metrics hold the resumed history's last means, nothing newer
        self._last_capture_step = self._last_taken_step = None

    def _basis_changes(self) -> list[str]:
        """How this resume's basis differs from the resumed run's: the checkpoint's (its history's; the
        folder may be gone and recreated), run.json's, else, with neither recorded, its first report's."""
        bases = []
        for recorded in (self._restored.get("basis"), self.run.about().get("basis")):
            try:
                bases.append(Basis.from_dict(recorded))
            except (TypeError, ValueError, AttributeError):  # none recorded (an older run), or damaged
                pass
        if not bases:
            reports = self.run.read_results().reports
            bases = [Basis.of_report(reports[0])] if reports else []
        return next((changed for basis in bases if (changed := self._basis.differences(basis))), [])

    def _restore_metrics(self, trainer) -> None:
        """A resume: the last report's means back in callback_metrics (Lightning starts them
        empty), with the baseline's, the deltas and the ratios once the baseline is known."""
        if not self.history:
            return
        last, means = self.history[-1], {}
        base = self.baseline_report.mean if self.baseline_report is not None else {}
        for method, aggs in last["mean"].items():
            for agg, ours in aggs.items():
                means.update(metric_keys(self.name, method, agg, "mean", ours, base.get(method, {}).get(agg)))
        self._publisher.set_callback_metrics(trainer, last["step"], means)
        self._metrics_restored = True

    def _recover(self) -> list[Job]:
        """A resume: the history from results.jsonl, the watcher reports a killed run never
        picked up (published once the baseline is settled), its unscored snapshots as jobs."""
        found = self.run.recover()
        if found.torn_bytes:
            rank_zero_warn(f"{self.name}: {self.run.results_path} ended in a torn line (a crash while appending); "
                           f"dropped its {found.torn_bytes} bytes")
        for line in found.results.skipped:
            rank_zero_warn(f"{self.name}: {self.run.results_path} {line}; skipped")
        if found.results.reports:
            self.history = sorted({r.step: {"step": r.step, "mean": r.mean} for r in found.results.reports}.values(),
                                  key=lambda h: h["step"])
        self._recovered, self._rejected = [], []
        for report in found.unread_reports:  # a watcher's: it may have scored on another basis
            problems = self._basis.mismatches(report, f"the watcher's report of step {report.step}")
            if problems:
                self._rejected.append(SnapshotOutcome(step=report.step, snapshot_id=report.snapshot_id,
                                                      error="; ".join(problems) + "; not recorded"))
            else:
                self._recovered.append(report)
        jobs = [Job(step, snapshot_id, folder=folder) for step, snapshot_id, folder in found.unscored_snapshots]
        self._taken = ({h["step"] for h in self.history} | {r.step for r in self._recovered} | {j.step for j in jobs})
        rank_zero_info(f"{self.name}: resuming run {self.run_id} in {self.run.path}: {len(self.history)} reports, "
                       f"{len(self._recovered)} recovered from the watcher, {len(jobs)} unscored snapshot(s) queued")
        return jobs

    # ------------------------------------------------------------------ training hooks
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._drain(trainer)
        step = trainer.global_step
        if should_snapshot(step, self.every_n_train_steps) and step != self._last_capture_step:
            self._snapshot(trainer, pl_module, step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._copy_landed()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._copy_landed()  # before any callback's on_validation_epoch_start (an EMA swap writes the weights)

    def _copy_landed(self) -> None:
        """Wait for the snapshot's device-to-host copy (CUDA: a side stream) before the weights
        can be written in place: by the optimizer step, or by another callback."""
        if self._staging is not None:
            self._staging.wait()
            self._staging = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if fit_ends(trainer):  # the last hook before any callback's on_train_end (WeightAveraging writes the weights)
            self._last_snapshot(trainer, pl_module)

    def _last_snapshot(self, trainer, pl_module) -> None:
        """The last step's snapshot, copy landed (no optimizer step follows to wait for it)."""
        step = trainer.global_step
        if self.wait_on_end and step > 0 and step != self._last_taken_step:  # also when skipped while busy
            self._snapshot(trainer, pl_module, step, force=True)  # every rank: a sharded gather is collective
        self._copy_landed()

    def on_train_end(self, trainer, pl_module) -> None:
        self._last_snapshot(trainer, pl_module)  # taken already, unless a stop came after on_train_epoch_end
        if self._runner is None:
            return
        if self.wait_on_end:
            if self._runner.pending:
                rank_zero_info(f"{self.name}: waiting for {self._runner.pending} pending report(s) "
                               f"(steps {self._runner.pending_steps()}), at most {self.wait_timeout:g} s")
            self._close(trainer, True, f"wait_timeout={self.wait_timeout:g} s ran out at the end of training")
        else:
            self._close(trainer, False, "wait_on_end=False: fit returned without waiting for it")

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._runner is not None:
            self._close(trainer, False, f"the fit stopped on {type(exception).__name__}", publish=False)

    def _close(self, trainer, wait: bool, reason: str, publish: bool = True) -> None:
        runner, self._runner = self._runner, None
        runner.close(wait, self.wait_timeout, reason)
        try:  # on_error="raise" may raise from here: the folder is unlocked all the same
            if publish:
                self._drain(trainer, runner)  # a baseline polled now still comes before the recovered reports
                self._baseline_settled = True  # no baseline comes after this
                self._publish_recovered(trainer)
            else:  # the fit is failing: keep every outcome on disk, log nothing
                left = []
                for outcome in runner.poll():
                    if getattr(outcome, "on_disk", False):  # no error line: a resume scores it, as after a kill
                        left.append(outcome.step)
                    else:
                        self._keep(trainer, outcome)
                if left:
                    rank_zero_warn(f"{self.name}: {reason}: the snapshots of steps {left} are in {self.run.snapshots_dir}, "
                                   "not scored; a resume from a checkpoint scores them")
            self._publisher.record(trainer, None)
        finally:
            self.run.unlock()

    # ------------------------------------------------------------------ snapshots
    def _snapshot(self, trainer, pl_module, step: int, force: bool = False) -> None:
        """Rank 0 decides whether to snapshot; with sharded (FSDP) weights every rank
        takes part in the gather, so the decision is broadcast first."""
        self._last_capture_step = step
        module = resolve_drafter(pl_module, self.drafter)
        skip = False
        if trainer.is_global_zero:
            skip = self._runner is None or step in self._taken
            limit = 1 if self.busy == "skip" else self.max_pending
            if not skip and not force and self._runner.pending >= limit:
                self.skipped += 1
                skip = True
        sharded = is_sharded(module)
        if sharded and trainer.world_size > 1:
            skip = trainer.strategy.broadcast(skip, src=0)
        if not skip:
            self._last_taken_step = step
        if skip or not (trainer.is_global_zero or sharded):
            return
        try:
            snapshot = capture(module, self._config, step, trainer.current_epoch, self._pool,
                               is_rank_zero=trainer.is_global_zero)
        except Exception as e:
            self._fail(trainer, f"taking the snapshot of step {step} failed: {type(e).__name__}: {e}")
            return
        if snapshot is not None:
            self._staging = snapshot
            self._taken.add(step)
            self._runner.submit(Job(step, snapshot.snapshot_id, snapshot=snapshot))

    # ------------------------------------------------------------------ reports
    def _drain(self, trainer, runner: BackgroundRunner | None = None) -> None:
        runner = runner or self._runner
        if runner is None:
            return
        outcomes = runner.poll()
        handled = 0
        try:
            self._publish_recovered(trainer)
            for outcome in outcomes:
                handled += 1
                self._handle(trainer, outcome)
        except Exception:  # on_error="raise": what was polled and not handled still reaches the disk
            for rest in outcomes[handled:]:
                try:
                    self._keep(trainer, rest)
                except Exception:
                    pass  # the first failure is the one raised; the next outcomes are still kept
            raise

    def _handle(self, trainer, outcome) -> None:
        if isinstance(outcome, BaselineOutcome):
            self._baseline_settled = True
            if outcome.error is None:
                self.baseline_report = outcome.report
                if self._metrics_restored:
                    self._restore_metrics(trainer)  # a resume, nothing newer yet: now with the baseline's keys
            self._publish_recovered(trainer)  # older than anything polled after the baseline
            if outcome.error is not None:
                self._fail(trainer, f"scoring the baseline failed: {outcome.error}")
            return
        if outcome.error is not None:
            self._record_outcome(trainer, outcome)
            if is_non_finite(outcome.error):  # the drafter's numbers are NaN: so are its means
                self._publisher.set_callback_metrics(trainer, outcome.step, {
                    key: float("nan") for key in trainer.callback_metrics if self._is_mean(key)})
                self._metrics_restored = False
            self._fail(trainer, f"step {outcome.step} failed: {outcome.error}")
        else:
            self._publish(trainer, outcome.report, outcome.seconds)

    def _keep(self, trainer, outcome) -> None:
        """An outcome on disk without logging it (the fit is failing)."""
        if isinstance(outcome, BaselineOutcome):
            self.baseline_report = outcome.report or self.baseline_report
        elif outcome.report is not None:
            self._publisher.record_report(trainer, outcome.report, outcome.seconds)
        else:
            self._record_outcome(trainer, outcome)

    def _publish_recovered(self, trainer) -> None:
        """The watcher reports a killed run never picked up: older than any job, so first,
        once the baseline is settled."""
        while self._recovered and self._baseline_settled:
            self._publish(trainer, self._recovered.pop(0), None)

    def _is_mean(self, key: str) -> bool:
        """A mean of ours (or its delta or ratio) in callback_metrics; not the baseline's."""
        return key.startswith(f"{self.name}/") and key.endswith("/mean") and not key.startswith(f"{self.name}/baseline/")

    def _record_outcome(self, trainer, outcome: SnapshotOutcome) -> None:
        self._publisher.record(trainer, {"step": outcome.step, "snapshot_id": outcome.snapshot_id,
                                         "error": outcome.error, "seconds": outcome.seconds})

    def _publish(self, trainer, report: EvalReport, seconds: float | None) -> None:
        seconds = report.seconds if seconds is None else seconds
        if not self._publisher.publish(trainer, report, self.baseline_report, seconds, self.errors):
            return  # refused: an error line, nothing logged
        self._metrics_restored = False  # callback_metrics hold newer numbers now
        self.history = sorted([h for h in self.history if h["step"] != report.step]
                              + [{"step": report.step, "mean": report.mean}], key=lambda h: h["step"])
        self.reports.append(report)

    def _fail(self, trainer, message: str) -> None:
        self.errors += 1
        if self.on_error == "raise":
            raise RuntimeError(f"{self.name}: {message}")
        rank_zero_warn(f"{self.name}: {message} (training goes on; errors so far: {self.errors})")
        if self._publisher is not None:
            self._publisher.log_error_count(trainer, self.errors)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "basis": self._basis.to_dict() if self.run_id else None,  # what the history was scored on
            "history": [{"step": h["step"], "mean": h["mean"]} for h in self.history],
            "errors": self.errors,
            "skipped": self.skipped,
        }


def _scoring_copy(scoring: ScoringConfig | Mapping | None, device: str | None) -> ScoringConfig:
    """The caller's scoring config, copied (never changed), with `device` applied. A mapping
    may be an OmegaConf DictConfig (what Hydra's `instantiate` passes for a nested section)."""
    if isinstance(scoring, DictConfig):
        missing = sorted(OmegaConf.missing_keys(scoring))  # '???': named as unset, not checked as a value
        if missing:
            raise ValueError(f"scoring leaves required keys unset (???): {missing}")
        scoring = OmegaConf.to_container(scoring, resolve=True)
    if isinstance(scoring, ScoringConfig):
        fields = dataclasses.asdict(scoring)
    elif isinstance(scoring, Mapping) or scoring is None:
        fields = dict(scoring or {})
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ScoringConfig)})
        if unknown:
            legal = [f.name for f in dataclasses.fields(ScoringConfig)]
            raise ValueError(f"scoring has unknown field(s) {unknown}; the fields are {legal}")
    else:
        raise TypeError(f"scoring must be a ScoringConfig, a dict (or DictConfig) of its fields or None; "
                        f"got {type(scoring).__name__}")
    if device is not None:
        fields["device"] = device
    return ScoringConfig(**fields)


__all__ = ["DrafterEvalCallback", "should_snapshot"]
