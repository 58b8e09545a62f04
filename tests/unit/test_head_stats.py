"""head_stats: the chunked torch path and the split-V Triton kernel against the
materialised reference, on odd shapes, exact ties, duplicate weight rows, every dtype,
and both sides of the kernel's top-N limit; the split merge on its own, against
partials built from materialised logits; the split plan and the `auto` table.

How the Triton kernel runs here:
- CPU (CI): in Triton's interpreter, in a subprocess started with TRITON_INTERPRET=1.
  Interpreter mode is fixed when a `@triton.jit` function is decorated (triton reads
  the variable then), including triton's own library functions decorated on
  `import triton`. In a shared pytest session any earlier test, plugin or library
  may already have imported triton, so toggling the variable in-process would make
  these tests depend on test order; a fresh process with the variable set is
  deterministic. The subprocess computes every case once (also the kernel's raw
  per-split partials for some); the comparisons run here, one test per case.
- A second subprocess, with TRITON_INTERPRET unset, checks the CPU error message and
  compiles the kernel ahead of time for sm_90 (no GPU needed), so the compiled code
  path (not only the interpreter) is exercised in CI.
- CUDA (when available): natively, in-process.
Triton tests are skipped only when triton is not installed (CUDA ones: no CUDA).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_callbacks.kernels.head_stats import (
    AUTO_TABLE,
    BACKENDS,
    HeadStats,
    auto_backend,
    head_stats,
    head_stats_reference,
    head_stats_torch,
)
from dflash_callbacks.kernels.split_merge import SplitPartials, merge_splits
from largest_tensor import LargestTensor
from suite_paths import REPO

hs = importlib.import_module("dflash_callbacks.kernels.head_stats")  # the module (the package exports the function)
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
KERNEL_LIMIT = 64  # triton_head_stats.MAX_KERNEL_TOP_N, without importing triton here


# ---------------------------------------------------------------- cases

# name: (M, H, V, top_n, dtype, kind, chunk_size)
# kind "int": entries in {-2..2}, so every logit is an exact small integer (exact in
# every dtype and in fp32 accumulation) and ties are everywhere; ranks must match
# exactly. kind "rand": Gaussian, logits of order 3. kind "dup": Gaussian, and the
# first rows' labels have duplicate weight rows below and above them, so z_y (not an
# exact number) is tied exactly with other tokens in any column-uniform GEMM.
CASES = {
    "int-fp32-V-odd": (37, 24, 301, 5, torch.float32, "int", None),
    "int-bf16": (19, 16, 200, 8, torch.bfloat16, "int", 64),
    "int-fp16": (19, 16, 130, 3, torch.float16, "int", None),
    "rand-fp32": (33, 40, 517, 16, torch.float32, "rand", None),
    "rand-bf16": (21, 32, 300, 7, torch.bfloat16, "rand", 32),
    "rand-fp16-N1": (17, 32, 259, 1, torch.float16, "rand", None),
    "M1": (1, 16, 77, 4, torch.float32, "int", None),
    "N0": (9, 16, 100, 0, torch.bfloat16, "rand", None),
    "V1": (5, 8, 1, 2, torch.float32, "rand", None),
    "N-gt-tile": (11, 16, 300, 40, torch.float32, "rand", 16),
    "N-gt-V": (7, 16, 20, 33, torch.float32, "int", None),
    "N-at-kernel-limit": (13, 16, 150, KERNEL_LIMIT, torch.bfloat16, "int", None),
    "N-above-kernel-limit": (13, 16, 150, KERNEL_LIMIT + 1, torch.bfloat16, "int", None),
    "N1024": (5, 16, 1500, 1024, torch.float32, "rand", 256),
    "rows-3-blocks-strided": (150, 24, 140, 8, torch.float32, "rand", None),
    "dup-fp32": (20, 40, 300, 8, torch.float32, "dup", None),
    "dup-bf16": (20, 48, 260, 4, torch.bfloat16, "dup", 64),
}


def make_case(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int | None]:
    """Deterministic inputs: (hidden, weight, labels, top_n, chunk_size)."""
    m, h, v, top_n, dtype, kind, chunk = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if kind == "int":
        hidden = torch.randint(-2, 3, (m, h), generator=g).float()
        weight = torch.randint(-2, 3, (v, h), generator=g).float()
    else:
        hidden = torch.randn(m, h, generator=g)
        weight = torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if "strided" in name:  # non-contiguous views: row strides differ from H
        hidden = torch.cat([hidden, hidden[:, :5]], dim=1)[:, :h]
        weight = torch.cat([weight, weight[:, :3]], dim=1)[:, :h]
        assert not hidden.is_contiguous() and not weight.is_contiguous()
    labels = torch.randint(0, v, (m,), generator=g)
    labels[0] = v - 1  # the label at the last id, and (M > 1) at id 0
    if m > 1:
        labels[1] = 0
    if kind == "int" and m > 2:  # labels at an argmax: vanilla's order-0 case, with ties
        z = hidden.float() @ weight.float().T
        labels[2] = int(z[2].argmax())
    if kind == "dup":  # rows 2..5: copies of the label's weight row at ids below and above it
        for row, copies in ((2, (3, 150, 259)), (3, (4,)), (4, (160, 161)), (5, (5, 258))):
            labels[row] = 149 + row
            weight[list(copies)] = weight[149 + row].clone()
        labels[6] = int((hidden[6].float() @ weight.float().T).argmax())  # the argmax, then tied below
        weight[0] = weight[labels[6]].clone()
    return hidden, weight, labels, top_n, chunk


def exact_logits(name: str) -> bool:
    return CASES[name][5] == "int"


def exact_ties(name: str) -> bool:
    """Ranks the Triton kernel must match exactly: exact logits, or duplicate rows
    (its pivot is its own z_y, so duplicates are exact ties, as in the reference)."""
    return CASES[name][5] in ("int", "dup")


def test_duplicate_rows_tie_in_the_reference():
    """The "dup" cases rely on the reference's logits tying duplicates exactly."""
    for name in ("dup-fp32", "dup-bf16"):
        hidden, weight, labels, top_n, _ = make_case(name)
        z = hidden.float() @ weight.float().T
        ref = head_stats_reference(hidden, weight, labels, top_n)
        for row in range(2, 7):
            ties = (z[row] == z[row, labels[row]]).sum() - 1
            assert ties >= 1, (name, row)
            assert ref.label_order[row] - ref.label_rank[row] == (z[row, : labels[row]] == z[row, labels[row]]).sum()
        assert ref.label_rank[6] == 0 and ref.label_order[6] == 1  # argmax, tied with id 0


