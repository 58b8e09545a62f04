"""head_topk, the streaming top-K with ids DFlash 2's selector reads: the chunked torch path against
the materialised reference on odd shapes, exact ties and every dtype; ties go to the lower id."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_callbacks.kernels.head_stats import head_topk, head_topk_reference, head_topk_torch
from largest_tensor import LargestTensor

# name: (M, H, V, k, dtype, kind, chunk_size); "int": logits are small exact integers (ties everywhere),
# "rand": Gaussian logits of order 3
CASES = {
    "int-fp32-V-odd": (37, 24, 301, 5, torch.float32, "int", None),
    "int-fp32-tiles-7": (13, 8, 101, 9, torch.float32, "int", 7),
    "int-bf16": (19, 16, 200, 8, torch.bfloat16, "int", 64),
    "int-fp16-k-eq-V": (6, 16, 30, 30, torch.float16, "int", 8),
    "rand-fp32": (33, 40, 517, 16, torch.float32, "rand", None),
    "rand-bf16": (21, 32, 300, 7, torch.bfloat16, "rand", 32),
    "rand-fp16-k1": (17, 32, 259, 1, torch.float16, "rand", 5),
    "M1-V1": (1, 8, 1, 1, torch.float32, "rand", None),
    "k-gt-tile": (11, 16, 300, 40, torch.float32, "rand", 16),
}


def make_case(name):
    m, h, v, k, dtype, kind, chunk = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if kind == "int":
        hidden = torch.randint(-2, 3, (m, h), generator=g).float()
        weight = torch.randint(-2, 3, (v, h), generator=g).float()
    else:
        hidden, weight = torch.randn(m, h, generator=g), torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    return hidden.to(dtype), weight.to(dtype), k, chunk, kind == "int"


def test_reference_on_a_hand_made_example():
    """Logits [1, 3, 3, 0, 3]: the three 3s by id, then 1."""
    hidden, weight = torch.tensor([[1.0]]), torch.tensor([[1.0], [3.0], [3.0], [0.0], [3.0]])
    out = head_topk_reference(hidden, weight, 4)
    assert out.ids.tolist() == [[1, 2, 4, 0]] and out.values.tolist() == [[3.0, 3.0, 3.0, 1.0]]
    assert out.values.dtype == torch.float32 and out.ids.dtype == torch.int64
    for chunk in (1, 2, 3, 5):
        torch_path = head_topk(hidden, weight, 4, backend="torch", chunk_size=chunk)
        assert torch.equal(torch_path.ids, out.ids) and torch.equal(torch_path.values, out.values)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_matches_reference(name):
    hidden, weight, k, chunk, exact = make_case(name)
    ref = head_topk(hidden, weight, k, backend="reference")
    for backend in ("torch", "auto", "triton"):  # "triton" keeps no ids: it runs the torch path
        out = head_topk(hidden, weight, k, backend=backend, chunk_size=chunk)
        assert out.values.shape == out.ids.shape == (hidden.shape[0], k)
        torch.testing.assert_close(out.values, ref.values, atol=1e-5, rtol=1e-6)
        if exact:  # exact logits: the ids, ties to the lower id, exactly
            assert torch.equal(out.ids, ref.ids) and torch.equal(out.values, ref.values)
        else:  # each id's logit is its value, and nothing outside the top-k beats it
            z = hidden.float() @ weight.float().T
            torch.testing.assert_close(z.gather(1, out.ids), out.values, atol=1e-5, rtol=1e-6)
            assert (out.ids.sort(-1).values[:, 1:] != out.ids.sort(-1).values[:, :-1]).all()


@pytest.mark.parametrize("chunk_size, row_chunk_size", [(1, 19), (7, 1), (64, 10), (10_000, 10_000)])
def test_torch_path_tile_sizes(chunk_size, row_chunk_size):
    hidden, weight, k, _, _ = make_case("int-fp32-V-odd")
    out = head_topk_torch(hidden, weight, k, chunk_size=chunk_size, row_chunk_size=row_chunk_size)
    ref = head_topk_reference(hidden, weight, k)
    assert torch.equal(out.ids, ref.ids) and torch.equal(out.values, ref.values)


def test_negative_zero_ties_positive_zero_and_nan_surfaces():
    hidden = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[-0.0], [0.0], [-1.0], [-0.0]])
    out = head_topk(hidden, weight, 3, backend="torch", chunk_size=2)
    assert out.ids.tolist() == [[0, 1, 3]] * 2  # -0.0 == 0.0: by id
    weight[2, 0] = float("nan")  # a NaN logit below every other: still surfaces as the top value
    out = head_topk(hidden, weight, 1, backend="torch", chunk_size=2)
    assert out.ids.tolist() == [[2], [2]] and out.values.isnan().all()


def test_torch_path_never_materialises_the_logits():
    m, h, v = 300, 8, 2000
    hidden, weight = torch.randn(m, h), torch.randn(v, h)
    with LargestTensor() as probe:
        out = head_topk_torch(hidden, weight, 4, chunk_size=128, row_chunk_size=50)
    assert probe.largest <= max(50 * (128 + 4), m * h, v * h), probe.largest
    torch.testing.assert_close(out.values, head_topk_reference(hidden, weight, 4).values)


@pytest.mark.parametrize("k, kwargs, message", [
    (0, {}, r"k must be an integer from 1 to V = 10"),
    (11, {}, r"k must be an integer from 1 to V = 10"),
    (2.0, {}, r"k must be an integer"),
    (2, {"backend": "cuda"}, "backend must be one of"),
    (2, {"chunk_size": 0}, "chunk_size must be None or an integer >= 1"),
])
def test_validation(k, kwargs, message):
    with pytest.raises(ValueError, match=message):
        head_topk(torch.randn(4, 8), torch.randn(10, 8), k, **kwargs)
    with pytest.raises(ValueError, match="share one dtype"):
        head_topk(torch.randn(4, 8), torch.randn(10, 8).double(), 2)
    with pytest.raises(ValueError, match="row_chunk_size must be None or an integer >= 1"):
        head_topk_torch(torch.randn(4, 8), torch.randn(10, 8), 2, row_chunk_size=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["int-fp32-V-odd", "int-bf16", "rand-fp32", "rand-bf16", "k-gt-tile"])
def test_cuda_matches_the_cpu_reference(name):
    """On CUDA the torch path's 16-bit tiles are a tensor-core GEMM with fp32 output: the same contract."""
    hidden, weight, k, chunk, exact = make_case(name)
    ref = head_topk_reference(hidden, weight, k)
    out = head_topk(hidden.cuda(), weight.cuda(), k, chunk_size=chunk)
    torch.testing.assert_close(out.values.cpu(), ref.values, atol=1e-5, rtol=1e-6)
    if exact:
        assert torch.equal(out.ids.cpu(), ref.ids)
