"""EvalEngine: snapshot a drafter while it trains, score it in the background, publish every
report, and decide whether training stops. No framework here: each adapter (Lightning,
the plain PyTorch loop, the transformers Trainer) gives the engine a `Host` and calls it at
a few points of its loop:

    check(host, drafter, config, max_steps)   every rank, before training: every input fits
                                              together (scoring.service.preflight), or it raises
    start(host, drafter)                      every rank, at the first step: rank 0 opens the run
                                              folder (fresh, or the resumed run's) and starts the runner
    on_step(step, epoch, drafter)             every rank, after each optimizer step: rank 0 publishes
                                              finished reports and, every `every_n_steps`, starts a
                                              copy of the weights; ranks exchange the news (means, the
                                              stop, the snapshot decision); returns the stop's reason
    copy_landed()                             before anything writes the weights in place (the next
                                              optimizer step): the copy has landed
    finish(step, epoch, drafter)              every rank, once training is over: the last step's snapshot
    close(wait, reason, publish)              rank 0: the last reports, then the run folder is released

Without a training loop (`watch --checkpoints`, which scores the checkpoints a trainer saves),
`check` takes the drafter's config and tensor shapes instead of a live drafter, `start` opens
the run folder, `submit(job)` scores a checkpoint in the background and `poll()` publishes
what is finished and returns a stop's reason.

The engine reads the training process and never writes to it: the only global state it
touches is what the host is asked to log and the stop it returns. Scoring builds every
tensor with an explicit dtype and device, and never draws from the global RNG.

A failure in snapshotting, scoring, writing or logging is a warning and an error count,
unless `on_error="raise"`. Every submitted snapshot ends as a report or an error line in
results.jsonl, also when `wait_timeout` runs out; when training fails, a snapshot written
and not scored is left on disk instead, for a resume to score.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checks import check_bool, check_choice, check_int, check_number
from ..model import DrafterConfig
from ..scoring.basis import Basis
from ..scoring.config import ScoringConfig
from ..scoring.methods import AGGREGATES
from ..scoring.report import EvalReport
from ..scoring.service import ServiceSpec, preflight
from ..scoring.intervals import resolution_warning
from .publish import Logger, Publisher, Subscriber, metric_keys, summary_line, versus_record
from .run_folder import RunFolder, new_run_id
from .runners import RUNNERS, BackgroundRunner, BaselineOutcome, Job, SnapshotOutcome, is_non_finite, versus_baseline
from .snapshot import StagingPool, capture, is_sharded
from .stop import Moment, StopPolicy, Stops

BUSY_POLICIES = ("skip", "queue")
MEAN_KEYS = ("/mean", "/mean_lo", "/mean_hi")  # the run-level keys the host's metrics hold
ON_ERROR = ("warn", "raise")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def console_log() -> logging.Logger:
    """The "dflash_callbacks" logger; when the program has configured no logging at all, its INFO
    lines go to stderr (as Lightning does for its own), so a plain loop sees the run folder and the
    summaries."""
    log = logging.getLogger("dflash_callbacks")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class Host:
    """The training loop as the engine sees it. Each adapter subclasses it; these defaults are
    one process with no logger, no known last step, and messages through `logging`/`warnings`."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (a collective: every rank calls it at the same point)."""
        return obj

    def default_dirpath(self, name: str) -> Path:
        """Where run folders go when `dirpath` is not given."""
        return Path.cwd() / name

    def loggers(self) -> list[Logger]:
        """Where metrics go (rank 0), as (name, log(metrics, step)), looked up at each report."""
        return []

    def wandb_runs(self) -> list[tuple[str, Any, Callable[[dict, int], object]]]:
        """The W&B runs that get the metrics, tables and curves: (a name for errors, the run, how a row is
        written to it)."""
        return []

    def set_metrics(self, metrics: dict[str, float]) -> None:
        """The latest means (every rank): Lightning's `callback_metrics`, the plain loop's `metrics`."""

    def horizon(self) -> int | None:
        """The last training step, when known (the stop's projection needs it)."""
        return None

    def ending(self) -> str | None:
        """Why training ends now whatever the stop says (None while it goes on)."""
        return None

    def info(self, text: str) -> None:
        if self.rank == 0:
            console_log().info(text)

    def warn(self, text: str) -> None:
        if self.rank == 0:
            warnings.warn(text, UserWarning, stacklevel=3)