# ---------------------------------------------------------------- comparison


def assert_contract(out: HeadStats, m: int, top_n: int) -> None:
    assert isinstance(out, HeadStats)
    for t, dtype, shape in zip(
        out,
        (torch.float32, torch.float32, torch.int64, torch.int64, torch.float32),
        ((m,), (m,), (m,), (m,), (m, top_n)),
    ):
        assert t.dtype == dtype and tuple(t.shape) == shape, (t.dtype, tuple(t.shape), dtype, shape)


def assert_matches(out: HeadStats, hidden, weight, labels, top_n: int, exact: bool) -> None:
    """`out` against the reference on the same inputs, with the tolerances the
    contract states; also checks the consistency properties every backend keeps."""
    ref = HeadStats(*(t.cpu() for t in head_stats_reference(hidden, weight, labels, top_n)))
    out = HeadStats(*(t.cpu() for t in out))
    m = hidden.shape[0]
    assert_contract(out, m, top_n)
    atol = 1e-5
    torch.testing.assert_close(out.lse, ref.lse, rtol=1e-6, atol=atol)
    torch.testing.assert_close(out.label_logprob, ref.label_logprob, rtol=1e-6, atol=atol)
    assert torch.equal(torch.isinf(out.top_logprobs), torch.isinf(ref.top_logprobs))
    finite = torch.isfinite(ref.top_logprobs)
    torch.testing.assert_close(out.top_logprobs[finite], ref.top_logprobs[finite], rtol=1e-6, atol=atol)
    if exact:
        assert torch.equal(out.label_rank, ref.label_rank)
        assert torch.equal(out.label_order, ref.label_order)
    else:  # a token within rounding of z_y may land on either side, nothing else
        z = hidden.float() @ weight.float().T
        z_y = z.gather(1, labels[:, None])
        band = (((z - z_y).abs() <= 1e-5 * (1 + z_y.abs())).sum(-1) - 1).cpu()
        assert ((out.label_rank - ref.label_rank).abs() <= band).all()
        assert ((out.label_order - ref.label_order).abs() <= band).all()
    assert (out.label_order >= out.label_rank).all()
    assert (out.label_logprob <= 1e-6).all()
    if top_n > 0:  # the label's log-prob and the top list come from the same logit
        argmax = out.label_rank == 0
        assert torch.equal(out.label_logprob[argmax], out.top_logprobs[argmax, 0])
        k = min(top_n, weight.shape[0])
        assert (out.top_logprobs[:, : k - 1] >= out.top_logprobs[:, 1:k]).all()


