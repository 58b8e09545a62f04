"""Snapshots: the drafter's weights captured at a definite step.

`capture` runs on the training thread and returns at once:
- CUDA weights are copied into pinned host buffers on a side stream (after the
  current stream's work, via an event), so the copy overlaps with the next forward
  and backward. `Snapshot.wait()` blocks until the copy is complete; the callback
  calls it in `on_before_optimizer_step`, so the optimizer never changes weights
  under the copy.
- CPU weights are cloned (there is nothing to overlap with).
- Sharded (FSDP2 DTensor) weights are gathered first with
  `get_model_state_dict(full_state_dict=True, cpu_offload=True)`; every rank must
  call `capture` then (it is a collective), and only rank 0 receives the tensors.

`write_snapshot` writes `snapshots/step-00000400/` (`model.safetensors` in the
published key layout, `config.json`, `snapshot.json`) to a temporary name and renames
it, so a reader never sees half a snapshot.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..model import DrafterConfig, save_drafter

SNAPSHOT_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class Snapshot:
    step: int
    epoch: int
    config: DrafterConfig
    state: dict[str, torch.Tensor]
    wall_time: float = field(default_factory=time.time)
    event: "torch.cuda.Event | None" = None

    def wait(self) -> None:
        """Block until the device-to-host copy is complete (no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    @property
    def ready(self) -> bool:
        return self.event is None or self.event.query()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def metadata(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "wall_time": self.wall_time, "config": self.config.to_dict()}


def is_sharded(module: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def capture(module: nn.Module, config: DrafterConfig, step: int, epoch: int, *, is_rank_zero: bool = True) -> Snapshot | None:
    """Start copying `module`'s weights; None on ranks other than 0."""
    if is_sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return Snapshot(step, epoch, config, dict(state)) if is_rank_zero else None
    if not is_rank_zero:
        return None
    source = {k: v.detach() for k, v in module.state_dict().items()}
    if not any(t.is_cuda for t in source.values()):
        return Snapshot(step, epoch, config, {k: v.clone() for k, v in source.items()})
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)  # the weights as of now, after every queued kernel
    state = {}
    with torch.cuda.stream(side):
        for k, v in source.items():
            state[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            state[k].copy_(v, non_blocking=True)
            v.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
    return Snapshot(step, epoch, config, state, event=event)


def snapshot_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def write_snapshot(root: Path, snapshot: Snapshot) -> Path:
    snapshot.wait()
    return save_drafter(
        snapshot_dir(root, snapshot.step), snapshot.config, snapshot.state,
        extra_files={"snapshot.json": snapshot.metadata()},
    )


def list_snapshots(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete snapshot under root, oldest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if (m := SNAPSHOT_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def prune_snapshots(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` snapshots (and stale temporaries); returns what went."""
    removed = []
    if not Path(root).is_dir():
        return removed
    snapshots = list_snapshots(root)
    # temporaries of a writer that was killed mid-write (save_drafter's .NAME.tmp-* and .NAME.old-*); the caller
    # is the only writer, and it is not writing now
    stale = sorted(Path(root).glob(".step-*.tmp-*")) + sorted(Path(root).glob(".step-*.old-*"))
    for folder in [f for _, f in snapshots[: max(0, len(snapshots) - keep_last)]] + stale:
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
