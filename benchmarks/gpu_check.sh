#!/usr/bin/env bash
# GPU check of the scoring kernels and of the training-thread stall (one CUDA device;
# at most about 9 minutes on an H200 after the machine has started). Installs nothing; imports neither wandb nor
# omegaconf. Steps, each under its own `timeout`, each writing its files into
# OUTPUT_DIR as it finishes (a killed run keeps the finished steps' files):
#
#   1. tests      (100 s) tests/unit/test_head_stats.py (and the tempered statistics'
#                 tests/unit/test_head_stats_tempered.py) natively on CUDA: both backends
#                 against the reference on every case, realistic sizes, the kernel's
#                 pivot == its own z_y on tensor cores, fp32 under TF32, auto follows
#                 its table (a skipped CUDA test counts as a failure); the Triton
#                 interpreter and sm_90 compile checks run too.
#   2. kernels    (70 s)  bench_kernels.py at one task's rows (7,665) and the whole
#                 production set (76,800) x H 5120 x V 248,320, bf16, top-8: GEMM
#                 floor, reference (one task only: it needs ~30 GB), torch, triton;
#                 time over the floor, rank/order mismatches against the reference.
#   3. production (75 s)  bench_production.py --size production: end-to-end scoring
#                 of 10 synthetic tasks with each backend against the floor (drafter
#                 forwards + bare GEMM), peak memory, whether the reports agree.
#   4. sweep      (30 s)  bench_kernels.py at one task's rows, the kernel with its
#                 default and four other tile configs (for TILE_CONFIGS), one timed
#                 run each after the compiling one.
#   4b. tempered  (30 s)  bench_tempered.py at one task's rows, bf16: the extra cost of the tempered
#                 statistics a sampled draft is scored by (DFlash's probabilistic draft rule) over
#                 greedy scoring's head_stats, both on the torch path.
#   5. stall      (75 s)  bench_stall.py --size production: a 1.78 B drafter training
#                 (bf16-true, AdamW) with and without the callbacks, a snapshot every
#                 10 steps scored on the same GPU: step times, the stall per snapshot,
#                 training time lost against the scorer's seconds, the scorer's peak memory.
#   6. profile    (150 s) bench_profile.py --size production: the costs of one speculative round at the
#                 production shape (a random target of 64 Qwen3 decoder layers at H 5120, V 248,320;
#                 a random 1.78 B DFlash drafter, block 16 and 8), bf16: the target's forward of 1 to 33
#                 tokens after 512, 2048 and 8192, the drafter's round, the bookkeeping; the costs JSON
#                 and the predicted speed-up per token of tau of each method.
#
# The limits add up to 530 s plus a few seconds of setup. Not yet run on a GPU: the
# limits are the budget, sized from estimates (see each script), not measurements.
#
# Usage: benchmarks/gpu_check.sh [OUTPUT_DIR]     (default: $OUT, else ./gpu-results)
# Writes: env.txt, nvidia-smi.txt, pytest_head_stats.{txt,xml}, kernels.{md,json,log},
# production.{md,json,log}, sweep.{md,json,log}, tempered.{md,json,log}, stall.{md,json,log},
# profile.{md,log}, costs.json, summary.txt.
# Exit status 0 when every step passed.
#
# GPU_CHECK_CPU_SMOKE=1 runs the same plumbing on the CPU at toy sizes (a missing GPU
# and skipped CUDA tests are then not failures), to check the script itself.
set -euo pipefail

out_dir="${1:-${OUT:-./gpu-results}}"
mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
smoke="${GPU_CHECK_CPU_SMOKE:-0}"
started=$SECONDS

status=0
summary="$out_dir/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi > "$out_dir/nvidia-smi.txt" 2>&1 || note "nvidia-smi failed (see nvidia-smi.txt)"
if ! python - "$smoke" > "$out_dir/env.txt" 2>&1 <<'PY'
import platform, sys, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton MISSING")
    raise
if sys.argv[1] != "1":
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PY
then
    cat "$out_dir/env.txt"
    note "FAIL: no usable CUDA device or triton (see env.txt)"
    exit 1
fi
cat "$out_dir/env.txt"

# step NAME LIMIT CMD...: runs CMD under `timeout LIMIT`, stdout to NAME.md, stderr to NAME.log
step() {
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS rc=0
    timeout "$limit" "$@" > "$out_dir/$name.md" 2> "$out_dir/$name.log" || rc=$?
    if [[ $rc -ne 0 ]]; then
        note "FAIL: $name exited $rc after $((SECONDS - t0)) s (124: timed out at $limit s; see $name.log)"
        status=1
    else
        note "ok: $name in $((SECONDS - t0)) s"
    fi
    return 0
}

# 1. tests
if [[ $smoke == 1 ]]; then
    tests_k=(-k "merge or split_plan or auto")  # the plumbing only: no CUDA here
    device=cpu kernel_sizes=tiny production_size=toy sweep_sizes=tiny stall_size=toy profile_size=toy
else
    tests_k=()
    device=cuda kernel_sizes=production-task,production production_size=production sweep_sizes=production-task
    stall_size=production profile_size=production