# ---------------------------------------------------------------- reference and torch path


def test_reference_on_a_hand_made_example():
    # logits z = hidden @ weight.T = [[1, 3, 3, 0]] for a 1-d hidden
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[1.0], [3.0], [3.0], [0.0]])
    lse = math.log(math.e + 2 * math.e**3 + 1)
    for y, rank, order in ((0, 2, 2), (1, 0, 0), (2, 0, 1), (3, 3, 3)):
        out = head_stats(hidden, weight, torch.tensor([y]), 6, backend="reference")
        assert out.label_rank.item() == rank and out.label_order.item() == order
        assert out.lse.item() == pytest.approx(lse, rel=1e-6)
        assert out.label_logprob.item() == pytest.approx(weight[y, 0].item() - lse, rel=1e-6)
        expect = [3 - lse, 3 - lse, 1 - lse, -lse, -math.inf, -math.inf]
        assert out.top_logprobs[0].tolist() == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_matches_reference(name):
    hidden, weight, labels, top_n, chunk = make_case(name)
    out = head_stats(hidden, weight, labels, top_n, backend="torch", chunk_size=chunk)
    assert_matches(out, hidden, weight, labels, top_n, exact_logits(name))


@pytest.mark.parametrize("name", ["dup-fp32", "dup-bf16"])
def test_torch_path_with_one_tile_ties_duplicates_exactly(name):
    """A vocabulary in one tile: the rank pivot is the tile's own z_y (no second GEMM),
    so a duplicate of the label's weight row is an exact tie, as in the reference."""
    hidden, weight, labels, top_n, _ = make_case(name)
    out = head_stats(hidden, weight, labels, top_n, backend="torch", chunk_size=weight.shape[0])
    assert_matches(out, hidden, weight, labels, top_n, exact=True)


@pytest.mark.parametrize("chunk_size, row_chunk_size", [(1, 19), (7, 1), (64, 10), (10_000, 10_000)])
def test_torch_path_tile_sizes(chunk_size, row_chunk_size):
    for name in ("int-fp32-V-odd", "rand-bf16"):
        hidden, weight, labels, top_n, _ = make_case(name)
        out = head_stats_torch(
            hidden, weight, labels, top_n, chunk_size=chunk_size, row_chunk_size=row_chunk_size
        )
        assert_matches(out, hidden, weight, labels, top_n, exact_logits(name))


def test_auto_on_cpu_is_the_torch_path():
    hidden, weight, labels, top_n, chunk = make_case("rand-fp32")
    auto = head_stats(hidden, weight, labels, top_n, chunk_size=chunk)
    torch_path = head_stats(hidden, weight, labels, top_n, backend="torch", chunk_size=chunk)
    for a, b in zip(auto, torch_path):
        assert torch.equal(a, b)


def test_auto_table_names_its_evidence():
    for kind, regimes in AUTO_TABLE.items():
        lows = [low for low, _, _ in regimes]
        assert lows[0] == 0 and lows == sorted(lows), kind
        for _, backend, evidence in regimes:
            assert backend in ("torch", "triton") and len(evidence) > 20, (kind, backend, evidence)
    assert auto_backend("cpu", 4096, 256, 32768) == "torch"
    # on CUDA the split-V kernel is unmeasured: the cuBLAS torch path at every size,
    # the old 64-anchor chunk (960 rows), one task (7,665 rows), the whole production set
    for m in (960, 7665, 76_800):
        assert auto_backend(torch.device("cuda"), m, 5120, 248_320) == "torch"
    assert auto_backend("meta", 1, 1, 1) == "torch"  # a device kind not in the table


