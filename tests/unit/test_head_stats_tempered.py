"""The tempered LM-head statistics (`head_stats_tempered`: what a draft sampled from softmax(z / T) is scored
by) against the materialised reference, in one pass with the greedy statistics, which stay bitwise
`head_stats`'; and on a CUDA device when there is one (benchmarks/gpu_check.sh runs this file there)."""

from __future__ import annotations

import pytest
import torch

from dflash_callbacks.kernels.head_stats import head_stats, head_stats_tempered


def case(m: int, h: int, v: int, dtype=torch.float32, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * 3 / h**0.5).to(device=device, dtype=dtype)
    return hidden, weight, torch.randint(0, v, (m,), generator=g).to(device)


def plain(hidden, weight, labels, temperature):
    """The definition in float64: logsumexp(z / T) and z_y / T minus it."""
    z = hidden.double() @ weight.double().T
    lse = (z / temperature).logsumexp(-1)
    return lse, z.gather(1, labels[:, None].long())[:, 0] / temperature - lse


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("chunk", [7, 64, 500, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tempered_statistics_match_the_definition_and_leave_the_greedy_ones_alone(temperature, chunk, dtype):
    hidden, weight, labels = case(37, 24, 301, dtype)
    found = head_stats_tempered(hidden, weight, labels, 5, temperature, backend="torch", chunk_size=chunk)
    lse, label = plain(hidden.float(), weight.float(), labels, temperature)
    torch.testing.assert_close(found.tempered_lse.double(), lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(found.tempered_label_logprob.double(), label, atol=1e-5, rtol=1e-6)
    reference = head_stats_tempered(hidden, weight, labels, 5, temperature, backend="reference")
    torch.testing.assert_close(found.tempered_label_logprob, reference.tempered_label_logprob, atol=1e-5, rtol=1e-6)
    greedy = head_stats(hidden, weight, labels, 5, backend="torch", chunk_size=chunk)
    assert all(torch.equal(a, b) for a, b in zip(found[:5], greedy))  # greedy scoring's numbers, bit for bit
    assert ((found.tempered_label_logprob <= 1e-6) & torch.isfinite(found.tempered_label_logprob)).all()


def test_temperature_one_is_the_plain_log_prob_and_bad_temperatures_are_refused():
    hidden, weight, labels = case(20, 16, 90)
    found = head_stats_tempered(hidden, weight, labels, 0, 1.0, backend="torch", chunk_size=32)
    torch.testing.assert_close(found.tempered_label_logprob, found.label_logprob, atol=2e-6, rtol=0)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature must be a number > 0"):
            head_stats_tempered(hidden, weight, labels, 0, bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tempered_statistics_on_the_device(dtype):
    hidden, weight, labels = case(700, 512, 40000, dtype, "cuda")
    found = head_stats_tempered(hidden, weight, labels, 8, 0.7, backend="auto")
    lse, label = plain(hidden.float(), weight.float(), labels, 0.7)
    torch.testing.assert_close(found.tempered_lse.double(), lse, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(found.tempered_label_logprob.double(), label, atol=1e-4, rtol=1e-6)
