"""End-to-end scoring at the production shape, per LM-head backend, against its floor.

A random drafter of the Qwen3.6-27B DFlash shape (hidden 5120, 5 layers, 40 heads /
8 KV heads, head_dim 128, intermediate 17408, block 16), a random LM head and
embedding (V = 248,320), bf16, and an in-memory synthetic cache of 10 tasks of
160 prompt + 512 completion tokens (random target hidden states for 5 target layer
ids, random tokens). `score_drafter` scores every task with methods vanilla,
ddtree@4, ddtree@8 and top@4, once per backend (after one warm-up task, so Triton
compiles and cuBLAS picks its kernels outside the timing).

So that the streaks are not all zero (and the agreement check means something), the
completion tokens are drawn from a "hot" set of HOT_TOKENS ids spread over the
vocabulary whose LM-head rows are scaled up: the drafter's argmax is usually a hot
token, right about one time in HOT_TOKENS.

Reported per backend: wall time of the full scoring, peak GPU memory
(`torch.cuda.max_memory_allocated`, CUDA only), time over the floor, and whether its
report equals the first backend's (every task's dense/live tau and acceptance curve
of every method, exactly). The floor is the same `score_drafter` run with the LM-head
statistics replaced by the bare GEMM of the same rows (bf16 in, fp32 accumulate and
out on CUDA, logits thrown away): the drafter forwards as the scorer runs them, plus
the GEMM; the GEMM's own share is timed separately.

    python benchmarks/bench_production.py --size toy --device cpu          # < 1 min on a laptop CPU
    python benchmarks/bench_production.py --size production --json out.json  # CUDA

Imports only the submodules it needs (no wandb, no omegaconf, which the GPU check
machine lacks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import floor_fn  # noqa: E402

from dflash_callbacks.cache.format import CacheTask, CacheMismatchError  # noqa: E402
from dflash_callbacks.kernels.head_stats import HeadStats  # noqa: E402
from dflash_callbacks.model.config import DrafterConfig, build_target_layer_ids  # noqa: E402
from dflash_callbacks.model.drafter import DFlashDrafter  # noqa: E402
from dflash_callbacks.model.target_head import TargetHead  # noqa: E402
from dflash_callbacks.scoring import scorer  # noqa: E402
from dflash_callbacks.model import drafter as drafter_module  # noqa: E402
from dflash_callbacks.scoring.config import ScoringConfig  # noqa: E402

SIZES = {
    "production": dict(hidden=5120, layers=5, heads=40, kv_heads=8, head_dim=128, intermediate=17408,
                       vocab=248_320, target_layers=64, tasks=10, prompt=160, completion=512),
    "toy": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                vocab=3000, target_layers=8, tasks=3, prompt=16, completion=48),
}
BLOCK = 16
HOT_TOKENS = 8
METHODS = dict(ddtree_budgets=[4, 8], topk=[4])


class MemoryCache:
    """The part of `HiddenStateCache` that `score_drafter` reads, held in memory."""

    path = "<synthetic, in memory>"
    fingerprint = "synthetic"
    sampling = None  # greedy answers, as a cache without sampling settings

    def __init__(self, tasks: list[CacheTask], layer_ids: list[int], hidden_size: int, vocab_size: int):
        self._tasks = {t.name: t for t in tasks}
        self.layer_ids, self.hidden_size, self.vocab_size = layer_ids, hidden_size, vocab_size

    @property
    def task_names(self) -> list[str]:
        return list(self._tasks)

    def task(self, name: str) -> CacheTask:
        return self._tasks[name]

    def check_compatible(self, cfg: DrafterConfig, block_size: int | None = None) -> None:
        if (list(cfg.target_layer_ids), cfg.hidden_size, cfg.vocab_size) != (
            self.layer_ids, self.hidden_size, self.vocab_size
        ):
            raise CacheMismatchError("the synthetic cache does not fit the drafter")


def build(size: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(drafter, head, cache) of the given shape, on `device` in `dtype`."""
    torch.manual_seed(seed)
    H, V = size["hidden"], size["vocab"]
    layer_ids = build_target_layer_ids(size["target_layers"], size["layers"])
    cfg = DrafterConfig(
        hidden_size=H, intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"],
        block_size=BLOCK, mask_token_id=V - 1, target_layer_ids=layer_ids, vocab_size=V,
        num_target_layers=size["target_layers"],
    )
    with torch.device(device):  # weights initialised where they run
        drafter = DFlashDrafter(cfg)
    drafter = drafter.to(dtype).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    hot = torch.linspace(0, V - 2, HOT_TOKENS, device=device).long()
    lm_head = torch.randn(V, H, generator=g, device=device).mul_(3.0 / H**0.5)
    lm_head[hot] *= 4.0
    head = TargetHead(torch.randn(V, H, generator=g, device=device).mul_(0.02).to(dtype), lm_head.to(dtype))
    del lm_head
    tasks = []
    T = size["prompt"] + size["completion"]
    for i in range(size["tasks"]):
        prompt = torch.randint(0, V - 1, (size["prompt"],), generator=g, device=device)
        completion = hot[torch.randint(0, HOT_TOKENS, (size["completion"],), generator=g, device=device)]
        hidden = torch.randn(T, len(layer_ids) * H, generator=g, device=device, dtype=dtype)
        tasks.append(CacheTask(f"task{i:02d}", size["prompt"], torch.cat([prompt, completion]).cpu(), hidden.cpu()))
    return drafter, head, MemoryCache(tasks, layer_ids, H, V)


