"""When snapshots are taken, and taking them: every `every_n_steps` steps, unless the runner is as
busy as `busy` allows ("skip": one pending at a time; "queue": up to `max_pending`), and the last
step's at the end. A snapshot is copied into reused host buffers (`snapshot.StagingPool`, made on a
background thread before training) and handed to the runner; the copy lands before the weights
are written again (`copy_landed`). Rank 0 decides; sharded (FSDP2) weights are gathered on every
rank, so every rank takes part then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from torch import nn

from ..model import DrafterConfig
from ..settings import EvalSettings
from .host import Host
from .runners.background import BackgroundRunner
from .runners.jobs import Job
from .snapshot import StagingPool, capture, is_sharded


def should_snapshot(step: int, every_n_steps: int) -> bool:
    return step > 0 and step % every_n_steps == 0


class Schedule:
    def __init__(self, settings: EvalSettings, config: DrafterConfig, shapes: Mapping[str, tuple[int, ...]],
                 taken: set[int] | None = None):
        self.settings, self.config, self.shapes = settings, config, dict(shapes)
        self.taken: set[int] = set(taken or ())  # steps snapshotted (or recovered): never taken again
        self.last_taken: int | None = None
        self.pool: StagingPool | None = None
        self.staging = None  # the snapshot whose copy may still be landing

    def allocate(self, drafter: nn.Module | None) -> None:
        """The staging buffers, on a background thread (not for a watcher, nor sharded weights)."""
        if drafter is None or is_sharded(drafter):
            return
        self.pool = StagingPool(1 if self.settings.busy == "skip" else self.settings.max_pending)
        state = {k: v.detach() for k, v in drafter.state_dict().items()}
        pin = any(t.is_cuda for t in state.values())
        threading.Thread(target=self.pool.allocate, args=(state, pin), name="dflash-staging", daemon=True).start()

    def mark_taken(self, step: int) -> None:
        """`step` is scored from elsewhere (a watcher's checkpoint): never snapshotted here."""
        self.taken.add(step)

    def skip(self, step: int, force: bool, host: Host, runner: BackgroundRunner | None) -> tuple[bool, bool]:
        """Rank 0's decision not to snapshot `step` (no runner, a step already taken, or, unless `force`, a
        runner as busy as `busy` allows), and whether it is skipped for being busy (a skipped snapshot, for
        the run's count). Other ranks say skip (they learn rank 0's when it matters)."""
        if host.rank != 0 or runner is None or step in self.taken:
            return True, False
        limit = 1 if self.settings.busy == "skip" else self.settings.max_pending
        if not force and runner.pending >= limit:
            return True, True
        return False, False

    def take(self, step: int, epoch: int, drafter: nn.Module, skip: bool, sharded: bool, host: Host,
             runner: BackgroundRunner, failed: Callable[[int, str], None]) -> None:
        """Start the snapshot of `step` (rank 0; every rank for sharded weights: the gather is collective);
        a failure is `failed(step, error)` on rank 0."""
        if not skip:
            self.last_taken = step
        if skip or not (host.rank == 0 or sharded):
            return
        try:
            changed = self.changed_keys(drafter)
            if changed:
                raise ValueError(changed)
            snapshot = capture(drafter, self.config, step, epoch, self.pool, is_rank_zero=host.rank == 0)
        except Exception as e:
            if host.rank == 0:
                self.taken.add(step)
                failed(step, f"taking the snapshot of step {step} failed: {type(e).__name__}: {e}")
            return
        if snapshot is not None:
            self.staging = snapshot
            self.taken.add(step)
            runner.submit(Job(step, snapshot.snapshot_id, snapshot=snapshot))

    def changed_keys(self, drafter: nn.Module) -> str | None:
        """How the drafter's state-dict keys differ from those checked before training (None: they do not)."""
        now = set(drafter.state_dict())
        added, missing = sorted(now - set(self.shapes)), sorted(set(self.shapes) - now)
        if not added and not missing:
            return None
        return (f"the drafter's state dict changed since it was checked before training (added: {added or 'none'}; "
                f"missing: {missing or 'none'}); a snapshot holds the tensors the drafter had then: keep the drafter's "
                "tensors fixed while training, or start a new run")

    def copy_landed(self) -> None:
        """Wait for the snapshot's device-to-host copy (CUDA: a side stream) before the weights can be
        written in place: by the optimizer step, or by anything else."""
        if self.staging is not None:
            self.staging.wait()
            self.staging = None

    def release(self) -> None:
        self.pool, self.staging = None, None