def test_auto_dispatches_by_the_table_and_the_size(monkeypatch):
    hidden, weight, labels, top_n, _ = make_case("rand-fp32")  # M*H*V = 33 * 40 * 517
    monkeypatch.setitem(AUTO_TABLE, "cpu", ((0, "torch", "test: small"), (33 * 40 * 517, "reference", "test: big")))
    assert auto_backend("cpu", 33, 40, 517) == "reference" and auto_backend("cpu", 32, 40, 517) == "torch"
    expected = {"reference": head_stats_reference(hidden, weight, labels, top_n),
                "torch": head_stats_torch(hidden[:32], weight, labels[:32], top_n)}
    for backend, (h, y) in (("reference", (hidden, labels)), ("torch", (hidden[:32], labels[:32]))):
        for a, b in zip(head_stats(h, weight, y, top_n), expected[backend]):
            assert torch.equal(a, b), backend


def test_fp32_gemm_ignores_reduced_precision_settings():
    """A process that lets fp32 matmuls round their inputs (TF32 on CUDA, bf16 in
    oneDNN) does not change the contract: the fp32 GEMMs then run in fp64."""
    hidden, weight, labels, top_n, chunk = make_case("rand-fp32")
    before = head_stats(hidden, weight, labels, top_n, backend="torch", chunk_size=chunk)
    precision = torch.get_float32_matmul_precision()
    assert hs._fp32_matmul_is_ieee(torch.device("cpu")) and hs._fp32_matmul_is_ieee(torch.device("cuda"))
    try:
        torch.set_float32_matmul_precision("medium")  # legacy API only: never mixed with the new one
        assert not hs._fp32_matmul_is_ieee(torch.device("cpu"))
        assert not hs._fp32_matmul_is_ieee(torch.device("cuda"))
        for backend in ("torch", "reference"):
            out = head_stats(hidden, weight, labels, top_n, backend=backend, chunk_size=chunk)
            assert_matches(out, hidden, weight, labels, top_n, exact=False)
            torch.testing.assert_close(out.top_logprobs, before.top_logprobs, rtol=1e-6, atol=1e-5)
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = True
        assert not hs._fp32_matmul_is_ieee(torch.device("cuda"))
        assert hs._fp32_matmul_is_ieee(torch.device("cpu"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision(precision)
    assert hs._fp32_matmul_is_ieee(torch.device("cuda"))


def test_empty_rows():
    weight = torch.randn(10, 4)
    out = head_stats(torch.empty(0, 4), weight, torch.empty(0, dtype=torch.long), 3, backend="torch")
    assert_contract(out, 0, 3)


def test_torch_path_never_materialises_the_logits():
    m, h, v = 300, 8, 2000
    hidden, weight = torch.randn(m, h), torch.randn(v, h)
    labels = torch.randint(0, v, (m,))
    with LargestTensor() as ref_probe:
        head_stats(hidden, weight, labels, 4, backend="reference")
    assert ref_probe.largest >= m * v  # the probe sees the reference's logits
    with LargestTensor() as probe:
        out = head_stats_torch(hidden, weight, labels, 4, chunk_size=128, row_chunk_size=50)
    assert probe.largest <= max(50 * (128 + 4), m * h, v * h), probe.largest
    assert_matches(out, hidden, weight, labels, 4, exact=False)


# ---------------------------------------------------------------- validation


def _good():
    return torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 2, 9])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h, w, y: (h, w, y, 2, {"backend": "cuda"}), "backend must be one of"),
        (lambda h, w, y: (h[0], w, y, 2, {}), r"hidden must be \[M, H\]"),
        (lambda h, w, y: (h, w[:, :5], y, 2, {}), "disagree on H"),
        (lambda h, w, y: (h, w.double(), y, 2, {}), "share one dtype"),
        (lambda h, w, y: (h.double(), w.double(), y, 2, {}), "share one dtype"),
        (lambda h, w, y: (h, w, y[:3], 2, {}), "labels must be"),
        (lambda h, w, y: (h, w, y.float(), 2, {}), "labels must be torch.int64"),
        (lambda h, w, y: (h, w, y + 1, 2, {}), r"labels must lie in \[0, V\)"),
        (lambda h, w, y: (h, w, y - 1, 2, {}), r"labels must lie in \[0, V\)"),
        (lambda h, w, y: (h, w, y, -1, {}), "top_n must be an integer >= 0"),
        (lambda h, w, y: (h, w, y, 2.0, {}), "top_n must be an integer >= 0"),
        (lambda h, w, y: (h, w, y, True, {}), "top_n must be an integer >= 0"),
        (lambda h, w, y: (h, w, y, 2, {"chunk_size": 0}), "chunk_size must be None or an integer >= 1"),
        (lambda h, w, y: (h, w[:0], y[:0] * 0, 2, {}), "V >= 1"),
    ],
)
def test_validation(change, message):
    hidden, weight, labels, top_n, kwargs = change(*_good())
    with pytest.raises(ValueError, match=message):
        head_stats(hidden, weight, labels, top_n, **kwargs)


