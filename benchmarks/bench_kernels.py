"""Time and peak memory of the LM-head statistics backends, in one run, against the
GEMM floor of the same rows.

Compares `head_stats` backends on the same inputs:
  floor      the GEMM alone: hidden @ weight.T over the same rows, logits thrown away
             (CUDA: bf16/fp16 tensor-core GEMM with fp32 accumulation and output,
             `torch.mm(..., out_dtype=torch.float32)`; CPU: the GEMM in the operands'
             dtype, as torch has no 16-bit GEMM with fp32 output there), in row
             chunks of at most FLOOR_OUT_BYTES of output
  reference  materialised fp32 logits + torch ops
  torch      the chunked torch path
  triton     the split-V kernel + merge (CUDA; on the CPU only when run under
             TRITON_INTERPRET=1, for plumbing checks at tiny sizes)
  triton[BMxBVxBHwWsS]  the kernel with another tile config (--triton-configs)
at the production size (H = 5120, V = 248320, M = 10 tasks x 512 anchors x 15 depths
= 76800; one task's rows: 7665) and at toy sizes. Each row reports its time over the
floor's, the largest |lse| difference and the number of label_rank mismatches against
the reference (or, where the reference was skipped, against the first backend that
ran).

Peak memory ("peak extra"): on CUDA, torch.cuda.max_memory_allocated() during the call
minus the memory allocated before it (after reset_peak_memory_stats). On CPU, the
resident set size (RSS, /proc/self/statm) sampled every millisecond by a thread during
the call, minus the RSS just before it. So that RSS tracks live tensors, the script
pins glibc's mmap threshold at 128 KiB (mallopt; glibc otherwise raises it after the
first large free and keeps freed tiles in the heap): every tensor above 128 KiB is
then its own mapping, returned to the OS when freed. Allocations shorter than a
millisecond can be missed.

A backend whose estimated peak does not fit in the free memory is skipped and the
table says so (the production reference needs M*V*4 bytes = 76 GB for the logits
alone, plus temporaries). On CPU the kernel runs only under TRITON_INTERPRET=1 (slow:
use --sizes tiny), and `--cpu-max-rows` (default 256) caps M of sizes above 1e12
multiply-adds (the production size has 9.8e13: 195 TFLOP per call). Nothing here
imports wandb or omegaconf (the GPU check machine has neither).

    python benchmarks/bench_kernels.py --device cpu --sizes toy --backends floor,reference,torch
    python benchmarks/bench_kernels.py --device cuda --sizes production-task,production --json out.json
    python benchmarks/bench_kernels.py --device cuda --sizes production-task --backends floor,triton \
        --triton-configs 128x128x64w8s3,64x64x64w4s4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_callbacks.kernels.head_stats import head_stats  # noqa: E402

SIZES = {  # name: (M, H, V)
    "tiny": (96, 64, 2000),  # for plumbing checks (Triton interpreter on the CPU)
    "toy": (4096, 256, 32768),
    "small": (8192, 1024, 65536),
    "production": (76800, 5120, 248320),
    "production-task": (7665, 5120, 248320),  # one task's rows, as the scorer calls head_stats
    "production-4k-rows": (4096, 5120, 248320),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = ("floor", "reference", "torch", "triton")
FLOOR_OUT_BYTES = 1 << 31
"""Largest fp32 output block of the floor GEMM (rows per GEMM = this / (4 V))."""
# bytes per logit at the peak of each backend, beyond the inputs: the reference holds
# the fp32 logits, one fp32 temporary of the same shape and bool masks; the chunked
# path holds one tile of rows x chunk and a few temporaries of that size.
REFERENCE_BYTES_PER_LOGIT = 16  # measured 14 on CPU (toy size)
CPU_CAP_ABOVE = 10**12  # multiply-adds above which --cpu-max-rows applies on CPU


def parse_sizes(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if item in SIZES:
            out.append((item, SIZES[item]))
        elif item.count("x") == 2 and all(p.isdigit() for p in item.split("x")):
            m, h, v = (int(p) for p in item.split("x"))
            out.append((item, (m, h, v)))
        else:
            raise argparse.ArgumentTypeError(f"size {item!r}: use one of {list(SIZES)} or MxHxV, e.g. 4096x256x32768")
    return out


class RssPeak:
    """Peak RSS above the starting RSS while the block runs, sampled every 1 ms."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.base)
            time.sleep(0.001)

    def __enter__(self):
        self.base = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss() - self.base)