class FloorHead:
    """Stands in for `head_stats` in the scorer: the bare GEMM of the same rows, then
    zero statistics of the right shapes; adds up the GEMM's own time."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.gemm_s, self.rows = 0.0, 0

    def __call__(self, hidden, weight, labels, top_n, **_):
        run, self.kind = floor_fn(hidden, weight)
        _sync(hidden.device)
        t0 = time.perf_counter()
        run()
        _sync(hidden.device)
        self.gemm_s += time.perf_counter() - t0
        self.rows += hidden.shape[0]
        m, dev = hidden.shape[0], hidden.device
        zeros = torch.zeros(m, device=dev)
        return HeadStats(zeros, zeros, zeros.long(), zeros.long(), torch.full((m, top_n), float("-inf"), device=dev))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def score(drafter, head, cache, config: ScoringConfig, after_warmup=lambda: None):
    """(report, seconds, peak GPU bytes or None) of one full scoring run, after a warm-up task."""
    device = config.resolved_device()
    warm = ScoringConfig(**{**config.to_dict(), "tasks": cache.task_names[:1]})
    scorer.score_drafter(drafter, cache, head, warm)
    _sync(device)
    after_warmup()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    report = scorer.score_drafter(drafter, cache, head, config)
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return report, seconds, peak


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="toy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--backends", default="torch,triton", help="comma list of torch,triton,reference")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (rewritten after each run)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    size = SIZES[args.size]
    backends = [b for b in args.backends.split(",") if b]

    t0 = time.perf_counter()
    drafter, head, cache = build(size, device, getattr(torch, args.dtype))
    rows = sum((t.num_tokens - 1 - t.prompt_len) * (BLOCK - 1) for t in cache._tasks.values())
    result = {
        "meta": {
            "size": args.size, **size, "block": BLOCK, "dtype": args.dtype, "methods": ["vanilla", "ddtree@4",
            "ddtree@8", "top@4"], "lm_head_rows": rows, "hot_tokens": HOT_TOKENS,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "build_s": time.perf_counter() - t0,
        },
        "runs": [],
    }
    print(f"built {args.size} in {result['meta']['build_s']:.1f} s; {rows} LM-head rows", file=sys.stderr)

    def save():
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))

    save()

    def config(backend: str) -> ScoringConfig:
        return ScoringConfig(**METHODS, device=args.device, dtype=args.dtype, backend=backend)

    # the floor: the scorer with the LM-head statistics replaced by the bare GEMM
    floor = FloorHead()
    real = drafter_module.head_stats  # where the drafter's head calls it
    drafter_module.head_stats = floor
    try:
        _, floor_s, floor_peak = score(drafter, head, cache, config("torch"), after_warmup=floor.reset)
    finally:
        drafter_module.head_stats = real
    assert floor.rows == rows, (floor.rows, rows)
    result["floor"] = {"seconds": floor_s, "gemm_s": floor.gemm_s, "drafter_and_rest_s": floor_s - floor.gemm_s,
                       "gemm": floor.kind, "peak_gpu_bytes": floor_peak}
    print(f"floor: {floor_s:.3f} s (GEMM {floor.gemm_s:.3f} s)", file=sys.stderr)
    save()

    first = None
    for backend in backends:
        run = {"backend": backend}
        result["runs"].append(run)
        if backend == "triton" and device.type != "cuda":
            from dflash_callbacks.kernels import triton_head_stats as th

            if not th.is_interpreted():
                run["status"] = "skipped: the Triton kernel runs on CUDA (on the CPU only under TRITON_INTERPRET=1)"
                print(f"{backend}: {run['status']}", file=sys.stderr)
                save()
                continue
        try:
            report, seconds, peak = score(drafter, head, cache, config(backend))
        except Exception as e:  # a failing backend must not hide the others' numbers
            run["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{backend}: {run['status']}", file=sys.stderr)
            save()
            continue
        tasks = report.to_dict()["tasks"]
        run.update(status="ok", seconds=seconds, peak_gpu_bytes=peak, x_floor=seconds / floor_s,
                   mean={m: report.to_dict()["mean"][m] for m in report.to_dict()["mean"]})
        if first is None:
            first = (backend, tasks)
            run["agrees_with"] = "-"
        else:
            run["agrees_with"] = first[0]
            run["identical_report"] = tasks == first[1]
            run["differences"] = [f"{t}/{m}" for t in tasks for m in tasks[t] if tasks[t][m] != first[1][t][m]]
        print(f"{backend}: {seconds:.3f} s, {seconds / floor_s:.2f}x floor"
              + (f", identical report: {run['identical_report']}" if "identical_report" in run else ""), file=sys.stderr)
        save()

    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    meta, floor = result["meta"], result["floor"]
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b is not None else "-"  # noqa: E731
    lines = [
        f"{meta['size']}: {meta['tasks']} tasks x ({meta['prompt']} + {meta['completion']}) tokens, hidden "
        f"{meta['hidden']}, V {meta['vocab']}, block {meta['block']}, {meta['dtype']}, {meta['lm_head_rows']} "
        f"LM-head rows, methods {', '.join(meta['methods'])}; device {meta['device']}, torch {meta['torch']}",
        "",
        "| run | time (s) | x floor | peak GPU memory | report equals the first backend's | mean vanilla live |",
        "|---|---|---|---|---|---|",
        f"| floor: drafter forwards + bare GEMM ({floor['gemm']}; GEMM {floor['gemm_s']:.3f} s) | "
        f"{floor['seconds']:.3f} | 1.00 | {gib(floor['peak_gpu_bytes'])} | - | - |",
    ]
    for run in result["runs"]:
        if run["status"] != "ok":
            lines.append(f"| {run['backend']} | - | - | - | {run['status']} | - |")
            continue
        same = "-" if run["agrees_with"] == "-" else (
            "yes" if run["identical_report"] else f"NO: {', '.join(run['differences'][:6])}")
        live = run["mean"].get("vanilla", {}).get("live")
        lines.append(f"| {run['backend']} | {run['seconds']:.3f} | {run['x_floor']:.2f} | {gib(run['peak_gpu_bytes'])} "
                     f"| {same} | {live if live is None else f'{live:.3f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