def test_backend_error_lists_the_legal_values():
    with pytest.raises(ValueError) as info:
        head_stats(*_good(), 2, backend="fast")
    for name in BACKENDS:
        assert repr(name) in str(info.value)


def test_row_chunk_size_is_validated():
    with pytest.raises(ValueError, match="row_chunk_size"):
        head_stats_torch(*_good(), 2, row_chunk_size=0)


# ---------------------------------------------------------------- split merge


def reference_partials(hidden, weight, labels, top_n: int, split_width: int) -> SplitPartials:
    """`split_merge.SplitPartials` from the materialised fp32 logits (pivot = z_y)."""
    z = hidden.float() @ weight.float().T
    m, v = z.shape
    z_y = z.gather(1, labels[:, None])
    column = torch.arange(v)
    parts = []
    for c0 in range(0, v, split_width):
        zs, cs = z[:, c0 : c0 + split_width], column[c0 : c0 + split_width]
        peak = zs.amax(1)
        holds = (labels >= c0) & (labels < c0 + split_width)
        top = torch.full((m, top_n), float("-inf"))
        k = min(top_n, zs.shape[1])
        top[:, :k] = zs.topk(k, dim=1).values.flip(1)  # any order will do
        parts.append((
            peak, (zs - peak[:, None]).exp().sum(1), torch.where(holds, z_y[:, 0], 0.0),
            ((zs > z_y) & (cs[None] != labels[:, None])).sum(1).int(),
            ((zs == z_y) & (cs[None] < labels[:, None])).sum(1).int(), top, z_y[:, 0],
        ))
    return SplitPartials(*(torch.stack(t) for t in zip(*parts)))


def test_merge_on_a_hand_made_example():
    # logits [[1, 3, 3, 0, 3, 2]] in splits of 4: [1, 3, 3, 0] and [3, 2]; the value 3
    # sits in both splits, the top-3 is spread over both, top_n 8 > V
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[1.0], [3.0], [3.0], [0.0], [3.0], [2.0]])
    lse = math.log(math.e + 3 * math.e**3 + 1 + math.e**2)
    for y, rank, order in ((0, 4, 4), (1, 0, 0), (2, 0, 1), (4, 0, 2), (5, 3, 3), (3, 5, 5)):
        labels = torch.tensor([y])
        parts = reference_partials(hidden, weight, labels, 8, 4)
        if y == 4:  # the label in split 1, tied with ids 1 and 2 of split 0
            assert parts.n_tied_below[:, 0].tolist() == [2, 0] and parts.n_greater[:, 0].tolist() == [0, 0]
            assert parts.label_logit[:, 0].tolist() == [0.0, 3.0] and parts.max[:, 0].tolist() == [3.0, 3.0]
        out = merge_splits(parts, labels, 4, 8)
        assert (out.label_rank.item(), out.label_order.item()) == (rank, order), y
        assert out.lse.item() == pytest.approx(lse, rel=1e-6)
        assert out.label_logprob.item() == pytest.approx(weight[y, 0].item() - lse, rel=1e-6)
        expect = [3 - lse, 3 - lse, 3 - lse, 2 - lse, 1 - lse, -lse, -math.inf, -math.inf]
        assert out.top_logprobs[0].tolist() == pytest.approx(expect, rel=1e-6)


_MERGE_CASES = ("int-fp32-V-odd", "int-bf16", "rand-fp32", "N-gt-V", "V1", "dup-fp32", "N-at-kernel-limit")


