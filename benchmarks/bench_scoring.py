"""The batched scorer against the naive per-anchor loop, on the toy coding cache.

1. Times `score_task` (many blocks per forward, two-part block attention, context K/V
   once per task, streaming LM-head statistics) and `score_task_naive` (tests/: one
   drafter forward per anchor, full logits, `oracles.streaks`) on the same tasks,
   `--repeats` times each, interleaved (the medians are reported: timings on shared
   cores are noisy), and checks that every per-anchor streak agrees.
   With `--profile`, one more batched pass runs under torch.profiler and prints where
   its time goes by op, and the ceiling of this design on this machine: the naive time
   over the time in the GEMMs and the attention kernel alone (every other op free).
2. Peak memory of the streaming LM-head path (backend "torch") against materialised
   logits ("reference") for one task's anchors at a vocabulary of 150k.

`--family dflash2` scores a random DFlash 2 drafter of the toy shape instead (speculators' default
convolution and selector: 2 taps, groups of 16, rank 256, K = 16; or `--drafter` a DFlash 2 folder)
and states where its scoring time goes: the drafter's forwards, the LM head's streaming top-K, the
selector (its scores and statistics) and the exact DDTree over the candidate tree. The naive loop
scores DFlash only, so it is not run for DFlash 2.

    python benchmarks/bench_scoring.py [--family dflash|dflash2] [--tasks 10] [--threads 1] [--repeats 5]
                                       [--drafter DIR] [--profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))  # the naive scorer and its oracles
from bench_kernels import human, make_inputs, measure, pin_mmap_threshold  # noqa: E402

import dataclasses  # noqa: E402

from dflash_callbacks import DFlashDrafter, TargetHead, load_drafter  # noqa: E402
from dflash_callbacks.model import build_drafter  # noqa: E402
from dflash_callbacks.model.families import dflash2, dflash2_selector  # noqa: E402
from dflash_callbacks.kernels.head_stats import head_stats  # noqa: E402
from dflash_callbacks.scoring.config import ScoringConfig  # noqa: E402
from dflash_callbacks.scoring.scorer import score_task  # noqa: E402
from dflash_callbacks.demos.toy.world import build_toy_cache, toy_drafter_config, toy_target_path  # noqa: E402
from naive_scorer import score_task_naive  # noqa: E402


ARITHMETIC_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu")
"""The ops doing the scorer's arithmetic on the CPU (projections, MLP, LM head, attention)."""


def profile_ops(run) -> tuple[dict[str, float], float]:
    """Self CPU seconds by op of one `run()`, largest first, and those of ARITHMETIC_OPS."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    by_op = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    by_op = dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
    return by_op, sum(by_op.get(op, 0.0) for op in ARITHMETIC_OPS)


TIMED = {  # part of DFlash 2's scoring: (module, function) timed while scoring
    "LM-head top-K (streaming)": (dflash2_selector, "head_topk"),
    "selector statistics (with the top-K)": (dflash2, "selector_stats"),
    "DDTree over the candidate tree": (dflash2, "candidate_ddtree_streaks"),
}


def selector_share(drafter, head, tasks, config, block_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of scoring `tasks` in all, and in each part of TIMED (wrapped by timers)."""
    spent: dict[str, float] = {}
    originals = {name: getattr(module, attr) for name, (module, attr) in TIMED.items()}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return run

    runs = []
    try:
        for name, (module, attr) in TIMED.items():
            setattr(module, attr, timed(name, originals[name]))
        for _ in range(repeats):
            spent.clear()
            t0 = time.perf_counter()
            for task in tasks:
                score_task(drafter, head, task, config, block_size)
            runs.append({"total": time.perf_counter() - t0, **spent})
    finally:
        for name, (module, attr) in TIMED.items():
            setattr(module, attr, originals[name])
    return {key: statistics.median(r.get(key, 0.0) for r in runs) for key in runs[0]}


