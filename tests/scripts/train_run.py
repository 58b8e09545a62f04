"""A small, real training run of the DFlash drafter with the dflash callbacks attached.

The reliability and distributed tests run this file as a subprocess, the way a user
runs a training script:

    python tests/scripts/train_run.py --world W --root R --max-steps 40 --every 2 \
        [--devices 2 --strategy ddp|fsdp2] [--eval-cache C ...] [--stop-min-ratio 5] \
        [--ckpt-every 3] [--resume CKPT] [--record] [--corrupt-at-start FILE]

- `--world` is a folder made by `tests/support/synthetic.py:build_world` (built here if missing).
- With `--strategy ddp` Lightning re-launches this script for rank 1 (gloo on CPU);
  `fsdp2` uses Lightning's ModelParallelStrategy, whose `configure_model` applies
  `fully_shard` to the drafter.
- One DrafterEvalCallback per `--eval-cache` (the first named `dflash`, writing its run
  folder under R/dflash, the next `dflash-1` under R/dflash-1, ...); all score the same
  snapshots of the drafter.
- `--record` makes every rank write R/rank{N}.json after `fit` returns: the final step,
  the stop decision, what each eval callback saw, and per-step invariants that were
  checked on that rank (on ranks other than 0: no runner, no scoring thread).

It also exports the pieces the in-process tests share with it (same module, data and
hyperparameters): `shared_world`, `world_paths`, `make_module`, `make_loader`, `write_cache`,
and `eval_cb` / `fit` / `ScoredAt` for runs inside the test process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "support", TESTS / "scripts"):  # the suite's helpers, as conftest.py puts them
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dflash_callbacks import DrafterConfig  # noqa: E402
from dflash_callbacks.cache.format import HiddenStateCache, new_manifest, open_for_writing, write_task  # noqa: E402
from dflash_callbacks.callbacks import DrafterEvalCallback, TrailingBaselineStop  # noqa: E402
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences  # noqa: E402

LR = 3e-3


# ---------------------------------------------------------------- shared pieces


def shared_world(base: Path) -> Path:
    """`build_world` under `base`/world once (tests of one pytest session share it)."""
    world, done = Path(base) / "world", Path(base) / "world.done"
    if not done.is_file():
        from synthetic import build_world

        if world.exists():
            import shutil

            shutil.rmtree(world)  # a build interrupted earlier
        build_world(world)
        done.touch()
    return world


def world_paths(world: Path) -> dict:
    world = Path(world)
    return {"config": DrafterConfig.from_file(world / "baseline"), "target": world / "target",
            "cache": world / "cache", "baseline": world / "baseline"}


def make_module(world: Path, cls=DFlashTrainingModule) -> DFlashTrainingModule:
    paths = world_paths(world)
    torch.manual_seed(0)
    return cls(paths["config"], paths["target"], lr=LR, warmup_steps=2)


def make_loader(world: Path) -> DataLoader:
    return DataLoader(CacheSequences(Path(world) / "cache"), batch_size=1, collate_fn=collate_sequences)


def write_cache(world: Path, folder: Path, tasks: list[tuple[str, int, int]], corrupt: tuple[str, ...] = ()) -> Path:
    """A cache that fits the world's drafter with random tokens: `tasks` are (name, tokens,
    prompt length). The files of the tasks named in `corrupt` are overwritten with zeros
    after writing (same size, so the manifest stays valid and only reading them fails)."""
    info = HiddenStateCache(Path(world) / "cache")
    open_for_writing(folder, new_manifest(info.target, info.layer_ids))
    width = len(info.layer_ids) * info.hidden_size
    for name, T, P in tasks:
        g = torch.Generator().manual_seed(T)
        write_task(folder, name, torch.randint(0, info.vocab_size - 1, (T,), generator=g),
                   torch.randn(T, width, generator=g), P)
    for name in corrupt:
        path = Path(folder) / f"{name}.safetensors"
        path.write_bytes(b"\0" * path.stat().st_size)
    return Path(folder)


SCORING = {"ddtree_budgets": [4], "device": "cpu"}


def eval_cb(world: Path, tmp_path: Path, **kwargs) -> DrafterEvalCallback:
    """The eval callback of the in-process tests: every 2 steps, runs under tmp_path/d."""
    paths = world_paths(world)
    args = dict(cache=paths["cache"], target=paths["target"], every_n_train_steps=2, scoring=SCORING,
                dirpath=tmp_path / "d", verbose=False, wait_timeout=300)
    args.update(kwargs)
    return DrafterEvalCallback(**args)


def fit(world: Path, tmp_path: Path, callbacks: list, max_steps: int, logger=False, ckpt_path=None,
        module: DFlashTrainingModule | None = None, **trainer_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=logger, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=trainer_kwargs.pop("enable_checkpointing", False),
                         default_root_dir=tmp_path, log_every_n_steps=1000, **trainer_kwargs)
    trainer.fit(module or make_module(world), make_loader(world), ckpt_path=ckpt_path)
    return trainer


class ScoredAt(pl.Callback):
    """After `cb` in trainer.callbacks: at `step`, training waits until the snapshot taken there is scored, so
    that its report is published at the next step, while training goes on, whatever the machine's load."""

    def __init__(self, cb: DrafterEvalCallback, step: int):
        self.cb, self.step = cb, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            from runs import wait_until

            wait_until(lambda: not self.cb.engine.runner._outbox.empty(), what=f"the report of step {self.step}")


