"""Training-thread overhead of DrafterEvalCallback on the toy training.

Runs the same toy drafter training twice (without, then with the callbacks; same
seed, same data) and reports training steps per second of each, and the time the
training thread spent inside the callback's hooks (snapshot copies, draining and
logging reports) per step and in total.

    python benchmarks/bench_overhead.py [--steps 200] [--every 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from dflash_callbacks.callbacks import DrafterEvalCallback, TrailingBaselineStop
from dflash_callbacks.demos.demo import DemoConfig, resolve_world, toy_module, training_data


class TimedEvalCallback(DrafterEvalCallback):
    """DrafterEvalCallback that adds up the wall time spent in its training-thread hooks."""

    hook_seconds = 0.0

    def _timed(self, hook, *args):
        started = time.perf_counter()
        try:
            return hook(*args)
        finally:
            self.hook_seconds += time.perf_counter() - started

    def on_train_batch_end(self, *args):
        return self._timed(super().on_train_batch_end, *args)

    def on_before_optimizer_step(self, *args):
        return self._timed(super().on_before_optimizer_step, *args)


class StepClock(pl.Callback):
    """Wall time of the training steps after a warm-up (excludes setup and the end)."""

    def __init__(self, warmup: int):
        self.warmup, self.started, self.steps, self.seconds = warmup, None, 0, 0.0

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.warmup:
            self.started = time.perf_counter()
        elif self.started is not None:
            self.steps = trainer.global_step - self.warmup
            self.seconds = time.perf_counter() - self.started


def run(cfg: DemoConfig, steps: int, callbacks: list) -> StepClock:
    clock = StepClock(warmup=5)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False, callbacks=[clock, *callbacks])
    trainer.fit(toy_module(cfg.train), training_data(Path(cfg.out) / "world", cfg.train))
    return clock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="every_n_train_steps of the eval callback")
    p.add_argument("--out", default="runs/bench-overhead")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)  # toy models: one intra-op thread (as the demo), the other core scores
    cfg = DemoConfig(out=args.out)
    cache, target, baseline = resolve_world(cfg)

    plain = run(cfg, args.steps, [])
    cb = TimedEvalCallback(cache=cache, target=target, baseline=baseline, every_n_train_steps=args.every,
                           scoring={"ddtree_budgets": [4, 8], "device": "cpu"}, dirpath=str(Path(args.out) / "dflash"),
                           baseline_cache_dir=str(Path(args.out) / "baseline-reports"), verbose=False)
    stop = TrailingBaselineStop(monitor="ddtree@8/live", action="warn", verbose=False)  # decides, never stops
    with_cb = run(cfg, args.steps, [cb, stop])

    result = {
        "steps": args.steps, "every_n_train_steps": args.every, "reports": len(cb.reports),
        "skipped_busy": cb.skipped,
        "steps_per_second_without": plain.steps / plain.seconds,
        "steps_per_second_with": with_cb.steps / with_cb.seconds,
        "hook_seconds_total": cb.hook_seconds,
        "hook_ms_per_step": 1000 * cb.hook_seconds / args.steps,
        "torch_threads": torch.get_num_threads(),
    }
    result["slowdown"] = 1 - result["steps_per_second_with"] / result["steps_per_second_without"]
    print("| | steps/s | time in callback hooks |")
    print("|---|---|---|")
    print(f"| without callbacks | {result['steps_per_second_without']:.1f} | - |")
    print(f"| with callbacks (every {args.every} steps, {len(cb.reports)} reports, {cb.skipped} skipped busy) | "
          f"{result['steps_per_second_with']:.1f} | {result['hook_seconds_total']:.2f} s total, "
          f"{result['hook_ms_per_step']:.2f} ms/step |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
