"""A transformers Trainer run of the synthetic world's drafter with DrafterEvalTrainerCallback, run as a
user runs a training script; the HF fault tests (tests/contract/test_transformers_trainer.py) start it as a subprocess and SIGKILL it:

    python tests/scripts/train_hf.py --world W --root R --max-steps 100000 --every 2 --save-steps 3 \
        [--step-sleep 0.02] [--no-baseline] [--stop-min-ratio 5 --stop-patience 2] [--record]

`--world` is a folder made by `tests/support/synthetic.py:build_world` (tests/scripts/train_run.py `shared_world`).
The Trainer writes its checkpoints to R/checkpoint-N/, the callback its run folder under R/dflash/. Under
torchrun the Trainer runs DDP over gloo (tests/contract/test_transformers_trainer.py `test_two_ranks_*`); every rank writes
R/rank{N}.json with `--record`: the step it ended at, the stop, and what its callback held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "support", TESTS / "scripts"):  # the suite's helpers, as conftest.py puts them
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dflash_callbacks import TrailingBaselineStop  # noqa: E402
from dflash_callbacks.hf import DrafterEvalTrainerCallback  # noqa: E402
from loops import SCORING, hf_fit  # noqa: E402
from train_run import world_paths  # noqa: E402


class StepSleep(TrainerCallback):
    """The behaviour asked for by --step-sleep: a training step that takes that long."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=Path, required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--stop-min-ratio", type=float, default=None)
    p.add_argument("--stop-patience", type=int, default=1)
    p.add_argument("--record", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    world = SimpleNamespace(**world_paths(args.world))
    stop = None
    if args.stop_min_ratio is not None:
        stop = TrailingBaselineStop(monitor="ddtree@4/live", min_ratio=args.stop_min_ratio,
                                    patience=args.stop_patience, verbose=False)
    cb = DrafterEvalTrainerCallback(
        cache=world.cache, target=world.target, baseline=None if args.no_baseline else world.baseline,
        every_n_steps=args.every, scoring=SCORING, dirpath=args.root / "dflash", baseline_cache_dir=args.root / "bc",
        stop=stop, wait_timeout=300, verbose=False)
    callbacks = [cb] + ([StepSleep(args.step_sleep)] if args.step_sleep else [])
    with cb:
        trainer, _ = hf_fit(world, args.root, args.max_steps, callbacks, save_steps=args.save_steps)
    if args.record:
        rank = trainer.args.process_index
        out = {"rank": rank, "world_size": trainer.args.world_size, "pid": os.getpid(),
               "step": trainer.state.global_step, "should_stop": cb.should_stop, "stop_reason": cb.stop_reason,
               "stopped_step": stop.stopped_step if stop else None, "reports": [r.step for r in cb.reports],
               "history": [h["step"] for h in cb.history], "errors": cb.errors,
               "metrics_step": cb.metrics.get("dflash/step"), "run_id": cb.engine.state_dict()["run_id"]}
        (args.root / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # every rank leaves together (see train_run.py)
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