# ---------------------------------------------------------------- callbacks of the script


class ValidatedModule(DFlashTrainingModule):
    """The training module with a validation loop (its loss on one sequence), so that callbacks that
    check at validation (ModelCheckpoint, EarlyStopping) run."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", torch.stack([self.sequence_loss(s["input_ids"], s["hidden"], s["prompt_len"])
                                          for s in batch]).mean(), sync_dist=True, batch_size=len(batch))


class FSDP2Module(DFlashTrainingModule):
    """The training module with its drafter sharded by FSDP2 (ModelParallelStrategy):
    one FSDP unit per decoder layer, then the root, as large drafters are sharded."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.drafter.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.drafter, mesh=mesh)


class CorruptAtStart(pl.Callback):
    """Zero a file at on_train_start (after every setup check passed): a disk going bad mid-run."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.path.write_bytes(b"\0" * self.path.stat().st_size)


class StepSleep(pl.Callback):
    """The behaviour asked for by --step-sleep: a training step that takes that long."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class Recorder(pl.Callback):
    """Per-rank record of what the eval callbacks did, checked at every step."""

    def __init__(self, evals: list[DrafterEvalCallback], stop: TrailingBaselineStop | None):
        self.evals, self.stop = evals, stop
        self.violations: list[str] = []
        self.max_pending = [0] * len(evals)
        self.steps_seen = 0
        self.early = None  # a DrafterEarlyStopping, when the run has one
        self.report_steps_seen: list[float] = []  # the dflash/step values callback_metrics held, as they changed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps_seen += 1
        step = trainer.callback_metrics.get("dflash/step")
        if step is not None and (not self.report_steps_seen or float(step) != self.report_steps_seen[-1]):
            self.report_steps_seen.append(float(step))
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("dflash"))
        for i, cb in enumerate(self.evals):
            if trainer.global_rank != 0:
                if cb.engine.runner is not None or cb.engine.schedule.staging is not None or cb.reports:
                    self.violations.append(f"step {trainer.global_step}: eval callback {i} holds a runner or reports")
                if threads:
                    self.violations.append(f"step {trainer.global_step}: scoring threads {threads} on rank 1")
            elif cb.engine.runner is not None:
                self.max_pending[i] = max(self.max_pending[i], cb.engine.runner.pending)

    def summary(self, trainer) -> dict:
        return {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "steps_seen": self.steps_seen,
            "should_stop": trainer.should_stop,
            "stop_reason": None if self.stop is None else self.stop.stop_reason,
            "stopped_step": None if self.stop is None else self.stop.stopped_step,
            "violations": self.violations,
            "report_steps_seen": self.report_steps_seen,
            "early_stop": None if self.early is None else {"wait_count": self.early.wait_count,
                                                           "stopped_epoch": self.early.stopped_epoch,
                                                           "reason": self.early.stopping_reason_message},
            "evals": [
                {"errors": cb.errors, "skipped": cb.skipped, "reports": [r.step for r in cb.reports],
                 "baseline": cb.baseline_report is not None, "runner": cb.engine.runner is not None,
                 "max_pending": self.max_pending[i]}
                for i, cb in enumerate(self.evals)
            ],
        }


