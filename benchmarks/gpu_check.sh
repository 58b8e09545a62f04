#!/usr/bin/env bash
# GPU check of the fused LM-head statistics kernel (one CUDA device, a few minutes on
# an H200). Installs nothing. Runs tests/test_head_stats.py for real on CUDA (the
# CUDA variants run the Triton kernel natively and compare it with the reference;
# any CUDA test skipped counts as a failure), then benchmarks/bench_kernels.py at toy
# and production sizes.
#
# Usage: benchmarks/gpu_check.sh [OUTPUT_DIR]     (default: $OUT, else ./gpu-results)
# Writes into OUTPUT_DIR: env.txt, nvidia-smi.txt, pytest_head_stats.txt,
# pytest_head_stats.xml, bench_top8.{md,json}, bench_top64.{md,json}, summary.txt.
# Exit status: 0 when the tests passed and both benchmarks ran, else 1.
set -euo pipefail

out_dir="${1:-${OUT:-./gpu-results}}"
mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"

status=0
summary="$out_dir/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi > "$out_dir/nvidia-smi.txt" 2>&1 || note "nvidia-smi failed (see nvidia-smi.txt)"
python - > "$out_dir/env.txt" 2>&1 <<'PY' || { note "FAIL: no usable CUDA device (see env.txt)"; exit 1; }
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton MISSING")
    raise
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PY
cat "$out_dir/env.txt"

# 1. tests, CUDA variants included (Triton compiles each configuration once)
t0=$SECONDS
rc=0
timeout 330 python -m pytest tests/test_head_stats.py -q -rs -p no:cacheprovider \
    --junitxml="$out_dir/pytest_head_stats.xml" > "$out_dir/pytest_head_stats.txt" 2>&1 || rc=$?
tail -n 25 "$out_dir/pytest_head_stats.txt"
if [[ $rc -ne 0 ]]; then
    note "FAIL: pytest tests/test_head_stats.py exited $rc (124: timed out)"
    status=1
elif grep -q "needs triton and a CUDA device" "$out_dir/pytest_head_stats.txt"; then
    note "FAIL: CUDA tests were skipped"
    status=1
else
    note "ok: tests/test_head_stats.py passed on CUDA in $((SECONDS - t0)) s"
fi

# 2. benchmarks: toy, production H/V with 4096 rows (reference fits), full production
bench() {
    local name="$1" limit="$2"
    shift 2
    local t1=$SECONDS rc=0
    timeout "$limit" python benchmarks/bench_kernels.py --device cuda --json "$out_dir/$name.json" "$@" \
        > "$out_dir/$name.md" 2> "$out_dir/$name.log" || rc=$?
    cat "$out_dir/$name.md"
    if [[ $rc -ne 0 ]]; then
        note "FAIL: bench $name exited $rc (124: timed out; see $name.log)"
        status=1
    else
        note "ok: bench $name in $((SECONDS - t1)) s"
    fi
}
bench bench_top8 150 --sizes toy,production-4k-rows,production --top-n 8 --repeat 2 --warmup 1
bench bench_top64 90 --sizes toy,production --top-n 64 --repeat 2 --warmup 1 --backends triton,torch

note "gpu_check finished with status $status; results in $out_dir"
exit "$status"