@pytest.mark.parametrize("name", _MERGE_CASES)
@pytest.mark.parametrize("width", ["1", "7", "V-1", "V", "2V"])  # columns per split
def test_merge_matches_reference(name, width):
    """One split (V, 2V), two with a one-column tail (V-1), many (7), one column each
    (1): the merge of exact partials is exact (ranks from the same logits)."""
    hidden, weight, labels, top_n, _ = make_case(name)
    v = weight.shape[0]
    split_width = max(1, {"1": 1, "7": 7, "V-1": v - 1, "V": v, "2V": 2 * v}[width])
    parts = reference_partials(hidden, weight, labels, top_n, split_width)
    assert parts.max.shape[0] == -(-v // split_width)
    assert_matches(merge_splits(parts, labels, split_width, top_n), hidden, weight, labels, top_n, exact=True)


def test_merge_ties_across_many_splits():
    # z_v = v % 5 for 50 tokens: the label's value recurs in every split of 3 or 8,
    # below and above y
    hidden = torch.tensor([[1.0]])
    weight = (torch.arange(50) % 5).float()[:, None]
    labels = torch.tensor([0, 4, 24, 25, 49, 32])
    ref = head_stats_reference(hidden.expand(6, 1), weight, labels, 12)
    assert ref.label_order.tolist() == [40, 0, 4, 45, 9, 26]  # e.g. y=25 (z=0): 40 above, 5 tied below
    for split_width in (3, 8, 50):
        out = merge_splits(reference_partials(hidden.expand(6, 1), weight, labels, 12, split_width), labels,
                           split_width, 12)
        assert torch.equal(out.label_rank, ref.label_rank) and torch.equal(out.label_order, ref.label_order)
        assert torch.equal(out.top_logprobs, ref.top_logprobs)


def test_merge_checks_the_top_shape():
    hidden, weight, labels, _, _ = make_case("M1")
    parts = reference_partials(hidden, weight, labels, 4, 16)
    with pytest.raises(ValueError, match=r"top partials must be \[S, M, top_n\]"):
        merge_splits(parts, labels, 16, 5)


def test_split_plan():
    from dflash_callbacks.kernels import triton_head_stats as th  # imports without triton too

    assert th.split_plan(37, 301, 128, 128, 132) == (1, 384)  # small V: one split
    # one task of the production setup: 60 row tiles x 18 splits of 108 tiles
    splits, width = th.split_plan(7665, 248_320, 128, 128, 132)
    assert (splits, width) == (18, 108 * 128)
    assert (splits - 1) * width < 248_320 <= splits * width
    assert 60 * splits >= th.PROGRAMS_PER_SM * 132 and width >= th.MIN_TILES_PER_SPLIT * 128
    assert th.split_plan(76_800, 248_320, 128, 128, 132) == (2, 970 * 128)  # rows alone nearly fill it
    assert th.split_plan(0, 1000, 64, 128, 132) == (1, 1024)
    assert th.fixed_splits(301, 16, 3) == (3, 112)  # V not a multiple of the width
    assert th.fixed_splits(20, 16, 5) == (2, 16)  # more splits asked than tiles


# ---------------------------------------------------------------- Triton, interpreter (CPU)

_INTERPRETER_CHILD = """
import sys, traceback, torch
from dflash_callbacks.kernels import triton_head_stats as th
from dflash_callbacks.kernels.head_stats import head_stats
assert th.is_interpreted(), "the child must run in Triton's interpreter"
cases = torch.load(sys.argv[1])
small = th.TileConfig(16, 16, 16, 4, 1)
results = {}
for (name, job), (hidden, weight, labels, top_n, chunk) in cases.items():
    try:
        if job == "default":  # through the dispatch, as the scorer calls it
            results[name, job] = tuple(head_stats(hidden, weight, labels, top_n, backend="triton", chunk_size=chunk))
        else:  # "tiles-16": the raw partials of the smallest tiles in 3 splits
            parts, width = th.triton_head_partials(hidden, weight, labels, top_n, config=small, num_splits=3)
            results[name, job] = (tuple(parts), width)
    except Exception:
        results[name, job] = traceback.format_exc()
torch.save(results, sys.argv[2])
"""

_NATIVE_CHILD = """
import json, sys, torch
from dflash_callbacks.kernels import triton_head_stats as th
from dflash_callbacks.kernels.head_stats import head_stats
report = {"interpreted": th.is_interpreted()}
h, w, y = torch.randn(4, 16), torch.randn(20, 16), torch.zeros(4, dtype=torch.long)
for top_n in (2, th.MAX_KERNEL_TOP_N + 1):
    try:
        head_stats(h, w, y, top_n, backend="triton")
        report[f"cpu_error_{top_n}"] = None
    except RuntimeError as e:
        report[f"cpu_error_{top_n}"] = str(e)
import triton.backends
if "nvidia" not in triton.backends.backends:
    report["compile"] = "skip: triton has no NVIDIA backend"
else:
    compiled = {}
    for dtype, top_n in ((torch.bfloat16, 8), (torch.float32, th.MAX_KERNEL_TOP_N)):
        ck = th.compile_for_target(dtype, top_n, arch=90)
        ttgir = ck.asm["ttgir"]
        compiled[f"{dtype}-{top_n}"] = {
            "stages": sorted(ck.asm),
            "async_copies": ttgir.count("async_copy_global_to_local"),  # the K loop is pipelined
            "wgmma": "warp_group_dot" in ttgir,
        }
    report["compile"] = compiled
print(json.dumps(report))
"""


def _child_env(interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


class _Child:
    """A Python subprocess whose output goes to files (no pipe to fill up)."""

    def __init__(self, tmp: Path, name: str, code: str, args: list[str], interpret: bool):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, *args], env=_child_env(interpret), stdout=out, stderr=err
            )

    def wait(self) -> str:
        """Stdout, after asserting a zero exit status."""
        rc = self.proc.wait(timeout=900)
        assert rc == 0, self.err.read_text()[-4000:]
        return self.out.read_text()