def pin_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """glibc: serve every allocation above `nbytes` by its own mmap (see module doc)."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def parse_configs(text: str) -> list[str]:
    """Tile configs as BMxBVxBHwWsS, e.g. 128x128x64w8s3."""
    out = [c for c in text.split(",") if c]
    for c in out:
        tile_config(c)
    return out


def tile_config(text: str):
    from dflash_callbacks.kernels.triton_head_stats import TileConfig

    try:
        tiles, rest = text.split("w")
        warps, stages = rest.split("s")
        return TileConfig(*(int(x) for x in tiles.split("x")), int(warps), int(stages))
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"tile config {text!r}: use BMxBVxBHwWsS, e.g. 128x128x64w8s3") from None


def floor_fn(hidden: torch.Tensor, weight: torch.Tensor):
    """The GEMM of the same rows alone, into a reused output block (see module doc)."""
    m, v = hidden.shape[0], weight.shape[0]
    rows = max(1, min(m, FLOOR_OUT_BYTES // (4 * v)))
    fp32_out = hidden.is_cuda and hidden.dtype != torch.float32 and "dtype" in torch.ops.aten.mm.overloads()
    out = torch.empty(rows, v, device=hidden.device, dtype=torch.float32 if fp32_out else hidden.dtype)

    def run():
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            if fp32_out:
                torch.mm(hidden[r0:r1], weight.T, out_dtype=torch.float32, out=out[: r1 - r0])
            else:
                torch.mm(hidden[r0:r1], weight.T, out=out[: r1 - r0])
        return None

    return run, "bf16/fp16 GEMM, fp32 accumulate and output" if fp32_out else f"{hidden.dtype} GEMM"


def make_inputs(m: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, device=device, dtype=dtype)
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(3.0 / h**0.5)
    labels = torch.randint(0, v, (m,), generator=g, device=device)
    return hidden, weight, labels


def measure(fn, device: torch.device, repeat: int, warmup: int):
    """(median seconds, min seconds, peak extra bytes, last output)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = None
    for _ in range(warmup):
        out = fn()
        sync()
    del out
    times, peak = [], 0
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            out = fn()
            sync()
            times.append(time.perf_counter() - t0)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        else:
            with RssPeak() as rss:
                t0 = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t0)
            peak = max(peak, rss.peak)
    return statistics.median(times), min(times), peak, out


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return ""


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    dtype = DTYPES[args.dtype]
    pinned = device.type == "cpu" and pin_mmap_threshold()
    rows = []
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "repeat": args.repeat,
        "warmup": args.warmup,
        "memory_method": "torch.cuda.max_memory_allocated - allocated before" if device.type == "cuda"
        else "peak sampled RSS (/proc/self/statm, 1 ms) - RSS before"
        + (", glibc mmap threshold pinned at 128 KiB" if pinned else ", mmap threshold NOT pinned: may read low"),
    }

    def save():  # after every row, so a run killed by a timeout keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    for size_name, (m, h, v) in args.sizes:
        note_m = ""
        if device.type == "cpu" and m * h * v > CPU_CAP_ABOVE and m > args.cpu_max_rows:
            note_m = f"M capped {m} -> {args.cpu_max_rows} on CPU (--cpu-max-rows)"
            m = args.cpu_max_rows
        hidden, weight, labels = make_inputs(m, h, v, dtype, device)
        baseline, floor_s = None, None
        jobs = [(b, None) for b in args.backends] + [(f"triton[{c}]", c) for c in args.triton_configs]
        for backend, config in jobs:
            row = {"size": size_name, "M": m, "H": h, "V": v, "dtype": args.dtype, "top_n": args.top_n,
                   "device": str(device), "backend": backend, "note": note_m}
            rows.append(row)
            reason = None
            if backend.startswith("triton") and device.type != "cuda" and not _interpreted():
                reason = "skipped: the Triton kernel runs on CUDA (on the CPU only under TRITON_INTERPRET=1)"
            elif backend == "reference":
                need = m * v * REFERENCE_BYTES_PER_LOGIT
                if need > 0.9 * free_bytes(device):
                    reason = f"skipped: needs ~{human(need)} for [M, V] logits and temporaries, " \
                             f"{human(free_bytes(device))} free"
            if reason:
                row["status"] = reason
                print(f"[{size_name}] {backend}: {reason}", file=sys.stderr)
                save()
                continue
            if backend == "floor":
                fn, row["note"] = floor_fn(hidden, weight)
            elif config is not None:
                from dflash_callbacks.kernels.triton_head_stats import triton_head_stats

                fn = lambda c=tile_config(config): triton_head_stats(hidden, weight, labels, args.top_n, config=c)  # noqa: E731
            else:
                fn = lambda b=backend: head_stats(hidden, weight, labels, args.top_n, backend=b,  # noqa: E731
                                                  chunk_size=args.chunk_size if b == "torch" else None)
            try:
                med, best, peak, out = measure(fn, device, args.repeat, args.warmup)
            except torch.cuda.OutOfMemoryError as e:  # the estimate was optimistic
                row["status"] = f"skipped: out of memory ({str(e).splitlines()[0]})"
                torch.cuda.empty_cache()
                save()
                continue
            row.update(status="ok", time_s=med, time_min_s=best, peak_extra_bytes=peak)
            if backend == "floor":
                floor_s = med
            elif floor_s:
                row["x_floor"] = med / floor_s
            if out is None:
                row["compared_to"] = "-"
            elif baseline is None:
                baseline = (backend, out)
                row["compared_to"] = "-"
            else:
                ref_name, ref = baseline
                row["compared_to"] = ref_name
                row["max_abs_diff_lse"] = float((out.lse - ref.lse).abs().max())
                row["max_abs_diff_top"] = float(
                    (out.top_logprobs - ref.top_logprobs).nan_to_num(0.0, 0.0, 0.0).abs().max()
                ) if args.top_n else 0.0
                row["rank_mismatches"] = int((out.label_rank != ref.label_rank).sum())
                row["order_mismatches"] = int((out.label_order != ref.label_order).sum())
            ratio = f", {row['x_floor']:.2f}x floor" if "x_floor" in row else ""
            print(f"[{size_name}] {backend}: {med:.4f} s{ratio}, peak extra {human(peak)}", file=sys.stderr)
            save()
            del out
        del hidden, weight, labels, baseline
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"meta": meta, "rows": rows}