class CaptureCheck(pl.Callback):
    """FSDP2: call `capture` on every rank (a collective) and compare rank 0's snapshot,
    bit for bit, with (a) the published baseline folder the drafter was loaded from,
    before any optimizer step, and (b) at `step`, the full tensors gathered parameter by
    parameter with DTensor.full_tensor()."""

    def __init__(self, baseline: Path, config: DrafterConfig, step: int):
        self.baseline, self.config, self.step = baseline, config, step
        self.out: dict = {}

    def _capture(self, trainer, pl_module, step):
        from dflash_callbacks.engine.snapshot import capture, is_sharded

        drafter = pl_module.drafter
        sharded = is_sharded(drafter)
        snap = capture(drafter, self.config, step, trainer.current_epoch, None, is_rank_zero=trainer.global_rank == 0)
        return sharded, snap

    def on_train_start(self, trainer, pl_module):
        from safetensors.torch import load_file

        sharded, snap = self._capture(trainer, pl_module, 0)
        entry = {"sharded": sharded, "none": snap is None}
        if snap is not None:
            published = load_file(str(self.baseline / "model.safetensors"))
            entry.update(
                same_keys=sorted(snap.state) == sorted(published),
                bitwise=all(torch.equal(snap.state[k], published[k]) for k in published),
                plain_cpu=all(type(t) is torch.Tensor and t.device.type == "cpu" for t in snap.state.values()),
                dtypes_match=all(snap.state[k].dtype == published[k].dtype for k in published),
            )
        self.out["start"] = entry

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or "step" in self.out:
            return
        sharded, snap = self._capture(trainer, pl_module, trainer.global_step)
        full = {name: p.full_tensor() for name, p in pl_module.drafter.named_parameters()}  # every rank: collective
        entry = {"sharded": sharded, "none": snap is None}
        if snap is not None:
            entry.update(same_keys=sorted(snap.state) == sorted(full),
                         bitwise=all(torch.equal(snap.state[k], full[k]) for k in full),
                         changed=any(not torch.equal(snap.state[k], self._initial[k]) for k in full))
        self.out["step"] = entry

    def setup(self, trainer, pl_module, stage):
        from safetensors.torch import load_file

        self._initial = load_file(str(self.baseline / "model.safetensors"))


