"""What evaluation costs the training thread: a run with and without it, in a Lightning Trainer
(`--loop lightning`, DrafterEvalCallback) or a plain PyTorch loop (`--loop plain`, DrafterEvaluator).

The same training (a DFlash drafter on random target features, AdamW, one device) runs
twice: without evaluation, then with it (`--runner thread` or `process`, a snapshot every
`--every` steps, scored against a synthetic cache) and a TrailingBaselineStop (action "warn":
it decides, never stops). Reported, as a table and as JSON:
- step time (median, max) of both runs, and steps/s;
- per snapshot, the time inside the callback's hooks on the training thread (the copy
  started in on_train_batch_end) plus the wait in on_before_optimizer_step: the stall;
- the scorer's own seconds (sum over reports) and the steps/s lost, as seconds of
  training time, to set against them;
- the scorer's peak accelerator memory per report (CUDA only);
- with `--min-ratio R`, a baseline drafter (random weights) and the stop at that threshold: the
  longest the training thread spent in the evaluation on any step (the baseline's arrival and the
  stop's setup warning included), against the 10 ms every step must stay under.

    python benchmarks/bench_stall.py --size toy                           # CPU, about a minute
    python benchmarks/bench_stall.py --size toy --loop plain --runner process
    python benchmarks/bench_stall.py --size production --json stall.json  # one GPU
    python benchmarks/bench_stall.py --size toy --loop plain --min-ratio 0.9995   # the worst threshold

Sizes: production is the Qwen3.6-27B DFlash shape (hidden 5120, 5 layers, 1.78 B
parameters), bf16-true, batch 4 of 1024 context + 512 block tokens, V = 248,320, 10
cache tasks of 160 + 512 tokens (the target head, 5 GB in bf16, is written to --work).
Imports neither wandb nor omegaconf.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_callbacks.cache.format import TargetInfo, new_manifest, open_for_writing, write_task  # noqa: E402
from dflash_callbacks.callbacks.eval_callback import DrafterEvalCallback  # noqa: E402
from dflash_callbacks.callbacks.stopping import TrailingBaselineStop  # noqa: E402
from dflash_callbacks.loop import DrafterEvaluator  # noqa: E402
from dflash_callbacks.model.io import save_drafter  # noqa: E402
from dflash_callbacks.model import DFlashDrafter, DrafterConfig, build_target_layer_ids  # noqa: E402
from dflash_callbacks.model.geometry import block_attention_mask, block_positions  # noqa: E402

SIZES = {
    "production": dict(hidden=5120, layers=5, heads=40, kv_heads=8, head_dim=128, intermediate=17408, vocab=248_320,
                       target_layers=64, batch=4, context=1024, blocks=32, tasks=10, prompt=160, completion=512,
                       steps=60, every=10, precision="bf16-true", dtype=torch.bfloat16),
    "toy": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=3000, target_layers=8,
                batch=2, context=96, blocks=4, tasks=3, prompt=16, completion=48, steps=80, every=10,
                precision="32-true", dtype=torch.float32),
}
BLOCK = 16


def drafter_config(size: dict) -> DrafterConfig:
    V = size["vocab"]
    return DrafterConfig(
        hidden_size=size["hidden"], intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"],
        block_size=BLOCK, mask_token_id=V - 1, target_layer_ids=build_target_layer_ids(size["target_layers"],
                                                                                      size["layers"]),
        vocab_size=V, num_target_layers=size["target_layers"],
    )


def write_world(size: dict, config: DrafterConfig, work: Path, device: str) -> tuple[Path, Path]:
    """A target folder (embedding and LM head only) and a cache of random tasks that fit
    `config` (random numbers drawn on `device`: 2.5 G of them at production size)."""
    target, cache = work / "target", work / "cache"
    if (cache / "manifest.json").is_file():
        return target, cache
    g = torch.Generator(device=device).manual_seed(0)
    H, V, dtype = size["hidden"], size["vocab"], size["dtype"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype).cpu()

    target.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": randn(V, H, scale=0.02), "lm_head.weight": randn(V, H, scale=H**-0.5)},
              str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": V, "hidden_size": H}))
    layers = config.target_layer_ids
    info = TargetInfo(str(target), size["target_layers"], H, V, str(dtype).split(".")[1])
    open_for_writing(cache, new_manifest(info, layers))
    T = size["prompt"] + size["completion"]
    for i in range(size["tasks"]):
        tokens = torch.randint(0, V - 1, (T,), generator=g, device=device).cpu()
        write_task(cache, f"task{i:02d}", tokens, randn(T, len(layers) * H), size["prompt"])
    return target, cache


class Steps(torch.utils.data.IterableDataset):
    """Endless step numbers; the features are drawn on the device inside the step."""

    def __iter__(self):
        step = 0
        while True:
            yield step
            step += 1


class DrafterOnFeatures(pl.LightningModule):
    """The drafter's forward and backward under the block mask on random target features
    (drawn on the device: the shapes are what matter), a simple loss, AdamW."""

    def __init__(self, config: DrafterConfig, size: dict):
        super().__init__()
        self.drafter = DFlashDrafter(config)
        self.size = size
        anchors = torch.linspace(size["context"] // 4, size["context"] - 1, size["blocks"]).long()
        self.register_buffer("mask", block_attention_mask(anchors, BLOCK, size["context"]), persistent=False)
        self.register_buffer("positions", block_positions(anchors, BLOCK, size["context"]), persistent=False)

    def training_step(self, batch, batch_idx):
        s, cfg = self.size, self.drafter.config
        dtype = self.drafter.fc.weight.dtype
        features = torch.randn(s["batch"], s["context"], cfg.num_target_features, device=self.device, dtype=dtype)
        noise = torch.randn(s["batch"], s["blocks"] * BLOCK, cfg.hidden_size, device=self.device, dtype=dtype)
        out = self.drafter(features, noise, self.positions[None], self.mask)
        return out.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.drafter.parameters(), lr=1e-5)


class TimedEvalCallback(DrafterEvalCallback):
    """Adds up, per step, the wall time spent in the training-thread hooks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_end_s: dict[int, float] = {}
        self.before_step_s: dict[int, float] = {}
        self.batch_end_cpu_s: dict[int, float] = {}  # the training thread's own CPU time in the hook

    def on_train_batch_end(self, trainer, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        super().on_train_batch_end(trainer, *args)
        self.batch_end_s[trainer.global_step] = time.perf_counter() - t0
        self.batch_end_cpu_s[trainer.global_step] = time.thread_time() - c0

    def on_before_optimizer_step(self, trainer, *args):
        t0 = time.perf_counter()
        super().on_before_optimizer_step(trainer, *args)
        self.before_step_s[trainer.global_step] = time.perf_counter() - t0


class StepClock(pl.Callback):
    """Wall time of every training step (between consecutive on_train_batch_end calls)."""

    def __init__(self):
        self.times, self._last = [], None

    def on_train_batch_end(self, trainer, *args):
        now = time.perf_counter()
        if trainer.lightning_module.device.type == "cuda":
            torch.cuda.synchronize()
            now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def train(size: dict, config: DrafterConfig, callbacks: list, steps: int, device: str) -> StepClock:
    torch.manual_seed(0)
    clock = StepClock()
    module = DrafterOnFeatures(config, size)
    trainer = pl.Trainer(max_steps=steps, accelerator=device, devices=1, precision=size["precision"], logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         callbacks=[clock, *callbacks])
    data = torch.utils.data.DataLoader(Steps(), batch_size=None, num_workers=0)
    trainer.fit(module, data)
    return clock


def train_plain(size: dict, config: DrafterConfig, evaluator: DrafterEvaluator | None, steps: int,
                device: str) -> tuple[list[float], dict[int, float], dict[int, float], dict[int, float]]:
    """The same training in a plain loop: (step times, seconds in evaluator.step() per step, seconds in the
    optimizer's pre-hook, the wait for a snapshot's copy, per step, the training thread's CPU seconds in
    evaluator.step() per step)."""
    torch.manual_seed(0)
    module = DrafterOnFeatures(config, size).to(device=device, dtype=size["dtype"])
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-5)
    in_step, in_hook, in_step_cpu = {}, {}, {}
    if evaluator is not None:
        landed = evaluator.engine.copy_landed

        def timed_copy_landed():
            t0 = time.perf_counter()
            landed()
            in_hook[current[0]] = time.perf_counter() - t0

        evaluator.engine.copy_landed = timed_copy_landed
        evaluator.attach(module.drafter, optimizer)
    current, times, last = [0], [], None
    for step in range(1, steps + 1):
        current[0] = step
        loss = module.training_step(None, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if evaluator is not None:
            t0, c0 = time.perf_counter(), time.thread_time()
            evaluator.step(step)
            in_step[step], in_step_cpu[step] = time.perf_counter() - t0, time.thread_time() - c0
        if device == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    if evaluator is not None:
        evaluator.close()
    return times, in_step, in_hook, in_step_cpu


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="toy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--work", type=Path, default=Path("runs/bench-stall"), help="where the synthetic world is written")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--loop", choices=["lightning", "plain"], default="lightning")
    p.add_argument("--runner", choices=["thread", "process"], default="thread")
    p.add_argument("--min-ratio", type=float, default=None,
                   help="score a baseline too and stop (action warn) below this ratio of it; e.g. 0.9995, the worst a "
                        "cache of few tasks can resolve")
    args = p.parse_args(argv)
    size = SIZES[args.size]
    steps, every = args.steps or size["steps"], args.every or size["every"]
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny models: one intra-op thread trains, the other core scores
    config = drafter_config(size)
    t0 = time.perf_counter()
    target, cache = write_world(size, config, args.work / args.size, args.device)
    setup_s = time.perf_counter() - t0

    scoring = {"ddtree_budgets": [4, 8], "topk": [4], "device": args.device,
               "dtype": "bfloat16" if size["dtype"] == torch.bfloat16 else "float32"}
    stop = TrailingBaselineStop(monitor="ddtree@8/live", action="warn", verbose=False, min_ratio=args.min_ratio)
    baseline = None
    if args.min_ratio is not None:
        baseline = target.parent / "baseline"
        if not (baseline / "config.json").is_file():  # random weights of the trained drafter's shape
            torch.manual_seed(1)
            save_drafter(baseline, config, DFlashDrafter(config).to(size["dtype"]).state_dict())
    evaluation = dict(cache=cache, target=target, baseline=baseline, verbose=False, scoring=scoring,
                      dirpath=args.work / "runs", busy="skip", runner=args.runner,
                      baseline_cache_dir=args.work / "baseline-reports")
    if args.loop == "lightning":
        without = train(size, config, [], steps, args.device).times
        cb = TimedEvalCallback(every_n_train_steps=every, **evaluation)
        with_times = train(size, config, [cb, stop], steps, args.device).times
        in_step, in_hook, view = cb.batch_end_s, {s - 1: t for s, t in cb.before_step_s.items()}, cb
        in_step_cpu = cb.batch_end_cpu_s
    else:
        without, _, _, _ = train_plain(size, config, None, steps, args.device)
        evaluator = DrafterEvaluator(every_n_steps=every, stop=stop, **evaluation)
        with_times, in_step, in_hook, in_step_cpu = train_plain(size, config, evaluator, steps, args.device)
        view = evaluator
    snapshot_steps = sorted({r.step for r in view.reports} | {s for s in in_step if s % every == 0})
    stalls = [in_step.get(s, 0.0) + in_hook.get(s, 0.0) for s in snapshot_steps if s < steps]
    any_step = max(in_step.get(s, 0.0) + in_hook.get(s, 0.0) for s in in_step)  # the baseline's arrival too
    scorer_s = sum(r.seconds or 0.0 for r in view.reports)
    lost_s = sum(with_times) - sum(without)
    result = {
        "loop": args.loop, "runner": args.runner,
        "size": args.size, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "steps": steps, "every_n_train_steps": every, "setup_s": setup_s, "reports": len(view.reports),
        "skipped_busy": view.skipped, "errors": view.errors,
        "step_s_median": {"without": statistics.median(without), "with": statistics.median(with_times)},
        "step_s_max": {"without": max(without), "with": max(with_times)},
        "steps_per_s": {"without": len(without) / sum(without), "with": len(with_times) / sum(with_times)},
        "stall_ms_per_snapshot": {"max": 1000 * max(stalls, default=0.0), "median": 1000 * statistics.median(stalls)
                                  if stalls else 0.0, "first": 1000 * stalls[0] if stalls else None},
        "wait_before_optimizer_ms_max": 1000 * max(in_hook.values(), default=0.0),
        "stall_ms_any_step_max": 1000 * any_step, "min_ratio": args.min_ratio,
        "training_thread_cpu_ms_any_step_max": 1000 * max(in_step_cpu.values(), default=0.0),
        "baseline_scored": view.baseline_report is not None,
        "scorer_s": scorer_s, "training_s_lost": lost_s,
        "lost_over_scorer": lost_s / scorer_s if scorer_s else None,
        "scorer_peak_memory_gib": max((r.peak_memory or 0) for r in view.reports) / 2**30 if view.reports else None,
    }
    result["steps_per_s_ratio"] = result["steps_per_s"]["with"] / result["steps_per_s"]["without"]
    print(f"| {args.size} on {result['device']}, {args.loop} loop, runner {args.runner}, {steps} steps, a snapshot "
          f"every {every} | without | with |")
    print("|---|---|---|")
    print(f"| step time, median / max (s) | {result['step_s_median']['without']:.4f} / {result['step_s_max']['without']:.4f} "
          f"| {result['step_s_median']['with']:.4f} / {result['step_s_max']['with']:.4f} |")
    print(f"| steps/s | {result['steps_per_s']['without']:.2f} | {result['steps_per_s']['with']:.2f} |")
    print(f"| stall per snapshot (hooks + wait before the optimizer step), max / first | - | "
          f"{result['stall_ms_per_snapshot']['max']:.2f} / {result['stall_ms_per_snapshot']['first'] or 0:.2f} ms |")
    print(f"| the longest step inside the evaluation, any step{baseline_said(args.min_ratio)}: wall / the training "
          f"thread's CPU | - | {result['stall_ms_any_step_max']:.2f} / "
          f"{result['training_thread_cpu_ms_any_step_max']:.2f} ms |")
    print(f"| steps/s with / without | - | {result['steps_per_s_ratio']:.3f} |")
    print(f"| reports ({view.skipped} skipped while busy), scorer seconds | - | {len(view.reports)}, {scorer_s:.2f} s |")
    print(f"| training time lost / scorer seconds | - | {lost_s:.2f} s / {scorer_s:.2f} s |")
    peak = result["scorer_peak_memory_gib"]
    print(f"| scorer peak memory | - | {'-' if not peak else f'{peak:.2f} GiB'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def baseline_said(min_ratio: float | None) -> str:
    return "" if min_ratio is None else f" (a baseline, the stop at min_ratio={min_ratio!r})"


if __name__ == "__main__":
    main()