fi
t0=$SECONDS
rc=0
timeout 100 python -m pytest tests/unit/test_head_stats.py tests/unit/test_head_stats_tempered.py -q -rs -p no:cacheprovider \
    ${tests_k[@]+"${tests_k[@]}"} \
    --junitxml="$out_dir/pytest_head_stats.xml" > "$out_dir/pytest_head_stats.txt" 2>&1 || rc=$?
tail -n 15 "$out_dir/pytest_head_stats.txt"
if [[ $rc -ne 0 ]]; then
    note "FAIL: tests exited $rc after $((SECONDS - t0)) s (124: timed out at 100 s)"
    status=1
elif [[ $smoke != 1 ]] && grep -qE "needs (triton and )?a CUDA device" "$out_dir/pytest_head_stats.txt"; then
    note "FAIL: CUDA tests were skipped"
    status=1
else
    note "ok: tests in $((SECONDS - t0)) s ($(tail -n 1 "$out_dir/pytest_head_stats.txt"))"
fi

# 2.-4. benchmarks
step kernels 70 python benchmarks/bench_kernels.py --device "$device" --sizes "$kernel_sizes" --top-n 8 \
    --repeat 2 --warmup 1 --backends floor,reference,torch,triton --json "$out_dir/kernels.json"
step production 75 python benchmarks/bench_production.py --size "$production_size" --device "$device" \
    --backends torch,triton --json "$out_dir/production.json"
step sweep 30 python benchmarks/bench_kernels.py --device "$device" --sizes "$sweep_sizes" --top-n 8 \
    --repeat 1 --warmup 1 --backends floor,triton \
    --triton-configs 128x128x64w8s4,64x128x64w8s4,64x64x64w4s3,128x128x128w8s2 --json "$out_dir/sweep.json"
step tempered 30 python benchmarks/bench_tempered.py --device "$device" --sizes "$sweep_sizes" --dtype bf16 \
    --repeat 2 --warmup 1 --json "$out_dir/tempered.json"
step stall 75 python benchmarks/bench_stall.py --size "$stall_size" --device "$device" --work "$out_dir/stall-world" \
    --json "$out_dir/stall.json"
rm -rf "$out_dir/stall-world"  # the synthetic target and cache (5 GB at production size)
step profile 150 python benchmarks/bench_profile.py --size "$profile_size" --device "$device" \
    --json "$out_dir/costs.json"

# summary: the headline numbers of every JSON that exists
python - "$out_dir" <<'PY' | tee -a "$summary" || true
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
for name in ("kernels", "sweep"):
    f = out / f"{name}.json"
    if not f.is_file():
        print(f"{name}: no results")
        continue
    for r in json.loads(f.read_text())["rows"]:
        if r.get("status") != "ok":
            print(f"{name} {r['size']} {r['backend']}: {r.get('status', 'unfinished')}")
            continue
        extra = f", {r['x_floor']:.2f}x floor" if "x_floor" in r else ""
        if "rank_mismatches" in r:
            extra += f", rank/order mismatches vs {r['compared_to']}: {r['rank_mismatches']}/{r['order_mismatches']}"
        print(f"{name} {r['size']} (M={r['M']}) {r['backend']}: {r['time_s']:.4f} s{extra}")
f = out / "production.json"
if f.is_file():
    result = json.loads(f.read_text())
    floor = result.get("floor")
    if floor:
        print(f"production floor: {floor['seconds']:.3f} s (GEMM {floor['gemm_s']:.3f} s)")
    else:
        print(f"production: built in {result['meta']['build_s']:.1f} s, no floor measured")
    for r in result["runs"]:
        if r["status"] != "ok":
            print(f"production {r['backend']}: {r['status']}")
            continue
        same = "" if r["agrees_with"] == "-" else f", report identical to {r['agrees_with']}'s: {r['identical_report']}"
        peak = f", peak {r['peak_gpu_bytes'] / 2**30:.1f} GiB" if r["peak_gpu_bytes"] else ""
        print(f"production {r['backend']}: {r['seconds']:.3f} s, {r['x_floor']:.2f}x floor{peak}{same}")
else:
    print("production: no results")
f = out / "tempered.json"
if f.is_file():
    for r in json.loads(f.read_text())["rows"]:
        print(f"tempered {r['size']} (M={r['M']}, {r['dtype']}): head_stats {r['greedy_s']:.4f} s, tempered "
              f"{r['tempered_s']:.4f} s ({100 * r['extra']:+.0f}%)")
else:
    print("tempered: no results")
f = out / "stall.json"
if f.is_file():
    r = json.loads(f.read_text())
    print(f"stall {r['size']}: steps/s {r['steps_per_s']['without']:.2f} without, {r['steps_per_s']['with']:.2f} with; "
          f"stall per snapshot max {r['stall_ms_per_snapshot']['max']:.2f} ms (first {r['stall_ms_per_snapshot']['first']}); "
          f"training lost {r['training_s_lost']:.2f} s vs scorer {r['scorer_s']:.2f} s; "
          f"scorer peak {r['scorer_peak_memory_gib']} GiB")
else:
    print("stall: no results")
f = out / "profile.md"
if f.is_file() and (out / "costs.json").is_file():
    print("profile: " + next((line for line in f.read_text().splitlines() if line.startswith(("cpu", "NVIDIA"))),
                             "see profile.md"))
else:
    print("profile: no results")
PY

note "gpu_check finished with status $status in $((SECONDS - started)) s; results in $out_dir"
exit "$status"
