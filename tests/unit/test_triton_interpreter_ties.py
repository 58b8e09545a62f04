"""The Triton head-stats kernel in Triton's CPU interpreter: a weight row gives bitwise the same
logit wherever it sits in a tile, so a weight matrix of one row repeated ties every token with the
label (the kernel's design claim, which np.matmul's fp32 sums broke there; see the module doc of
`kernels/triton_head_stats.py`). Run in a subprocess started with TRITON_INTERPRET=1 (interpreter
mode is fixed when triton is first imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys, torch
from dflash_callbacks.kernels import triton_head_stats as th
assert th.is_interpreted()
g = torch.Generator().manual_seed(0)
results = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    m, h, v = 20, 40, 300
    hidden = torch.randn(m, h, generator=g).to(dtype)
    weight = (torch.randn(1, h, generator=g) * 0.5).expand(v, h).contiguous().to(dtype)  # one row, everywhere
    labels = torch.randint(0, v, (m,), generator=g)
    labels[0], labels[1] = v - 1, 0
    for splits in (1, 3):  # the default tiles (fp32: 64 x 32 x 128, 16-bit: 128 x 64 x 128)
        parts, width = th.triton_head_partials(hidden, weight, labels, 8, num_splits=splits)
        results[str(dtype), splits] = (labels, tuple(parts), width)
torch.save(results, sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_repeated_weight_row_ties_every_token_with_the_label(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "out.pt")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(tmp_path / "out.pt")
    assert len(results) == 6
    for (dtype, splits), (labels, parts, width) in results.items():
        peak, total, label_logit, n_greater, n_tied_below, top, pivot = parts
        where = (dtype, splits)
        holder = labels // width  # the split whose tiles hold y
        rows = torch.arange(len(labels))
        z_y = pivot[0]
        assert torch.equal(pivot, z_y.expand_as(pivot)), where  # every split computes the same pivot
        assert torch.equal(label_logit[holder, rows], z_y), where  # bitwise the tile's own z_y
        assert torch.equal(n_greater.sum(0), torch.zeros_like(labels, dtype=torch.int32)), where
        assert torch.equal(n_tied_below.sum(0), labels.int()), where  # every token below y tied with it
        assert torch.equal(peak, z_y.expand_as(peak)), where  # no logit of any tile differs from z_y
        assert torch.equal(top[:, :, 0], z_y.expand_as(peak)), where