def _interpreted() -> bool:
    try:
        from dflash_callbacks.kernels import triton_head_stats as th
    except ImportError:
        return False
    return th.is_interpreted()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def markdown(result: dict) -> str:
    lines = [
        f"device: {result['meta']['device']}, torch {result['meta']['torch']}, triton {result['meta']['triton']}; "
        f"median of {result['meta']['repeat']} after {result['meta']['warmup']} warm-up; "
        f"memory: {result['meta']['memory_method']}",
        "",
        "| size | M | H | V | dtype | top_n | backend | time (s) | x floor | peak extra memory | vs"
        " | max abs diff lse | rank / order mismatches | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ok = r["status"] == "ok"
        note = "; ".join(x for x in (r["note"], "" if ok else r["status"]) if x)
        lines.append(
            f"| {r['size']} | {r['M']} | {r['H']} | {r['V']} | {r['dtype']} | {r['top_n']} | {r['backend']} | "
            + (f"{r['time_s']:.4f} | " + (f"{r['x_floor']:.2f} | " if "x_floor" in r else "- | ")
               + f"{human(r['peak_extra_bytes'])} | {r['compared_to']} | " if ok else "- | - | - | - | ")
            + (f"{r['max_abs_diff_lse']:.2e} | {r['rank_mismatches']} / {r['order_mismatches']} | "
               if ok and "rank_mismatches" in r else "- | - | ")
            + f"{note} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("toy"),
                   help=f"comma list of {list(SIZES)} or MxHxV (default: toy)")
    p.add_argument("--top-n", type=int, default=8, help="top_n (DDTree budget), default 8")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per backend (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (Triton compiles on the first)")
    p.add_argument("--backends", type=lambda s: [b for b in s.split(",") if b], default=list(BACKENDS),
                   help="comma list of floor,reference,torch,triton (default: all; floor first gives x floor)")
    p.add_argument("--triton-configs", type=parse_configs, default=[],
                   help="also time the kernel with these tile configs, comma list of BMxBVxBHwWsS")
    p.add_argument("--chunk-size", type=int, default=None, help="vocabulary tile of the torch path")
    p.add_argument("--cpu-max-rows", type=int, default=256,
                   help="on CPU, cap on M for sizes above 1e12 multiply-adds, e.g. production (default 256)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (rewritten after each row)")
    args = p.parse_args(argv)
    for b in args.backends:
        if b not in BACKENDS:
            p.error(f"--backends: {b!r} is not one of {BACKENDS}")
    if args.repeat < 1 or args.warmup < 0 or args.top_n < 0 or args.cpu_max_rows < 1:
        p.error("--repeat >= 1, --warmup >= 0, --top-n >= 0, --cpu-max-rows >= 1")
    result = run(args)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