# ---------------------------------------------------------------- main


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=Path, required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp2"])
    p.add_argument("--runner", default="thread")
    p.add_argument("--busy", default="skip")
    p.add_argument("--max-pending", type=int, default=1)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--on-error", default="warn")
    p.add_argument("--eval-cache", type=Path, action="append", help="one eval callback per cache (default: the world's)")
    p.add_argument("--anchors-per-forward", type=int, default=64)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--stop-min-ratio", type=float, default=None, help="attach TrailingBaselineStop(min_ratio=...)")
    p.add_argument("--stop-patience", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--init-from-baseline", action="store_true", help="start from the baseline drafter's weights")
    p.add_argument("--capture-check", type=int, default=0, help="FSDP2: compare captures with full tensors at this step")
    p.add_argument("--record", action="store_true")
    p.add_argument("--corrupt-at-start", type=Path, default=None, help="zero this file once training starts")
    p.add_argument("--early-stop-patience", type=int, default=0,
                   help="DrafterEarlyStopping on dflash/ddtree@4/live/mean that never sees an improvement")
    p.add_argument("--monitor-checkpoint", action="store_true",
                   help="ModelCheckpoint(monitor='dflash/ddtree@4/live/mean') into ROOT/best")
    p.add_argument("--val-every", type=int, default=0, help="a validation loop every this many batches")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if not (args.world / "cache").is_dir():
        from synthetic import build_world

        build_world(args.world)
    paths = world_paths(args.world)
    cls = FSDP2Module if args.strategy == "fsdp2" else ValidatedModule if args.val_every else DFlashTrainingModule
    module = make_module(args.world, cls)
    if args.init_from_baseline:
        from safetensors.torch import load_file

        module.drafter.load_state_dict(load_file(str(paths["baseline"] / "model.safetensors")))

    evals = []
    for i, cache in enumerate(args.eval_cache or [paths["cache"]]):
        evals.append(DrafterEvalCallback(
            cache=cache, target=paths["target"], baseline=None if args.no_baseline else paths["baseline"],
            every_n_train_steps=args.every, runner=args.runner, busy=args.busy, max_pending=args.max_pending,
            keep_last=args.keep_last, on_error=args.on_error,
            scoring={"ddtree_budgets": [4], "device": "cpu", "anchors_per_forward": args.anchors_per_forward},
            dirpath=args.root / ("dflash" if i == 0 else f"dflash-{i}"), baseline_cache_dir=args.root / "bc",
            wait_timeout=300, verbose=False, name="dflash" if i == 0 else f"dflash-{i}",
        ))
    callbacks: list = list(evals)
    stop = None
    if args.stop_min_ratio is not None:
        stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=args.stop_min_ratio, patience=args.stop_patience,
                                    verbose=False, eval_callback="dflash")
        callbacks.append(stop)
    recorder = Recorder(evals, stop)
    callbacks.append(recorder)
    check = None
    if args.capture_check:
        check = CaptureCheck(paths["baseline"], paths["config"], args.capture_check)
        callbacks.insert(0, check)
    if args.step_sleep:
        callbacks.append(StepSleep(args.step_sleep))
    if args.corrupt_at_start:
        callbacks.insert(0, CorruptAtStart(args.corrupt_at_start))
    early = None
    if args.early_stop_patience:
        from dflash_callbacks import DrafterEarlyStopping

        early = DrafterEarlyStopping(monitor="dflash/ddtree@4/live/mean", min_delta=100.0,
                                     patience=args.early_stop_patience)
        callbacks.append(early)
    recorder.early = early
    if args.monitor_checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.root / "best", monitor="dflash/ddtree@4/live/mean", mode="max",
                                         save_top_k=1, filename="{step}"))
    if args.ckpt_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.root / "ckpt", filename="{step}",
                                         every_n_train_steps=args.ckpt_every, save_top_k=-1))

    strategy = args.strategy
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    trainer = pl.Trainer(
        max_steps=args.max_steps, accelerator="cpu", devices=args.devices, strategy=strategy, callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_every or args.monitor_checkpoint), default_root_dir=args.root,
        num_sanity_val_steps=0, **({"val_check_interval": args.val_every, "limit_val_batches": 1} if args.val_every else {}),
    )
    trainer.fit(module, make_loader(args.world), val_dataloaders=make_loader(args.world) if args.val_every else None,
                ckpt_path=None if args.resume is None else str(args.resume))
    if args.record:
        out = recorder.summary(trainer)
        out["finished"] = True
        if check is not None:
            out["capture"] = check.out
        path = args.root / f"rank{trainer.global_rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, path)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # every rank leaves together, the group torn down while all live: a rank that exits while rank 0 still
        # waits for its last report (or gloo threads finishing at interpreter exit) aborts with "terminate called
        # without an active exception", and Lightning then kills every process
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
