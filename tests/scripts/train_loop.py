"""A plain PyTorch training run of the DFlash drafter with `DrafterEvaluator` attached, run as a
subprocess the way a user runs a training script:

    python tests/scripts/train_loop.py --world W --root R --max-steps 40 --every 2 \
        [--ckpt-every 3] [--resume CKPT] [--stop-min-ratio 5] [--record]
    python -m torch.distributed.run --nproc-per-node 2 tests/scripts/train_loop.py ... --parallel ddp|fsdp2

With `--parallel`, the script initialises torch.distributed (gloo) from torchrun's environment and
wraps the drafter in DDP, or shards it per layer with FSDP2 `fully_shard`. Every rank writes
R/rank{N}.json with `--record`: the step it ended at, the stop, and what its evaluator held.
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

import torch  # noqa: E402

from dflash_callbacks import DrafterEvaluator, DrafterConfig  # noqa: E402
from dflash_callbacks.engine.stop import StopPolicy  # noqa: E402

from loops import LR, SCORING, DrafterModel, Sequences  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=Path, required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--runner", default="thread")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--eval-cache", type=Path, default=None)
    p.add_argument("--anchors-per-forward", type=int, default=64)
    p.add_argument("--busy", default="skip")
    p.add_argument("--stop-min-ratio", type=float, default=None)
    p.add_argument("--stop-patience", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--parallel", default="none", choices=["none", "ddp", "fsdp2"])
    p.add_argument("--record", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    rank = 0
    if args.parallel != "none":
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
    if not (args.world / "cache").is_dir():
        from synthetic import build_world

        build_world(args.world)
    config = DrafterConfig.from_file(args.world / "baseline")
    model = DrafterModel(config, args.world / "target")
    net, drafter = model, model.drafter
    if args.parallel == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)  # gradients all-reduced; the head is frozen
    elif args.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.drafter.layers:
            fully_shard(layer)
        fully_shard(model.drafter)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=LR)
    stop = None
    if args.stop_min_ratio is not None:
        stop = StopPolicy(monitor="ddtree@4/live", min_ratio=args.stop_min_ratio, patience=args.stop_patience,
                          verbose=False)
    evaluator = DrafterEvaluator(
        cache=args.eval_cache or args.world / "cache", target=args.world / "target",
        baseline=None if args.no_baseline else args.world / "baseline", every_n_steps=args.every, stop=stop,
        dirpath=args.root / "dflash", runner=args.runner, busy=args.busy, baseline_cache_dir=args.root / "bc",
        scoring={**SCORING, "anchors_per_forward": args.anchors_per_forward}, wait_timeout=300, verbose=False,
        max_steps=args.max_steps)
    evaluator.attach(drafter, optimizer)
    start = 0
    if args.resume is not None:
        saved = torch.load(args.resume, weights_only=False)
        model.drafter.load_state_dict(saved["drafter"])
        optimizer.load_state_dict(saved["optimizer"])
        model.generator.set_state(saved["generator"])
        evaluator.load_state_dict(saved["evaluator"])
        start = saved["step"]
    data = Sequences(args.world / "cache", 10**6)
    threads_on_rank1 = []
    step = start
    with evaluator:
        for step in range(start + 1, args.max_steps + 1):
            loss = net(**data[(step - 1) * (2 if args.parallel != "none" else 1) + rank])["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.step_sleep:  # the behaviour asked for: a training step that takes this long
                time.sleep(args.step_sleep)
            stopped = evaluator.step(step)
            if rank != 0:
                threads_on_rank1 += [t.name for t in threading.enumerate() if t.name.startswith("dflash")]
            if args.ckpt_every and step % args.ckpt_every == 0 and rank == 0:
                (args.root / "ckpt").mkdir(parents=True, exist_ok=True)
                path = args.root / "ckpt" / f"step={step}.pt"
                torch.save({"drafter": model.drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "generator": model.generator.get_state(), "evaluator": evaluator.state_dict()},
                           path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
            if stopped:
                break
        evaluator.close()
    if args.record:
        out = {"rank": rank, "pid": os.getpid(), "step": step, "should_stop": evaluator.should_stop,
               "stop_reason": evaluator.stop_reason, "stopped_step": stop.stopped_step if stop else None,
               "reports": [r.step for r in evaluator.reports], "history": [h["step"] for h in evaluator.history],
               "errors": evaluator.errors, "threads_on_rank1": sorted(set(threads_on_rank1)),
               "metrics_step": evaluator.metrics.get("dflash/step"), "run_id": evaluator.state_dict()["run_id"]}
        (args.root / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    if args.parallel != "none":
        # the DDP wrapper goes first, while the process group lives: freed at exit instead, its reducer
        # destroys the group with the GIL held, and a gloo thread finishing a broadcast waits for the GIL
        del net, model
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