@pytest.fixture(scope="module")
def triton_children(tmp_path_factory):
    """Starts both Triton subprocesses at once (they overlap on a multi-core machine):
    the interpreter run of every job, and the native CPU-error / compile check."""
    tmp = tmp_path_factory.mktemp("triton_children")
    torch.save({(name, job): make_case(name) for name, job in TRITON_JOBS}, tmp / "cases.pt")
    args = [str(tmp / "cases.pt"), str(tmp / "results.pt")]
    children = {
        "interpreter": _Child(tmp, "interpreter", _INTERPRETER_CHILD, args, interpret=True),
        "native": _Child(tmp, "native", _NATIVE_CHILD, [], interpret=False),
    }
    yield children, tmp
    for child in children.values():
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


@pytest.fixture(scope="module")
def interpreter_results(triton_children):
    children, tmp = triton_children
    children["interpreter"].wait()
    return torch.load(tmp / "results.pt")


# every case through the dispatch; the cheaper kernel-side ones again as raw partials
# of 16-wide tiles in 3 splits (N > tile width, several row blocks, ties and top-N
# across split boundaries, a partial last tile and a short last split at every size),
# checked against partials from the materialised logits and, merged, against the
# reference
_SMALL_TILE_CASES = ("int-fp32-V-odd", "int-bf16", "int-fp16", "rand-bf16", "rand-fp16-N1", "M1", "V1", "N-gt-tile",
                     "N-gt-V", "N-at-kernel-limit", "dup-bf16")
TRITON_JOBS = [(name, "default") for name in CASES] + [(name, "tiles-16") for name in _SMALL_TILE_CASES]


def _interpreter_stats(results, name: str, job: str) -> HeadStats:
    result = results[name, job]
    assert not isinstance(result, str), result  # a traceback from the child
    if job == "default":
        return HeadStats(*result)
    parts, width = SplitPartials(*result[0]), result[1]
    return merge_splits(parts, make_case(name)[2], width, make_case(name)[3])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name, job", TRITON_JOBS)
def test_triton_interpreter_matches_reference(name, job, interpreter_results):
    hidden, weight, labels, top_n, _ = make_case(name)
    out = _interpreter_stats(interpreter_results, name, job)
    assert_matches(out, hidden, weight, labels, top_n, exact_ties(name))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", _SMALL_TILE_CASES)
