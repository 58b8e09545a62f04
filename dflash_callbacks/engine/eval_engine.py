"""EvalEngine: snapshot a drafter while it trains, score it in the background, publish every report,
and decide whether training stops. No framework here: each adapter (Lightning, the plain PyTorch
loop, the transformers Trainer) gives the engine a `Host` and calls it at a few points of its loop:

    check(host, drafter, config, max_steps)  every rank, before training: every input fits, or it raises
    start(host, drafter)                     every rank, at the first step: rank 0 opens the run folder
    on_step(step, epoch, drafter)            every rank, after each optimizer step: rank 0 publishes, every
                                             `every_n_steps` a copy of the weights starts; returns a stop's reason
    copy_landed()                            before anything writes the weights in place
    end(step, epoch, drafter, error)         every rank, once training is over (run_end.py)

The engine owns one `RunState` (run_state.py: the history, the means, the counts, the stops' states),
the one thing its ranks exchange (`_exchange`, one collective). Its parts read it or call its methods:
`open_run` (the run folder), `snapshot_schedule` (when and how snapshots are taken), `publisher` (publishing
each outcome), the stops (each `evaluate` returns its verdict). A watcher of checkpoints drives the same
engine with `submit` and `poll`.

The engine reads the training process and never writes to it: the only global state it touches is
what the host is asked to log and the stop it returns. A failure in snapshotting, scoring, writing
or logging is a warning and an error count, unless `on_error="raise"`. Every submitted snapshot ends
as a report or an error line in results.jsonl, also when `wait_timeout` runs out; when training
fails, a snapshot written and not scored is left on disk instead, for a resume to score. A process
that exits without `end` (the user's loop raised past it) ends the same way, at exit.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..model import DrafterConfig
from ..scoring.basis import Basis
from ..scoring.report import EvalReport
from ..scoring.service import PreflightError
from ..settings import EvalSettings
from .host import Host
from .inputs_check import Checked, check_inputs
from .open_run import open_run, taken_steps
from .publisher import Publisher, Subscriber
from .run_end import RunEnd
from .run_folder import RunFolder
from .results_line import prepare
from .run_state import RunState
from .runners.background import BackgroundRunner
from .runners.jobs import Job
from .snapshot import is_sharded
from .snapshot_schedule import Schedule, should_snapshot
from .stop import StopPolicy, StopState, check_monitor


class EvalEngine(RunEnd):
    """Everything an evaluation of a training run does, for any loop (see the module docstring)."""

    def __init__(self, settings: EvalSettings, names: Mapping[str, str] | None = None):
        """`names`: the adapter's own spelling of a setting, for messages (Lightning's every_n_train_steps)."""
        if not isinstance(settings, EvalSettings):
            raise TypeError(f"EvalEngine takes an EvalSettings; got {type(settings).__name__}")
        self.settings, self.names = settings, dict(names or {})
        self.policies: list[StopPolicy] = []
        self.subscribers: list[Subscriber] = []
        self.host = Host()
        self.basis: Basis | None = None  # what every report of this run stands on (after `check`)
        self._restored: dict | None = None
        self.checked: Checked | None = None  # what the run stands on, after `check`
        self._started = False
        self._fresh({})

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def scoring(self):
        return self.settings.scoring

    def _fresh(self, restored: dict) -> None:
        """The state of a run that has seen nothing (or, `restored`, a resume's counts and history)."""
        self.run: RunFolder | None = None
        self.state = RunState(self.name, self.scoring.methods, self.settings.baseline is not None,
                              self.scoring.costs is not None, stops=[policy.loaded for policy in self.policies])
        self.state.load_state_dict(restored)
        self.publisher = Publisher(self.settings, self.host, self.state, self.policies, self.subscribers,
                                   lambda: self._step)
        self.schedule: Schedule | None = None
        self.runner: BackgroundRunner | None = None
        self._step: int | None = None  # the last step seen

    # ------------------------------------------------------------------ what adapters read and add
    @property
    def run_id(self) -> str | None:
        return self.state.run_id

    @property
    def history(self) -> list[dict]:
        return self.state.history

    @property
    def errors(self) -> int:
        return self.state.errors

    @property
    def baseline_report(self) -> EvalReport | None:
        return self.publisher.baseline

    @property
    def pending(self) -> int:
        return self.runner.pending if self.runner is not None else 0

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(report, baseline)` on the training thread of rank 0 for every new report; returns a
        function that unsubscribes it. A subscriber that raises is reported like any failure."""
        self.subscribers.append(fn)
        return lambda: self.subscribers.remove(fn) if fn in self.subscribers else None

    def add_stop(self, policy: StopPolicy) -> None:
        """Follow `policy` (its monitor must be scored here; after `check`, its threshold within reach)."""
        line = policy.unreachable(*self.checked.most_tau) if self.checked is not None else None
        if line is not None:
            raise PreflightError(f"the scoring inputs do not fit together:\n  {line}")
        check_monitor(policy, self.scoring.methods, self.name, self.scoring.costs)
        if policy in self.policies:
            return
        self.policies.append(policy)
        self.state.add_stop(policy.loaded)
        policy.follow(lambda: self._seen_by(policy))
        if self.settings.baseline is None:
            self.host.warn(f"{policy.shown_name}: {self.name!r} has no baseline, so {policy.monitor} is recorded "
                           "but never judged and training is never stopped; give the evaluator baseline=...")

    def remove_stop(self, policy: StopPolicy) -> None:
        """Follow `policy` no more (it keeps what it had seen)."""
        if policy in self.policies:
            index = self.policies.index(policy)
            policy.follow(None, kept=(self.state.history, self.state.stops[index]))
            self.policies.remove(policy)
            self.state.remove_stop(index)

    def _seen_by(self, policy: StopPolicy) -> tuple[list[dict], StopState] | None:
        """What `policy` has seen of this engine's run: the history and its state."""
        if policy not in self.policies:
            return None
        return self.state.history, self.state.stops[self.policies.index(policy)]

    # ------------------------------------------------------------------ before training
    def check(self, host: Host, drafter: nn.Module | None, config: DrafterConfig, max_steps: int | None = None,
              shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Every rank, before training: the drafter, cache, target, scoring config, device and baseline fit
        together, or PreflightError lists every problem (`inputs_check`). Without a live drafter (a watcher
        of checkpoints), `shapes` gives its tensors' shapes."""
        self.host = host
        self.checked = check_inputs(self.settings, self.names, self.policies, host, drafter, config, max_steps,
                                    shapes)
        self.settings, self.basis = self.checked.settings, self.checked.basis
        self._restored, self._started = None, False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume's state (what `state_dict` returned), before `start`; the stops' too."""
        self._restored = dict(state_dict)
        for policy, state in zip(self.policies, state_dict.get("stops", [])):
            policy.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Primitives only, the same on every rank: the run, its history and counts, and the stops'."""
        return self.state.state_dict(self.basis.to_dict() if self.basis is not None else None)

    # ------------------------------------------------------------------ start
    def start(self, host: Host, drafter: nn.Module | None, run_id: str | None = None) -> None:
        """Every rank, once per run, before the first step: rank 0 opens this run's folder (a fresh one,
        named `run_id` or a new sortable id; or the resumed run's), recovers what a killed run left, and
        starts the runner. Without a live drafter (a watcher of checkpoints), no staging buffers."""
        if self._started:
            return
        self._started, self.host = True, host
        restored = self._restored or {}
        self._fresh(restored)
        self.schedule = Schedule(self.settings, self.checked.config, self.checked.shapes, taken_steps(self.history))
        if host.rank == 0:
            self._open(drafter, run_id)
        if host.world_size > 1:
            self.state.name_run(host.broadcast(self.state.run_id))  # every rank's state_dict names the run
        self.state.start(host, self.baseline_report)

    def _open(self, drafter: nn.Module | None, fresh_id: str | None) -> None:
        opened = open_run(self.settings, self.basis, self.host, self._restored, fresh_id,
                          [policy.settings.to_dict() for policy in self.policies])
        if self._restored and self._restored.get("run_id") and not opened.resumed:  # another basis: a new run
            self._fresh({k: v for k, v in self._restored.items() if k in ("errors", "skipped")})
        if opened.history is not None:
            self.state.replace_history(opened.history)
        self.run = opened.run
        self.state.name_run(opened.run.path.name)
        self.schedule = Schedule(self.settings, self.checked.config, self.checked.shapes,
                                 taken_steps(self.history, opened))
        self.publisher.start(self.run, opened.recovered)
        try:
            for outcome in opened.rejected:  # every line on disk first: on_error="raise" raises at the first
                self.publisher.record_outcome(outcome)
            for outcome in opened.rejected:
                self.publisher.fail(f"step {outcome.step} failed: {outcome.error}")
        except Exception:  # before the runner starts: nothing queued is cancelled, the folder is let go
            self.run.unlock()
            raise
        self.runner = BackgroundRunner(self.settings.runner, self.checked.spec, self.run, self.settings.keep_last, self.basis,
                                       notes=self.publisher.unresolvable, prepare=prepare)
        for job in opened.jobs:
            self.runner.submit(job)
        self.schedule.allocate(drafter)
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ training
    def on_step(self, step: int, epoch: int, drafter: nn.Module) -> str | None:
        """Every rank, after the optimizer step `step` (a repeated step, under gradient accumulation,
        only publishes). Returns the stop's reason when the stop reaches the ranks at this step."""
        self.publisher.drain(self.runner)
        if step == self._step:
            return None
        self._step = step
        due = should_snapshot(step, self.settings.every_n_steps)
        skip = self._skip(step, False) if due else True
        sharded = due and self.host.world_size > 1 and is_sharded(drafter)
        reason = None
        if self.host.world_size > 1:
            if sharded or step % self.settings.sync_every_n_steps == 0:
                skip, reason = self._exchange(step, skip)
        else:
            reason = self.state.reach(self.state.take_decided(), step)
        if due:
            self.schedule.take(step, epoch, drafter, skip, sharded, self.host, self.runner, self._snapshot_failed)
        return reason

    def _skip(self, step: int, force: bool) -> bool:
        skip, busy = self.schedule.skip(step, force, self.host, self.runner)
        if busy:
            self.state.count_skipped()
        return skip

    def _exchange(self, step: int, skip: bool) -> tuple[bool, str | None]:
        """The one collective between ranks, every `sync_every_n_steps` steps (and at every sharded snapshot,
        whose gather is itself collective): rank 0's snapshot decision and the news of its RunState (the
        history and means since, its counts, the stops' states, a stop decided), so that every rank holds the
        same history and metrics and stops at the same step. Returns rank 0's `skip` and the stop's reason
        when a stop reaches the ranks at `step`."""
        news = {"skip": skip, **self.state.news()} if self.host.rank == 0 else None
        news = self.host.broadcast(news)
        self.state.take_news(news, self.host.rank)
        if news["metrics"] is not None:
            self.state.show(self.host)
        return news["skip"], self.state.reach(news["decided"], step)

    # ------------------------------------------------------------------ a watcher of checkpoints
    def submit(self, job: Job) -> None:
        """Rank 0, after `start`: score `job` in the background (a checkpoint a watcher found, read when the
        job runs); its outcome is published by `poll` like a snapshot's."""
        if self.runner is None:
            raise RuntimeError(f"{self.name}: submit() comes after start() and before close()")
        if job.read is not None and self.settings.runner != "thread":
            raise ValueError(f"a job read by a function is scored by the thread runner; this engine's is "
                             f"{self.settings.runner!r}")
        self.schedule.mark_taken(job.step)
        self.runner.submit(job)

    def poll(self) -> str | None:
        """Publish every finished outcome (results.jsonl first, then the loggers, the metrics and the
        stops); the reason of a stop decided since, or None."""
        self.publisher.drain(self.runner)
        return self.state.reach(self.state.take_decided(), self.history[-1]["step"] if self.history else 0)

    def _snapshot_failed(self, step: int, error: str) -> None:
        self.publisher.record({"step": step, "snapshot_id": None, "error": error})
        self.publisher.fail(error)

    def copy_landed(self) -> None:
        """Wait for the snapshot's device-to-host copy before the weights can be written in place: by the
        optimizer step, or by anything else."""
        if self.schedule is not None:
            self.schedule.copy_landed()

    def finish(self, step: int, epoch: int, drafter: nn.Module) -> None:
        """Every rank, when training is over: the last step's snapshot (also when it was skipped while
        busy), its copy landed (no optimizer step follows to wait for it)."""
        if self.schedule is None:
            return
        if self.settings.wait_on_end and step > 0 and step != self.schedule.last_taken:
            skip = self._skip(step, True)
            sharded = self.host.world_size > 1 and is_sharded(drafter)
            if sharded:
                skip = self.host.broadcast(skip)
            self.schedule.take(step, epoch, drafter, skip, sharded, self.host, self.runner, self._snapshot_failed)
        self.copy_landed()
