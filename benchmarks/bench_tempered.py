"""The extra cost of scoring a sampled draft: `head_stats_tempered` (the five LM-head statistics and the
tempered log-sum-exp and label log-prob of a draft drawn from softmax(z / T), one pass) against `head_stats`
(greedy scoring's), both on the chunked torch path, on the same rows; and its largest difference from the
materialised reference where that fits (the reference holds M x V fp32 logits).

    python benchmarks/bench_tempered.py --device cpu --sizes toy
    python benchmarks/bench_tempered.py --device cuda --sizes production-task --dtype bf16 --json out.json

Sizes are bench_kernels.py's (M rows x H x V). Prints a markdown table: seconds of each (median of --repeat
after --warmup), the ratio, and the reference check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import DTYPES, make_inputs, parse_sizes  # noqa: E402
from dflash_callbacks.kernels.head_stats import head_stats, head_stats_tempered  # noqa: E402

REFERENCE_MAX_LOGITS = 1 << 28
"""Largest M x V the reference check materialises (1 GiB of fp32 logits)."""


def seconds(fn, device: torch.device, repeat: int, warmup: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(repeat):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def row(name: str, m: int, h: int, v: int, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    hidden, weight, labels = make_inputs(m, h, v, DTYPES[args.dtype], device)
    greedy = seconds(lambda: head_stats(hidden, weight, labels, args.top_n, backend="torch"), device, args.repeat,
                     args.warmup)
    tempered = seconds(lambda: head_stats_tempered(hidden, weight, labels, args.top_n, args.temperature,
                                                   backend="torch"), device, args.repeat, args.warmup)
    out = {"size": name, "M": m, "H": h, "V": v, "dtype": args.dtype, "device": str(device), "greedy_s": greedy,
           "tempered_s": tempered, "extra": tempered / greedy - 1}
    if m * v <= REFERENCE_MAX_LOGITS:
        found = head_stats_tempered(hidden, weight, labels, args.top_n, args.temperature, backend="torch")
        want = head_stats_tempered(hidden, weight, labels, args.top_n, args.temperature, backend="reference")
        out["max_diff"] = max(float((a - b).abs().max()) for a, b in
                              ((found.tempered_lse, want.tempered_lse),
                               (found.tempered_label_logprob, want.tempered_label_logprob)))
    return out


def main() -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("toy"))
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--top-n", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = [row(name, *size, args) for name, size in args.sizes]
    print("| size | M x H x V | dtype | greedy head_stats s | tempered s | extra | max diff vs reference |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        diff = f"{r['max_diff']:.1e}" if "max_diff" in r else "not run (too large)"
        print(f"| {r['size']} | {r['M']} x {r['H']} x {r['V']} | {r['dtype']} | {r['greedy_s']:.4f} | "
              f"{r['tempered_s']:.4f} | {100 * r['extra']:+.0f}% | {diff} |")
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