def main_dflash2(args, cache, head) -> dict:
    torch.manual_seed(0)
    if args.drafter:
        drafter = load_drafter(args.drafter)
    else:
        settings = dflash2.Settings(conv_group_size=16, conv_kernel_size=2, selector_rank=256, selector_top_k=16)
        drafter = build_drafter(dataclasses.replace(toy_drafter_config(), family="dflash2", family_config=settings))
    drafter = drafter.eval()
    config = ScoringConfig(ddtree_budgets=[4, 8], topk=[4], device="cpu", anchors_per_forward=args.anchors_per_forward)
    B, names = drafter.config.block_size, cache.task_names[: args.tasks]
    tasks = [cache.task(n) for n in names]
    anchors = sum(t.num_tokens - 1 - t.prompt_len for t in tasks)
    score_task(drafter, head, tasks[0], config, B)  # warm-up
    times = selector_share(drafter, head, tasks, config, B, args.repeats)
    topk = times["LM-head top-K (streaming)"]
    selector = times["selector statistics (with the top-K)"] - topk
    ddtree = times["DDTree over the candidate tree"]
    rest = times["total"] - topk - selector - ddtree
    settings = drafter.config.family_config
    print(f"| DFlash 2 scoring, {len(tasks)} tasks, {anchors} anchors, B = {B}, K = {settings.selector_top_k}, "
          f"rank {settings.selector_rank}, V = {head.vocab_size}, {', '.join(config.methods)} "
          f"| median of {args.repeats} (s) | share |")
    print("|---|---|---|")
    for part, seconds in (("drafter forwards and the rest", rest), ("LM-head top-K (streaming)", topk),
                          ("selector: scores and statistics", selector), ("DDTree over the candidate tree", ddtree),
                          ("total", times["total"])):
        print(f"| {part} | {seconds:.3f} | {100 * seconds / times['total']:.0f}% |")
    result = {"family": "dflash2", "tasks": len(tasks), "anchors": anchors, "block_size": B, "methods": config.methods,
              "seconds": times, "selector_share": (selector + ddtree) / times["total"],
              "torch_threads": torch.get_num_threads()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("dflash", "dflash2"), default="dflash", help="the drafter family scored")
    p.add_argument("--tasks", type=int, default=10, help="how many coding10 tasks to score")
    p.add_argument("--drafter", type=Path, default=None, help="drafter folder (default: a random toy drafter)")
    p.add_argument("--cache", type=Path, default=Path("runs/bench-scoring/coding10"))
    p.add_argument("--vocab", type=int, default=150_000, help="vocabulary of the memory comparison")
    p.add_argument("--anchors-per-forward", type=int, default=ScoringConfig().anchors_per_forward)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each scorer; medians are reported")
    p.add_argument("--profile", action="store_true", help="also profile one batched pass by op")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cache = build_toy_cache(args.cache) if not (args.cache / "manifest.json").is_file() else None
    from dflash_callbacks.cache.format import HiddenStateCache

    cache = cache or HiddenStateCache(args.cache)
    if args.family == "dflash2":
        return main_dflash2(args, cache, TargetHead.from_pretrained(toy_target_path()))
    torch.manual_seed(0)
    drafter = load_drafter(args.drafter) if args.drafter else DFlashDrafter(toy_drafter_config()).eval()
    head = TargetHead.from_pretrained(toy_target_path())
    config = ScoringConfig(ddtree_budgets=[4, 8], topk=[4], device="cpu", anchors_per_forward=args.anchors_per_forward)
    B = drafter.config.block_size
    names = cache.task_names[: args.tasks]
    tasks = [cache.task(n) for n in names]
    anchors = sum(t.num_tokens - 1 - t.prompt_len for t in tasks)

    score_task(drafter, head, tasks[0], config, B)  # warm-up
    score_task_naive(drafter, head, tasks[0], config, B)
    batched_runs, naive_runs = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fast = [score_task(drafter, head, t, config, B) for t in tasks]
        batched_runs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        slow = [score_task_naive(drafter, head, t, config, B) for t in tasks]
        naive_runs.append(time.perf_counter() - t0)
    batched_s, naive_s = statistics.median(batched_runs), statistics.median(naive_runs)
    mismatches = [(f.name, m) for f, s in zip(fast, slow) for m in config.methods if not torch.equal(f.streaks[m], s.streaks[m])]

    profile = profile_ops(lambda: [score_task(drafter, head, t, config, B) for t in tasks]) if args.profile else None

    # memory: one task's drafts (anchors x (B-1) rows) against a 150k vocabulary
    pin_mmap_threshold()
    rows = max(t.num_tokens - 1 - t.prompt_len for t in tasks) * (B - 1)
    hidden, weight, labels = make_inputs(rows, drafter.config.hidden_size, args.vocab, torch.float32, torch.device("cpu"))
    memory = {}
    for backend in ("reference", "torch"):
        _, _, peak, _ = measure(lambda: head_stats(hidden, weight, labels, 8, backend=backend), torch.device("cpu"), 2, 1)
        memory[backend] = peak

    result = {
        "tasks": len(tasks), "anchors": anchors, "block_size": B, "methods": config.methods,
        "batched_seconds": batched_s, "naive_seconds": naive_s, "speedup": naive_s / batched_s,
        "batched_runs": batched_runs, "naive_runs": naive_runs,
        "streaks_agree": not mismatches, "mismatches": mismatches,
        "memory_rows": rows, "memory_vocab": args.vocab,
        "peak_materialised_bytes": memory["reference"], "peak_streaming_bytes": memory["torch"],
        "torch_threads": torch.get_num_threads(),
    }
    if profile is not None:
        result["profile_seconds_by_op"], result["arithmetic_seconds"] = profile
        result["ceiling_speedup"] = naive_s / profile[1]
    print(f"| scorer | {len(tasks)} tasks, {anchors} anchors | median of {args.repeats} runs (s) |")
    print("|---|---|---|")
    print(f"| naive per-anchor loop | one forward per anchor, full logits | {naive_s:.2f} |")
    print(f"| batched | {config.anchors_per_forward} blocks per forward, streaming head | {batched_s:.3f} |")
    print(f"speedup {naive_s / batched_s:.1f}x ({torch.get_num_threads()} torch threads); "
          f"every per-anchor streak agrees: {not mismatches}")
    if profile is not None:
        by_op, arithmetic = profile
        total = sum(by_op.values())
        print(f"\none batched pass, profiled: {total:.3f} s; " + ", ".join(
            f"{op} {100 * t / total:.0f}%" for op, t in list(by_op.items())[:8]))
        print(f"GEMMs and attention alone: {arithmetic:.3f} s, so this design's ceiling here is "
              f"{naive_s / arithmetic:.1f}x (every other op free)")
    print(f"\n| LM-head statistics, {rows} rows x V={args.vocab} | peak extra memory |")
    print("|---|---|")
    print(f"| materialised logits + torch ops | {human(memory['reference'])} |")
    print(f"| streaming (chunked torch path) | {human(memory['torch'])} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if mismatches:
        sys.exit(f"batched and naive streaks differ: {mismatches}")
    return result


if __name__ == "__main__":
    main()