class EngineView:
    """What every adapter reads of its engine (`self.engine`), under one set of names."""

    engine: EvalEngine

    @property
    def history(self) -> list[dict]:
        """This run's reports, by step: [{"step", "mean", "versus"}] (every rank)."""
        return self.engine.history

    @property
    def errors(self) -> int:
        return self.engine.errors

    @property
    def skipped(self) -> int:
        return self.engine.skipped

    @property
    def reports(self) -> list[EvalReport]:
        """The reports published by this process (rank 0), in arrival order."""
        return self.engine.reports

    @property
    def baseline_report(self) -> EvalReport | None:
        return self.engine.baseline_report

    @property
    def run(self) -> RunFolder | None:
        return self.engine.run

    @property
    def run_id(self) -> str | None:
        return self.engine.run_id

    @property
    def should_stop(self) -> bool:
        """Whether a stop has reached this rank."""
        return self.engine.should_stop

    @property
    def stop_reason(self) -> str | None:
        """Why a stop stopped training (or would have), None before."""
        return next((p.stop_reason for p in self.engine.stops.policies if p.stop_reason), None)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(report, baseline)` on the training thread of rank 0 for every new report; returns
        a function that unsubscribes it. A subscriber that raises is reported like any failure."""
        return self.engine.subscribe(fn)


def stop_policies(stop: StopPolicy | Sequence[StopPolicy] | None) -> list[StopPolicy]:
    """`stop=` of the plain-loop and transformers adapters, as a list (TypeError for anything else)."""
    stops = [] if stop is None else [stop] if isinstance(stop, StopPolicy) else list(stop)
    if not all(isinstance(s, StopPolicy) for s in stops):
        raise TypeError("stop must be a TrailingBaselineStop (a StopPolicy), a list of them, or None; got "
                        f"{[type(s).__name__ for s in stops if not isinstance(s, StopPolicy)]}")
    return stops


def log_functions(log: Callable | Sequence[Callable] | None) -> list[Callable[[dict, int], object]]:
    """`log=` of the plain-loop and transformers adapters, as a list (TypeError for anything else)."""
    functions = [] if log is None else [log] if callable(log) else list(log)
    if not all(callable(fn) for fn in functions):
        raise TypeError("log must be a function fn(metrics, step) or a list of them")
    return functions


def history_entry(report: EvalReport, versus: dict | None) -> dict:
    """What the history keeps of a report: its step, its run-level means and, with a baseline, their
    comparison with it (`versus_record`: the stops judge on its intervals, also after a resume)."""
    return {"step": report.step, "mean": report.mean, **({"versus": versus} if versus else {})}


def should_snapshot(step: int, every_n_steps: int) -> bool:
    return step > 0 and step % every_n_steps == 0


def check_path(name: str, value: Any, optional: bool = False) -> Path | None:
    if optional and value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike); got {type(value).__name__}")
    return Path(value)


def basis_changes(basis: Basis, run: RunFolder, recorded: dict | None = None) -> list[str]:
    """How `basis` differs from what the reports of `run` stand on: `recorded` (a resume's
    checkpoint's, its history's; the folder may be gone and recreated), run.json's, else, with
    neither recorded, its first report's. Empty: the same basis (or nothing to compare with)."""
    bases = []
    for raw in (recorded, run.about().get("basis")):
        try:
            bases.append(Basis.from_dict(raw))
        except (TypeError, ValueError, AttributeError):  # none recorded (an older run), or damaged
            pass
    if not bases:
        reports = run.read_results().reports
        bases = [Basis.of_report(reports[0])] if reports else []
    return next((changed for other in bases if (changed := basis.differences(other))), [])


def scoring_copy(scoring: ScoringConfig | Mapping | None, device: str | None) -> ScoringConfig:
    """The caller's scoring config, copied (never changed), with `device` applied. A mapping
    may be an OmegaConf DictConfig (what Hydra's `instantiate` passes for a nested section)."""
    if type(scoring).__name__ == "DictConfig":
        from omegaconf import OmegaConf

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


class EvalEngine:
    """Everything an evaluation of a training run does, for any loop (see the module docstring).

    Args (the adapters document them under their own names):
        cache, target, baseline: the hidden-state cache, the target's folder, the baseline
            (a drafter folder, scored once and cached, or a saved report JSON; None: no baseline).
        every_n_steps: snapshot cadence in optimizer steps (>= 1); `cadence` is its name in messages.
        scoring: a ScoringConfig or a mapping of its fields (copied); `device` overrides scoring.device.
        runner: "thread" | "process" | "external". busy: "skip" | "queue" (up to `max_pending`).
        keep_last: snapshots kept on disk (0: none written; runner "thread" only).
        on_error: "warn" | "raise". wait_on_end: score and publish the last step before closing.
        dirpath: the folder of this evaluator's runs (default: the host's, e.g. <default_root_dir>/<name>).
        baseline_cache_dir: where baseline reports are cached across runs.
        wait_timeout: seconds `close` waits for pending reports (> 0).
        name: the metric prefix and the default folder name. verbose: a line per report.
        sync_every_n_steps: with several processes, how often (in steps) rank 0's news reach the others.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        target: str | os.PathLike,
        baseline: str | os.PathLike | None = None,
        every_n_steps: int = 500,
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
        sync_every_n_steps: int = 1,
        cadence: str = "every_n_steps",
    ):
        self.cache, self.target = check_path("cache", cache), check_path("target", target)
        self.baseline_source = check_path("baseline", baseline, optional=True)
        self.cadence = cadence
        self.every_n_steps = check_int(cadence, every_n_steps, 1)
        self.scoring = scoring_copy(scoring, device)
        self.runner_kind = check_choice("runner", runner, RUNNERS)
        self.busy = check_choice("busy", busy, BUSY_POLICIES)
        self.max_pending = check_int("max_pending", max_pending, 1)
        self.keep_last = check_int("keep_last", keep_last, 0)
        if keep_last == 0 and runner != "thread":
            raise ValueError(f"runner={runner!r} reads snapshots from disk, so keep_last must be >= 1")
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        self.wait_on_end = check_bool("wait_on_end", wait_on_end)
        self.dirpath = check_path("dirpath", dirpath, optional=True)
        if self.dirpath is not None and self.dirpath.exists() and not self.dirpath.is_dir():
            raise ValueError(f"dirpath {self.dirpath} is a file: give the folder that holds this evaluator's runs "
                             "(it is made if it does not exist)")
        self.baseline_cache_dir = check_path("baseline_cache_dir", baseline_cache_dir, optional=True)
        self.wait_timeout = check_number("wait_timeout", wait_timeout, above=0)
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"name must be letters, digits, '_', '-' or '.', starting with a letter or digit; got {name!r}")
        self.name = name
        self.verbose = check_bool("verbose", verbose)
        self.sync_every_n_steps = check_int("sync_every_n_steps", sync_every_n_steps, 1)

        self.stops = Stops()
        self.host = Host()
        self._subscribers: list[Subscriber] = []
        self._runner: BackgroundRunner | None = None
        self._publisher: Publisher | None = None
        self._pool: StagingPool | None = None
        self._staging = None
        self._restored: dict | None = None
        self._started = False
        self._fresh({})

    # ------------------------------------------------------------------ what adapters read
    @property
    def scored_methods(self) -> list[str]:
        return self.scoring.methods

    def has_baseline(self) -> bool:
        return self.baseline_source is not None

    @property
    def should_stop(self) -> bool:
        """Whether a stop has reached this rank."""
        return self._stopped

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(report, baseline)` on the training thread of rank 0 for every new report; returns
        a function that unsubscribes it. A subscriber that raises is reported like any failure."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    def add_stop(self, policy: StopPolicy) -> None:
        """Follow `policy` (its monitor must be scored here)."""
        self.stops.add(policy, self.scored_methods, self.name)
        if not self.has_baseline():
            self.host.warn(f"{type(policy).__name__}: {self.name!r} has no baseline, so {policy.monitor} is recorded "
                           "but never judged and training is never stopped; give the evaluator baseline=...")

    @property
    def basis(self) -> Basis:
        """What every report of this run stands on (after `check`)."""
        return self._basis

    # ------------------------------------------------------------------ before training
    def check(self, host: Host, drafter: nn.Module | None, config: DrafterConfig, max_steps: int | None = None,
              shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Every rank, before training: the drafter, cache, target, scoring config, device and
        baseline fit together, or PreflightError lists every problem. Without a live drafter
        (a watcher of checkpoints), `shapes` gives its tensors' shapes."""
        self.host = host
        self._config = config
        self._pin_device(drafter)
        self._spec = ServiceSpec(
            cache=str(self.cache), target=str(self.target),
            baseline=None if self.baseline_source is None else str(self.baseline_source),
            scoring=self.scoring.to_dict(),
            baseline_cache_dir=None if self.baseline_cache_dir is None else str(self.baseline_cache_dir),
        )
        if shapes is None:
            shapes = {k: v.shape for k, v in drafter.state_dict().items()}
        self._shapes = {k: tuple(v) for k, v in shapes.items()}
        self._basis = preflight(self._spec, config, self._shapes)
        if max_steps is not None and 0 < max_steps < self.every_n_steps:
            host.warn(f"{self.name}: {self.cadence}={self.every_n_steps} is more than max_steps={max_steps}: no "
                      "snapshot is taken while training" + (", only the last step's at the end" if self.wait_on_end
                                                            else "") + f"; set {self.cadence}= to a cadence that fits the run")
        self._restored, self._started = None, False

    def _pin_device(self, drafter: nn.Module | None) -> None:
        """The thread runner scores on a definite CUDA device (its thread would otherwise take
        device 0): the drafter's, or this process's current one."""
        if self.runner_kind != "thread" or self.scoring.device not in ("auto", "cuda") or not torch.cuda.is_available():
            return
        devices = {p.device for p in drafter.parameters() if p.device.type == "cuda"} if drafter is not None else set()
        index = next(iter(devices)).index if len(devices) == 1 else torch.cuda.current_device()
        self.scoring = dataclasses.replace(self.scoring, device=f"cuda:{index}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume's state (what `state_dict` returned), before `start`."""
        self._restored = dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        """Primitives only, the same on every rank."""
        return {
            "run_id": self.run_id,
            "basis": self._basis.to_dict() if self.run_id else None,  # what the history was scored on
            "history": [dict(h) for h in self.history],
            "errors": self.errors,
            "skipped": self.skipped,
        }

    # ------------------------------------------------------------------ start
    def start(self, host: Host, drafter: nn.Module | None, run_id: str | None = None) -> None:
        """Every rank, once per run, before the first step: rank 0 opens this run's folder (a fresh
        one, named `run_id` or a new sortable id; or the resumed run's), recovers what a killed run
        left, starts the runner. Without a live drafter (None: a watcher of checkpoints), no staging
        buffers are made."""
        if self._started:
            return
        self._started = True
        self.host = host
        self._fresh(self._restored)
        if host.rank == 0:
            self._open(drafter, run_id)
        if host.world_size > 1:
            self.run_id = host.broadcast(self.run_id)  # every rank's state_dict names the run
        self._start_metrics()
        for policy in self.stops.policies:
            policy.load_history(self.history)

    def _fresh(self, restored: dict | None) -> None:
        restored = restored or {}
        self.run_id, self.run = None, None
        self.history: list[dict] = list(restored.get("history", []))
        self.errors, self.skipped = restored.get("errors", 0), restored.get("skipped", 0)
        self.baseline_report: EvalReport | None = None
        self.reports: list[EvalReport] = []  # reports published by this process, in arrival order
        self.metrics: dict[str, float] = {}  # the latest means, with <name>/step: the step they are of
        self._taken = {h["step"] for h in self.history}
        self._recovered: list[EvalReport] = []  # watcher reports a killed run never picked up
        self._rejected: list[SnapshotOutcome] = []  # ... and those on another basis, as errors
        self._baseline_settled = self.baseline_source is None
        self._metrics_restored = False  # metrics hold the resumed history's last means, nothing newer
        self._step: int | None = None  # the last step seen
        self._last_taken_step: int | None = None
        self._outgoing: list[dict] = []  # rank 0: history entries the other ranks have not received
        self._metrics_changed = False
        self._stopped = False
        self._closing = False
        self.stops.pending = None  # a stop of an earlier run that never reached every rank

    def _open(self, drafter: nn.Module | None, fresh_id: str | None) -> None:
        root = self.dirpath or self.host.default_dirpath(self.name)
        watcher_baseline = (str(self.baseline_source.resolve())  # read by a watcher started elsewhere
                            if self.baseline_source and self.baseline_source.is_dir() else None)
        about = {"runner": self.runner_kind, "basis": self._basis.to_dict(), "baseline": watcher_baseline,
                 "scoring": self.scoring.to_dict()}
        jobs = []
        if self._restored is not None and self._restored.get("run_id"):
            self.run_id = self._restored["run_id"]
            self.run = RunFolder.reopen(root, self.run_id, about)
            changed = self._basis_changes()
            if changed:
                self.run.unlock()
                self._fresh({k: v for k, v in self._restored.items() if k in ("errors", "skipped")})
                self.host.warn(f"{self.name}: run {self._restored['run_id']} was scored with {'; '.join(changed)}; "
                               "its numbers can not stand beside this resume's, so the resume goes on in a new run "
                               "folder")
            else:  # a watcher reads the runner and the baseline of the resume, not those of the killed run
                self.run.update_about(about)
                jobs = self._recover()
        if self.run is None:
            self.run_id = fresh_id or new_run_id()
            self.run = RunFolder.create(root, self.run_id, about)
            self.host.info(f"{self.name}: new run {self.run_id}, writing to {self.run.path}")
        self._publisher = Publisher(self.name, self.run, self._fail, self.host.loggers, self.host.wandb_runs)
        try:
            for outcome in self._rejected:  # every line on disk first: on_error="raise" raises at the first
                self._record_outcome(outcome)
            for outcome in self._rejected:
                self._fail(f"step {outcome.step} failed: {outcome.error}")
        except Exception:  # before the runner starts: nothing queued is cancelled, the folder is let go
            self.run.unlock()
            raise
        self._runner = BackgroundRunner(self.runner_kind, self._spec, self.run, self.keep_last, self._basis)
        for job in jobs:
            self._runner.submit(job)
        if drafter is not None and not is_sharded(drafter):
            self._pool = StagingPool(1 if self.busy == "skip" else self.max_pending)
            state = {k: v.detach() for k, v in drafter.state_dict().items()}
            pin = any(t.is_cuda for t in state.values())
            threading.Thread(target=self._pool.allocate, args=(state, pin), name="dflash-staging", daemon=True).start()

    def _basis_changes(self) -> list[str]:
        """How this resume's basis differs from the resumed run's (see `basis_changes`)."""
        return basis_changes(self._basis, self.run, self._restored.get("basis"))

    def _recover(self) -> list[Job]:
        """A resume: the history from results.jsonl, the watcher reports a killed run never
        picked up (published once the baseline is settled), its unscored snapshots as jobs;
        scored snapshots beyond keep_last are removed."""
        found = self.run.recover()
        if found.torn_bytes:
            self.host.warn(f"{self.name}: {self.run.results_path} ended in a torn line (a crash while appending); "
                           f"dropped its {found.torn_bytes} bytes")
        for line in found.results.skipped:
            self.host.warn(f"{self.name}: {self.run.results_path} {line}; skipped")
        if found.results.reports:
            self.history = sorted({r.step: history_entry(r, r.extra.get("versus_baseline"))
                                   for r in found.results.reports}.values(), key=lambda h: h["step"])
        self._recovered, self._rejected = [], []
        for report in found.unread_reports:  # a watcher's: it may have scored on another basis
            problems = self._basis.mismatches(report, f"the watcher's report of step {report.step}")
            if problems:
                self._rejected.append(SnapshotOutcome(step=report.step, snapshot_id=report.snapshot_id,
                                                      error="; ".join(problems) + "; not recorded"))
            else:
                self._recovered.append(report)
        jobs = [Job(step, snapshot_id, folder=folder) for step, snapshot_id, folder in found.unscored_snapshots]
        self.run.prune(self.keep_last, unscored=[job.folder for job in jobs])
        self._taken = ({h["step"] for h in self.history} | {r.step for r in self._recovered} | {j.step for j in jobs})
        self.host.info(f"{self.name}: resuming run {self.run_id} in {self.run.path}: {len(self.history)} reports, "
                       f"{len(self._recovered)} recovered from the watcher, {len(jobs)} unscored snapshot(s) queued")
        return jobs

    def mean_keys(self) -> list[str]:
        """Every run-level mean key a report of this evaluator publishes (with a baseline: its
        value, the delta and the ratio too), with its interval's `_lo` and `_hi`."""
        keys = []
        for method in self.scored_methods:
            for agg in AGGREGATES:
                keys += list(metric_keys(self.name, method, agg, "mean", 0.0, 1.0 if self.has_baseline() else None))
        return [key + end for key in keys for end in ("", "_lo", "_hi")]

    def _start_metrics(self) -> None:
        """Every mean key, before any report: NaN, a placeholder (a monitor of ours is never missing,
        and ModelCheckpoint ranks NaN below any number); on a resume, the last report's means."""
        self.metrics = {key: math.nan for key in self.mean_keys()}
        if self.history:
            self._restore_metrics()
        self.host.set_metrics(dict(self.metrics))

    def _restore_metrics(self) -> None:
        """A resume: the last report's means back (a loop starts them empty), with the baseline's,
        the deltas and the ratios once the baseline is known."""
        last, means = self.history[-1], {}
        base = self.baseline_report.mean if self.baseline_report is not None else {}
        for method, aggs in last["mean"].items():
            for agg, ours in aggs.items():
                means.update(metric_keys(self.name, method, agg, "mean", ours, base.get(method, {}).get(agg)))
        self._set_metrics(last["step"], means)
        self._metrics_restored = True

    def _set_metrics(self, step: int, means: dict[str, float]) -> None:
        """Rank 0: the means of `step`. With several ranks the host gets them at the next sync, on
        every rank at once (a monitor read on one rank only would leave the others out of a collective)."""
        self.metrics.update({**means, f"{self.name}/step": float(step)})
        self._metrics_changed = True
        if self.host.world_size == 1 or self._closing:
            self.host.set_metrics(dict(self.metrics))

    # ------------------------------------------------------------------ training
    def on_step(self, step: int, epoch: int, drafter: nn.Module) -> str | None:
        """Every rank, after the optimizer step `step` (a repeated step, under gradient accumulation,
        only publishes). Returns the stop's reason when the stop reaches the ranks at this step."""
        self._drain()
        if step == self._step:
            return None
        self._step = step
        snapshot = should_snapshot(step, self.every_n_steps)
        skip = self._skip(step, force=False) if snapshot else True
        sharded = snapshot and self.host.world_size > 1 and is_sharded(drafter)
        reason = None
        if self.host.world_size > 1:
            if sharded or step % self.sync_every_n_steps == 0:
                skip, reason = self._sync(step, skip)
        else:
            reason = self.stops.deliver(self.stops.take(), step)
        if snapshot:
            self._take(step, epoch, drafter, skip, sharded)
        if reason is not None:
            self._stopped = True
        return reason

    def _skip(self, step: int, force: bool) -> bool:
        """Rank 0's decision not to snapshot `step`: no runner, a step already taken, or (unless
        `force`) a runner as busy as `busy` allows. Other ranks say skip (they learn rank 0's when it matters)."""
        if self.host.rank != 0:
            return True
        if self._runner is None or step in self._taken:
            return True
        limit = 1 if self.busy == "skip" else self.max_pending
        if not force and self._runner.pending >= limit:
            self.skipped += 1
            return True
        return False

    def _sync(self, step: int, skip: bool) -> tuple[bool, str | None]:
        """One collective: rank 0's snapshot decision, new history, means, counts and stop reach
        every rank. Returns (skip, the stop's reason or None)."""
        news = None
        if self.host.rank == 0:
            news = {"skip": skip, "history": self._outgoing, "errors": self.errors, "skipped": self.skipped,
                    "metrics": dict(self.metrics) if self._metrics_changed else None, "stop": self.stops.take()}
            self._outgoing, self._metrics_changed = [], False
        news = self.host.broadcast(news)
        if self.host.rank != 0:
            for entry in news["history"]:
                self._add_history(entry)
            if news["history"]:
                for policy in self.stops.policies:  # every rank's state_dict holds the same history
                    policy.load_history(self.history)
            self.errors, self.skipped = news["errors"], news["skipped"]
        if news["metrics"] is not None:
            self.metrics = news["metrics"]
            self.host.set_metrics(dict(self.metrics))
        return news["skip"], self.stops.deliver(news["stop"], step)

    def _take(self, step: int, epoch: int, drafter: nn.Module, skip: bool, sharded: bool) -> None:
        """Start the snapshot of `step` (rank 0; every rank for sharded weights: the gather is collective)."""
        if not skip:
            self._last_taken_step = step
        if skip or not (self.host.rank == 0 or sharded):
            return
        try:
            changed = self._changed_keys(drafter)
            if changed:
                raise ValueError(changed)
            snapshot = capture(drafter, self._config, step, epoch, self._pool, is_rank_zero=self.host.rank == 0)
        except Exception as e:
            if self.host.rank == 0:
                error = f"taking the snapshot of step {step} failed: {type(e).__name__}: {e}"
                self._taken.add(step)
                self._publisher.record({"step": step, "snapshot_id": None, "error": error})
                self._fail(error)
            return
        if snapshot is not None:
            self._staging = snapshot
            self._taken.add(step)
            self._runner.submit(Job(step, snapshot.snapshot_id, snapshot=snapshot))

    def _changed_keys(self, drafter: nn.Module) -> str | None:
        """How the drafter's state-dict keys differ from those checked before training (None: they do not)."""
        now = set(drafter.state_dict())
        added, missing = sorted(now - set(self._shapes)), sorted(set(self._shapes) - now)
        if not added and not missing:
            return None
        return (f"the drafter's state dict changed since it was checked before training (added: {added or 'none'}; "
                f"missing: {missing or 'none'}); a snapshot holds the tensors the drafter had then: keep the drafter's "
                "tensors fixed while training, or start a new run")

    def copy_landed(self) -> None:
        """Wait for the snapshot's device-to-host copy (CUDA: a side stream) before the weights
        can be written in place: by the optimizer step, or by anything else."""
        if self._staging is not None:
            self._staging.wait()
            self._staging = None

    def finish(self, step: int, epoch: int, drafter: nn.Module) -> None:
        """Every rank, when training is over: the last step's snapshot (also when it was skipped
        while busy), its copy landed (no optimizer step follows to wait for it)."""
        if self.wait_on_end and step > 0 and step != self._last_taken_step:
            skip = self._skip(step, force=True)
            sharded = self.host.world_size > 1 and is_sharded(drafter)
            if sharded:
                skip = self.host.broadcast(skip)
            self._take(step, epoch, drafter, skip, sharded)
        self.copy_landed()

    # ------------------------------------------------------------------ without a training loop
    def submit(self, job: Job) -> None:
        """Rank 0, after `start`: score `job` in the background (a checkpoint a watcher found, read
        when the job runs); its outcome is published by `poll` like a snapshot's."""
        if self._runner is None:
            raise RuntimeError(f"{self.name}: submit() comes after start() and before close()")
        if job.read is not None and self.runner_kind != "thread":
            raise ValueError(f"a job read by a function is scored by the thread runner; this engine's is {self.runner_kind!r}")
        self._taken.add(job.step)
        self._runner.submit(job)

    def poll(self) -> str | None:
        """Rank 0, without a training loop: publish every finished outcome (results.jsonl first,
        then the loggers, the metrics and the stops); the reason of a stop decided since, or None."""
        self._drain()
        reason = self.stops.deliver(self.stops.take(), self.history[-1]["step"] if self.history else 0)
        if reason is not None:
            self._stopped = True
        return reason

    # ------------------------------------------------------------------ the end
    @property
    def pending(self) -> int:
        return self._runner.pending if self._runner is not None else 0

    def close(self, wait: bool, reason: str, publish: bool = True) -> None:
        """Rank 0: with `wait`, the pending reports within `wait_timeout` (what is left then is an
        error line saying `reason`); `publish=False` when training failed (nothing is logged, what
        is on disk stays for a resume). The staging buffers go, the run folder is released."""
        self._closing = True
        self._pool, self._staging = None, None
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if wait and runner.pending:
            self.host.info(f"{self.name}: waiting for {runner.pending} pending report(s) "
                           f"(steps {runner.pending_steps()}), at most {self.wait_timeout:g} s")
        runner.close(wait, self.wait_timeout, reason)
        try:  # on_error="raise" may raise from here: the folder is unlocked all the same
            if publish:
                self._drain(runner)  # a baseline polled now still comes before the recovered reports
                self._baseline_settled = True  # no baseline comes after this
                self._publish_recovered()
            else:  # training is failing: keep every outcome on disk, log nothing
                left = []
                for outcome in runner.poll():
                    if getattr(outcome, "on_disk", None):  # no error line: a resume scores it, as after a kill
                        left.append(outcome)
                    else:
                        self._keep(outcome)
                if left:
                    where = ", ".join(sorted({str(o.on_disk.parent) for o in left}))
                    self.host.warn(f"{self.name}: {reason}: the snapshots of steps {[o.step for o in left]} are in "
                                   f"{where}, not scored; a resume from a checkpoint scores them")
            self._publisher.record(None)
        finally:
            self.run.unlock()

    # ------------------------------------------------------------------ reports
    def _drain(self, runner: BackgroundRunner | None = None) -> None:
        runner = runner or self._runner
        if runner is None:
            return
        outcomes = runner.poll()
        handled = 0
        try:
            self._publish_recovered()
            for outcome in outcomes:
                handled += 1
                self._handle(outcome)
        except Exception:  # on_error="raise": what was polled and not handled still reaches the disk
            for rest in outcomes[handled:]:
                try:
                    self._keep(rest)
                except Exception:
                    pass  # the first failure is the one raised; the next outcomes are still kept
            raise

    def _handle(self, outcome) -> None:
        if isinstance(outcome, BaselineOutcome):
            self._baseline_settled = True
            if outcome.error is None:
                self.baseline_report = outcome.report
                self._warn_unresolvable()
                if self._metrics_restored:
                    self._restore_metrics()  # a resume, nothing newer yet: now with the baseline's keys
            self._publish_recovered()  # older than anything polled after the baseline
            if outcome.error is not None:
                self._fail(f"scoring the baseline failed: {outcome.error}")
            return
        if outcome.error is not None:
            self._record_outcome(outcome)
            if is_non_finite(outcome.error):  # the drafter's numbers are NaN: so are its means
                self._set_metrics(outcome.step, {key: math.nan for key in self.metrics if self._is_mean(key)})
                self._metrics_restored = False
            self._fail(f"step {outcome.step} failed: {outcome.error}")
        else:
            self._publish(outcome.report, outcome.seconds, outcome.versus)

    def _warn_unresolvable(self) -> None:
        """Once the baseline's report is in hand: a stop whose threshold this cache is too small to ever
        resolve (the baseline's own interval wider than the margin) is said, in one line. It still runs."""
        if self.baseline_report is None or self.baseline_report.intervals is None:
            return
        for policy in self.stops.policies:
            if policy.confidence is not None and policy.min_ratio is not None:
                line = resolution_warning(self.baseline_report, policy.monitor, policy.min_ratio)
                if line is not None:
                    self.host.warn(f"{type(policy).__name__}: {line}")

    def _keep(self, outcome) -> None:
        """An outcome on disk without logging it (training is failing)."""
        if isinstance(outcome, BaselineOutcome):
            self.baseline_report = outcome.report or self.baseline_report
        elif outcome.report is not None:
            self._publisher.record_report(outcome.report, outcome.seconds, outcome.versus)
        else:
            self._record_outcome(outcome)

    def _publish_recovered(self) -> None:
        """The watcher reports a killed run never picked up: older than any job, so first,
        once the baseline is settled."""
        while self._recovered and self._baseline_settled:
            self._publish(self._recovered.pop(0), None)

    def _is_mean(self, key: str) -> bool:
        """A run-level mean of ours (or its delta or ratio, or their intervals); not the baseline's."""
        return (key.startswith(f"{self.name}/") and key.endswith(MEAN_KEYS)
                and not key.startswith(f"{self.name}/baseline/"))

    def _record_outcome(self, outcome: SnapshotOutcome) -> None:
        self._publisher.record({"step": outcome.step, "snapshot_id": outcome.snapshot_id,
                                "error": outcome.error, "seconds": outcome.seconds})

    def _publish(self, report: EvalReport, seconds: float | None, versus: dict | None = None) -> None:
        """`versus`: the report against the baseline (the runner's; made here for a report a watcher
        left, recovered on resume)."""
        seconds = report.seconds if seconds is None else seconds
        versus = versus or versus_baseline(report, self.baseline_report)
        metrics = self._publisher.publish(report, self.baseline_report, seconds, self.errors, versus)
        if metrics is None:
            return  # refused: an error line, nothing logged
        self._metrics_restored = False  # the metrics hold newer numbers now
        self._set_metrics(report.step, {k: v for k, v in metrics.items() if k.endswith(MEAN_KEYS)})
        entry = history_entry(report, versus_record(versus) if versus else None)
        self._add_history(entry)
        self._outgoing.append(entry)
        self.reports.append(report)
        if self.verbose:
            self.host.info(summary_line(self.name, report, self.baseline_report))
        self._notify(report, versus)

    def _add_history(self, entry: dict) -> None:
        self.history = sorted([h for h in self.history if h["step"] != entry["step"]] + [entry],
                              key=lambda h: h["step"])

    def _notify(self, report: EvalReport, versus: dict | None = None) -> None:
        """The stops decide (with the paired comparison of their monitor), then every subscriber gets
        the report; one that raises is a failure."""
        ending = self.host.ending() or ("the run is closing" if self._closing else None)
        now = Moment(step=self._step if self._step is not None else int(report.step), horizon=self.host.horizon(),
                     ending=ending)
        listeners = [(policy, lambda r, b, p=policy: self.stops.judge(
            p, r, b, now, self.host.info, self.host.warn, self.name, (versus or {}).get(p.monitor, {}).get("mean")))
            for policy in self.stops.policies]
        listeners += [(fn, fn) for fn in list(self._subscribers)]
        for who, call in listeners:
            try:
                call(report, self.baseline_report)
            except Exception as e:
                self._fail(f"subscriber {getattr(who, '__qualname__', type(who).__qualname__)!s} raised on step "
                           f"{report.step}: {type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        self.errors += 1
        if self.on_error == "raise":
            raise RuntimeError(f"{self.name}: {message}")
        self.host.warn(f"{self.name}: {message} (training goes on; errors so far: {self.errors})")
        if self._publisher is not None:
            self._publisher.log_error_count(self.errors, self._step or 0)
