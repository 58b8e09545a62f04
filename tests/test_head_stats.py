"""head_stats: the chunked torch path and the Triton kernel against the materialised
reference, on odd shapes, exact ties, every dtype, and both sides of the kernel's
top-N limit.

How the Triton kernel runs here:
- CPU (CI): in Triton's interpreter, in a subprocess started with TRITON_INTERPRET=1.
  Interpreter mode is fixed when a `@triton.jit` function is decorated (triton reads
  the variable then), including triton's own library functions decorated on
  `import triton`. In a shared pytest session any earlier test, plugin or library
  may already have imported triton, so toggling the variable in-process would make
  these tests depend on test order; a fresh process with the variable set is
  deterministic. The subprocess computes every case once; the comparisons run here,
  one test per case.
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash_callbacks.kernels.head_stats import (
    BACKENDS,
    HeadStats,
    head_stats,
    head_stats_reference,
    head_stats_torch,
)

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
KERNEL_LIMIT = 64  # triton_head_stats.MAX_KERNEL_TOP_N, without importing triton here


# ---------------------------------------------------------------- cases

# name: (M, H, V, top_n, dtype, kind, chunk_size)
# kind "int": entries in {-2..2}, so every logit is an exact small integer (exact in
# every dtype and in fp32 accumulation) and ties are everywhere; ranks must match
# exactly. kind "rand": Gaussian, logits of order 3.
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
    return hidden, weight, labels, top_n, chunk


def exact_logits(name: str) -> bool:
    return CASES[name][5] == "int"


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


def test_empty_rows():
    weight = torch.randn(10, 4)
    out = head_stats(torch.empty(0, 4), weight, torch.empty(0, dtype=torch.long), 3, backend="torch")
    assert_contract(out, 0, 3)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any torch op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_torch_path_never_materialises_the_logits():
    m, h, v = 300, 8, 2000
    hidden, weight = torch.randn(m, h), torch.randn(v, h)
    labels = torch.randint(0, v, (m,))
    with _LargestTensor() as ref_probe:
        head_stats(hidden, weight, labels, 4, backend="reference")
    assert ref_probe.largest >= m * v  # the probe sees the reference's logits
    with _LargestTensor() as probe:
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


# ---------------------------------------------------------------- Triton, interpreter (CPU)

_INTERPRETER_CHILD = """
import sys, traceback, torch
from dflash_callbacks.kernels import triton_head_stats as th
from dflash_callbacks.kernels.head_stats import head_stats
assert th.is_interpreted(), "the child must run in Triton's interpreter"
cases = torch.load(sys.argv[1])
results = {}
for (name, tiles), (hidden, weight, labels, top_n, chunk) in cases.items():
    try:
        if tiles == "default":  # through the dispatch, as the scorer calls it
            out = head_stats(hidden, weight, labels, top_n, backend="triton", chunk_size=chunk)
        else:  # the launcher with the smallest tiles: many row blocks and vocabulary tiles
            out = th.triton_head_stats(hidden, weight, labels, top_n, block_m=16, block_v=16, block_h=16)
        results[name, tiles] = tuple(out)
    except Exception:
        results[name, tiles] = traceback.format_exc()
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
    for dtype, top_n in ((torch.bfloat16, th.MAX_KERNEL_TOP_N), (torch.float16, 1)):
        ck = th.compile_for_target(dtype, top_n, arch=90)
        compiled[f"{dtype}-{top_n}"] = sorted(ck.asm)
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
    torch.save({(name, tiles): make_case(name) for name, tiles in TRITON_JOBS}, tmp / "cases.pt")
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


# every case through the dispatch; the cheaper kernel-side ones again with 16-wide
# tiles (N > tile width, several row blocks, a partial last tile at every size)
_SMALL_TILE_CASES = ("int-fp32-V-odd", "int-bf16", "int-fp16", "rand-fp16-N1", "M1", "V1", "N-gt-tile", "N-gt-V",
                     "N-at-kernel-limit")
TRITON_JOBS = [(name, "default") for name in CASES] + [(name, "tiles-16") for name in _SMALL_TILE_CASES]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name, tiles", TRITON_JOBS)
def test_triton_interpreter_matches_reference(name, tiles, interpreter_results):
    result = interpreter_results[name, tiles]
    assert not isinstance(result, str), result  # a traceback from the child
    hidden, weight, labels, top_n, _ = make_case(name)
    assert_matches(HeadStats(*result), hidden, weight, labels, top_n, exact_logits(name))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_native_build_on_cpu(triton_children):
    """Without the interpreter: a clear error for CPU tensors (both sides of the
    kernel's top-N limit), and the kernel compiles for sm_90 ahead of time."""
    children, _ = triton_children
    report = json.loads(children["native"].wait().strip().splitlines()[-1])
    assert report["interpreted"] is False
    for key in ("cpu_error_2", f"cpu_error_{KERNEL_LIMIT + 1}"):
        assert report[key] is not None and "TRITON_INTERPRET=1" in report[key], report
    if isinstance(report["compile"], str):
        pytest.skip(report["compile"])
    for variant, stages in report["compile"].items():
        assert "cubin" in stages and "ptx" in stages, (variant, stages)


# ---------------------------------------------------------------- Triton, CUDA


@pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs triton and a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_cuda_matches_reference(name):
    hidden, weight, labels, top_n, chunk = make_case(name)
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    out = head_stats(hidden, weight, labels, top_n, backend="triton", chunk_size=chunk)
    assert_matches(out, hidden, weight, labels, top_n, exact_logits(name))
    auto = head_stats(hidden, weight, labels, top_n, backend="auto", chunk_size=chunk)
    for a, b in zip(auto, out):  # auto on CUDA is the kernel: bitwise the same
        assert torch.equal(a, b)


@pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs triton and a CUDA device")
@pytest.mark.parametrize("top_n", [4, 8, 64, 65])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_cuda_realistic_size(top_n, dtype):
    g = torch.Generator().manual_seed(top_n)
    m, h, v = 1000, 512, 50_000
    hidden = torch.randn(m, h, generator=g).to(dtype).cuda()
    weight = (torch.randn(v, h, generator=g) * (3 / math.sqrt(h))).to(dtype).cuda()
    labels = torch.randint(0, v, (m,), generator=g).cuda()
    out = head_stats(hidden, weight, labels, top_n, backend="triton")
    torch.cuda.synchronize()
    assert_matches(out, hidden, weight, labels, top_n, exact=False)
