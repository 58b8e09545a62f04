"""Snapshots: the drafter's weights captured at a definite step, into reused host buffers.

`StagingPool` holds the host buffers a snapshot is copied into: `capacity` sets shaped
like the drafter's state dict, allocated once (pinned when the drafter is on CUDA) by
`allocate`, which the engine runs on a background thread before training starts,
and reused for every snapshot. A set is in use from `capture` until its snapshot has
been scored (`Snapshot.release`).

`capture` runs on the training thread and returns at once:
- CUDA weights are copied into the pinned set on a side stream (after the current
  stream's work, via an event), so the copy overlaps with the next forward and
  backward. `Snapshot.wait()` blocks until the copy is complete; the callback calls it
  before the next optimizer step (every adapter hooks it), so the optimizer never changes weights under the copy.
- CPU weights are copied into the set at once (there is nothing to overlap with).
- Sharded (FSDP2 DTensor) weights are gathered first with
  `get_model_state_dict(full_state_dict=True, cpu_offload=True)`; every rank must call
  `capture` then (it is a collective), and only rank 0 receives the tensors.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from torch import nn

from ..model import DrafterConfig


@dataclass
class Snapshot:
    step: int
    epoch: int
    config: DrafterConfig
    state: dict[str, torch.Tensor]
    snapshot_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    wall_time: float = field(default_factory=time.time)
    event: torch.cuda.Event | None = None
    pool: StagingPool | None = None  # where `state`'s buffers go back to

    def wait(self) -> None:
        """Block until the device-to-host copy is complete (no-op on CPU)."""
        event = self.event  # the training thread and the runner's may both wait
        if event is not None:
            event.synchronize()
            self.event = None

    def release(self) -> None:
        """Hand the buffers back to their pool (after scoring); the state is gone after this."""
        if self.pool is not None:
            self.pool.release(self.state)
            self.pool = None
        self.state = {}

    def metadata(self) -> dict:
        return {"step": self.step, "snapshot_id": self.snapshot_id, "epoch": self.epoch,
                "wall_time": self.wall_time, "config": self.config.to_dict()}


class StagingPool:
    """`capacity` reusable host copies of a state dict's tensors (see the module docstring)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.allocations = 0  # buffer sets ever allocated (tests check it stays at capacity)
        self._free: list[dict[str, torch.Tensor]] = []
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def allocate(self, state: dict[str, torch.Tensor], pin: bool) -> None:
        """Allocate every set like `state` (shapes and dtypes; pinned, for the device of `state`'s
        CUDA tensors, when `pin`)."""
        try:
            device = next((t.device for t in state.values() if t.is_cuda), None)
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                self._allocate(state, pin)
        except BaseException as e:  # reported by acquire, on the training thread
            self._error = e
        finally:
            self._ready.set()

    def _allocate(self, state: dict[str, torch.Tensor], pin: bool) -> None:
        for _ in range(self.capacity):
            buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in state.items()}
            with self._lock:
                self._free.append(buffers)
                self.allocations += 1

    def acquire(self) -> dict[str, torch.Tensor] | None:
        """A free set (waiting for `allocate` to finish if it still runs), or None if all are in use."""
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"allocating the snapshot buffers failed: {self._error}") from self._error
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._free.append(buffers)


def is_sharded(module: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def capture(
    module: nn.Module, config: DrafterConfig, step: int, epoch: int, pool: StagingPool | None, *,
    is_rank_zero: bool = True,
) -> Snapshot | None:
    """Start copying `module`'s weights (into a set of `pool`, or fresh buffers when the
    pool has none free); None on ranks other than 0."""
    if is_sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return Snapshot(step, epoch, config, dict(state)) if is_rank_zero else None
    if not is_rank_zero:
        return None
    source = {k: v.detach() for k, v in module.state_dict().items()}
    on_cuda = any(t.is_cuda for t in source.values())
    state = pool.acquire() if pool is not None else None
    owner = pool if state is not None else None
    if state is None:
        state = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=on_cuda) for k, v in source.items()}
    side = None
    try:
        if not on_cuda:
            for k, v in source.items():
                state[k].copy_(v)
            return Snapshot(step, epoch, config, state, pool=owner)
        device = next(t.device for t in source.values() if t.is_cuda)  # the drafter's, not the thread's current one
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # the weights as of now, after every queued kernel
        with torch.cuda.stream(side):
            for k, v in source.items():
                state[k].copy_(v, non_blocking=True)
                v.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return Snapshot(step, epoch, config, state, event=event, pool=owner)
    except BaseException:  # the set goes back to its pool (once the copies queued so far are done)
        if owner is not None:
            if side is not None:
                side.synchronize()
            owner.release(state)
        raise
