"""Every benchmark runs, at its smallest size, so none can rot between the sessions that read its numbers.

Each `benchmarks/*.py` is run as a user runs it (a subprocess, from a scratch folder) with the arguments
below; a new script without an entry here fails `test_every_benchmark_has_a_smallest_size`. Only that a
benchmark finishes and prints its table is checked: its figures are measured on other machines, at
other sizes (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SMALLEST = {
    "bench_bootstrap.py": ["--repeats", "1"],
    "bench_intervals.py": ["--part", "coverage", "task", "continuity", "stop", "--reps", "8", "--runs", "1",
                           "--reports", "2", "--stop-models", "1"],
    "bench_kernels.py": ["--sizes", "64x32x512", "--repeat", "1", "--warmup", "0"],
    "bench_profile.py": ["--smallest"],
    "bench_production.py": ["--dtype", "float32", "--backends", "torch"],
    "bench_scoring.py": ["--tasks", "1", "--repeats", "1", "--vocab", "1000"],
    "bench_served_tau.py": ["--temperatures", "0.7", "--runs", "1", "--samples", "1", "--max-new-tokens", "16",
                            "--out", "served-tau"],
    "bench_speedup.py": ["--smallest"],
    "bench_stall.py": ["--steps", "4", "--every", "2"],
    "bench_trackers.py": ["--reports", "2"],
    "bench_tempered.py": ["--sizes", "64x32x512", "--repeat", "1", "--warmup", "0"],
}
"""Each benchmark's smallest size: the arguments that make it run in seconds on the CPU."""


def test_every_benchmark_has_a_smallest_size():
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert sorted(SMALLEST) == scripts, "give each benchmark its smallest size here (and drop the gone ones)"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_the_benchmark_runs_at_its_smallest_size(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *SMALLEST[script]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{script} printed nothing"