def test_triton_interpreter_partials(name, interpreter_results):
    """The kernel's per-split output: its pivot is bitwise its own z_y in every split;
    every partial matches the one from the materialised logits (exactly for exact
    logits; the counts exactly for duplicates); top lists: the same values, any order."""
    result = interpreter_results[name, "tiles-16"]
    assert not isinstance(result, str), result
    parts, width = SplitPartials(*result[0]), result[1]
    hidden, weight, labels, top_n, _ = make_case(name)
    ref = reference_partials(hidden, weight, labels, top_n, width)
    assert parts.max.shape == ref.max.shape and (parts.max.shape[0] == 3 or weight.shape[0] <= 32)
    z_y = parts.label_logit.gather(0, (labels // width)[None])
    assert torch.equal(parts.pivot, z_y.expand_as(parts.pivot))
    torch.testing.assert_close(parts.sum_exp, ref.sum_exp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts.max, ref.max, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(parts.label_logit, ref.label_logit, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(parts.top.sort(-1).values, ref.top.sort(-1).values, rtol=1e-6, atol=1e-5)
    exact = ("max", "label_logit", "n_greater", "n_tied_below", "top") if exact_logits(name) else \
        ("n_greater", "n_tied_below") if exact_ties(name) else ()
    for field in exact:
        a, b = getattr(parts, field), getattr(ref, field)
        a, b = (a.sort(-1).values, b.sort(-1).values) if field == "top" else (a, b)
        assert torch.equal(a, b), field


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_native_build_on_cpu(triton_children):
    """Without the interpreter: a clear error for CPU tensors (both sides of the
    kernel's top-N limit), and the kernel compiles for sm_90 ahead of time, with
    wgmma and a pipelined K loop for the variant a contiguous launch gets."""
    children, _ = triton_children
    report = json.loads(children["native"].wait().strip().splitlines()[-1])
    assert report["interpreted"] is False
    for key in ("cpu_error_2", f"cpu_error_{KERNEL_LIMIT + 1}"):
        assert report[key] is not None and "TRITON_INTERPRET=1" in report[key], report
    if isinstance(report["compile"], str):
        pytest.skip(report["compile"])
    for variant, info in report["compile"].items():
        assert "cubin" in info["stages"] and "ptx" in info["stages"], (variant, info)
        assert info["async_copies"] > 0, (variant, info)
    assert report["compile"]["torch.bfloat16-8"]["wgmma"]


# ---------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs triton and a CUDA device")


@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_matches_reference(name, backend):
    hidden, weight, labels, top_n, chunk = make_case(name)
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    out = head_stats(hidden, weight, labels, top_n, backend=backend, chunk_size=chunk)
    exact = exact_ties(name) if backend == "triton" else exact_logits(name)
    assert_matches(out, hidden, weight, labels, top_n, exact)


def _realistic(dtype, seed, m=1000, h=512, v=50_000):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g).to(dtype).cuda()
    weight = (torch.randn(v, h, generator=g) * (3 / math.sqrt(h))).to(dtype).cuda()
    labels = torch.randint(0, v, (m,), generator=g).cuda()
    return hidden, weight, labels


@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("top_n", [4, 8, 64, 65])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_realistic_size(backend, top_n, dtype):
    hidden, weight, labels = _realistic(dtype, top_n)
    out = head_stats(hidden, weight, labels, top_n, backend=backend)
    torch.cuda.synchronize()
    assert_matches(out, hidden, weight, labels, top_n, exact=False)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_pivot_is_its_own_z_y(dtype):
    """On the GPU's tensor cores (and the fp32 FMA path) the kernel's pivot equals the
    logit its tile computes for y, in every split: the tie semantics rest on it."""
    from dflash_callbacks.kernels import triton_head_stats as th

    hidden, weight, labels = _realistic(dtype, 1)
    parts, width = th.triton_head_partials(hidden, weight, labels, 8)
    assert parts.max.shape[0] > 1
    z_y = parts.label_logit.gather(0, (labels // width)[None])
    assert torch.equal(parts.pivot, z_y.expand_as(parts.pivot))


@needs_cuda
def test_cuda_fp32_under_tf32():
    """A process with TF32 enabled for fp32 matmuls gets the fp32 contract anyway."""
    hidden, weight, labels = _realistic(torch.float32, 2, m=300)
    ref = head_stats_reference(hidden, weight, labels, 8)
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        for backend in ("torch", "triton", "reference"):
            out = head_stats(hidden, weight, labels, 8, backend=backend)
            torch.testing.assert_close(out.lse, ref.lse, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(out.top_logprobs, ref.top_logprobs, rtol=1e-6, atol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@needs_cuda
def test_auto_on_cuda_follows_the_table():
    hidden, weight, labels = _realistic(torch.bfloat16, 3)
    chosen = auto_backend(hidden.device, *hidden.shape, weight.shape[0])
    auto = head_stats(hidden, weight, labels, 8)
    for a, b in zip(auto, head_stats(hidden, weight, labels, 8, backend=chosen)):
        assert torch.equal(a, b)
