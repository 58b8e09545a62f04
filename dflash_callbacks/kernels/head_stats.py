"""LM-head statistics for scoring: everything the acceptance metrics need from
`z = hidden @ weight.T`, without keeping the [M, V] logits.

Contract (`head_stats`, and each backend below):

    hidden  [M, H] fp32 / bf16 / fp16, weight [V, H] of the same dtype (the LM head,
    no bias), labels [M] integer in [0, V), top_n >= 0.
    z = hidden @ weight.T with fp32 products and fp32 accumulation (the reference
    upcasts both operands to fp32 before the matmul).

    lse            [M] fp32   logsumexp_v z_v
    label_logprob  [M] fp32   z_y - lse
    label_rank     [M] int64  #{v : z_v > z_y}                              (top@k)
    label_order    [M] int64  #{v : z_v > z_y or (z_v == z_y and v < y)}    (vanilla:
                              0 <=> y is the argmax with ties to the lowest id)
    top_logprobs   [M, top_n] fp32, the top_n largest z_v - lse, descending,
                              -inf where top_n > V                           (ddtree)

Backends:
- "reference": materialised fp32 logits and plain torch ops; the definition.
- "torch": chunked. Rows in chunks of `row_chunk_size` (default TILE_ELEMENTS //
  chunk_size), the vocabulary in tiles of `chunk_size` columns (default 8192); per
  tile an online logsumexp (running max, rescaled sum), the label's logit when its
  tile passes, the rank counts against a pivot (z_y from a row dot before the pass),
  and a running top-N merged with `torch.topk`. Peak extra memory is one
  [row_chunk, chunk_size] fp32 tile plus temporaries of that size, never [M, V].
- "triton": the fused kernel in `triton_head_stats.py`; CUDA tensors, or CPU tensors
  under TRITON_INTERPRET=1. For top_n above its register limit (`MAX_KERNEL_TOP_N`,
  64) the whole call runs on the chunked torch path instead, so the five outputs
  always come from one pass and stay mutually consistent.
- "auto": "triton" for CUDA tensors when triton imports, else "torch".

Tolerances against the reference: lse, label_logprob and top_logprobs differ only by
fp32 summation-order rounding (the matmul's, about sqrt(H) * 6e-8 * |z|, and the
online logsumexp's); the tests hold them to 1e-5 absolute (+1e-6 relative).
Within every backend, label_logprob and top_logprobs are computed from the same logit
value, so when y is the argmax label_logprob == top_logprobs[:, 0] bitwise. Ranks
and orders are exact whenever the logits are exact in fp32 (e.g. small-integer
inputs); otherwise a token whose logit is within rounding of z_y can be counted on
either side, as for any two fp32 evaluations of the same matmul.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "triton", "reference")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CHUNK_SIZE = 8192
"""Default vocabulary tile width of the torch path."""
TILE_ELEMENTS = 1 << 23
"""Default rows per chunk of the torch path = max(1, TILE_ELEMENTS // chunk_size)."""


class HeadStats(NamedTuple):
    lse: Tensor
    label_logprob: Tensor
    label_rank: Tensor
    label_order: Tensor
    top_logprobs: Tensor


def head_stats(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    top_n: int,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> HeadStats:
    """The statistics of the module docstring, from the backend named by `backend`.

    `chunk_size` is the vocabulary tile width of the torch path (default 8192), also
    when "triton" falls back to it above the kernel's top-N limit; the kernel keeps its
    own register-sized tiles (`triton_head_stats.triton_head_stats` exposes them) and
    the reference ignores it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    labels = _validate(hidden, weight, labels, top_n, chunk_size)
    if backend == "auto":
        backend = "triton" if hidden.is_cuda and _triton_imports() else "torch"
    if backend == "reference":
        return _reference(hidden, weight, labels, top_n)
    if backend == "torch":
        return _chunked(hidden, weight, labels, top_n, chunk_size, None)

    from . import triton_head_stats as th  # lazy: importing triton fixes interpreter mode

    if not th.is_available():
        raise RuntimeError("backend='triton' needs the triton package; install triton or use backend='torch'")
    if top_n > th.MAX_KERNEL_TOP_N:
        if not hidden.is_cuda and not th.is_interpreted():
            th.triton_head_stats(hidden, weight, labels, 0)  # raises the CPU/interpreter error
        return _chunked(hidden, weight, labels, top_n, chunk_size, None)
    return HeadStats(*th.triton_head_stats(hidden, weight, labels, top_n))


def head_stats_reference(hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int) -> HeadStats:
    """The plain definition: materialises the fp32 [M, V] logits."""
    return _reference(hidden, weight, _validate(hidden, weight, labels, top_n, None), top_n)


def head_stats_torch(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    top_n: int,
    *,
    chunk_size: int | None = None,
    row_chunk_size: int | None = None,
) -> HeadStats:
    """The chunked torch path with both tile sizes exposed (row_chunk_size >= 1)."""
    labels = _validate(hidden, weight, labels, top_n, chunk_size)
    if row_chunk_size is not None and (_not_int(row_chunk_size) or row_chunk_size < 1):
        raise ValueError(f"row_chunk_size must be None or an integer >= 1; got {row_chunk_size!r}")
    return _chunked(hidden, weight, labels, top_n, chunk_size, row_chunk_size)


def _reference(hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int) -> HeadStats:
    z = hidden.float() @ weight.float().T
    m, v = z.shape
    lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, labels[:, None])
    rank = (z > z_y).sum(-1)
    lower = torch.arange(v, device=z.device)[None, :] < labels[:, None]
    order = rank + ((z == z_y) & lower).sum(-1)
    top = torch.full((m, top_n), float("-inf"), device=z.device)
    k = min(top_n, v)
    if k > 0:
        top[:, :k] = (z - lse[:, None]).topk(k, dim=-1).values
    return HeadStats(lse, z_y[:, 0] - lse, rank, order, top)


def _chunked(
    hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int, chunk_size: int | None, row_chunk: int | None
) -> HeadStats:
    m, _ = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    tile = min(chunk_size or DEFAULT_CHUNK_SIZE, v)
    row_chunk = row_chunk or max(1, TILE_ELEMENTS // tile)
    out = HeadStats(
        torch.empty(m, device=dev),
        torch.empty(m, device=dev),
        torch.empty(m, dtype=torch.int64, device=dev),
        torch.empty(m, dtype=torch.int64, device=dev),
        torch.full((m, top_n), float("-inf"), device=dev),
    )
    k = min(top_n, v)
    for r0 in range(0, m, row_chunk):
        r1 = min(m, r0 + row_chunk)
        h = hidden[r0:r1].float()
        y = labels[r0:r1]
        pivot = (h * weight[y].float()).sum(-1)  # the rank pivot: z_y before the pass
        run_max = torch.full((r1 - r0,), float("-inf"), device=dev)
        run_sum = torch.zeros(r1 - r0, device=dev)
        z_y = torch.zeros(r1 - r0, device=dev)
        n_gt = torch.zeros(r1 - r0, dtype=torch.int64, device=dev)
        n_tie = torch.zeros(r1 - r0, dtype=torch.int64, device=dev)
        top = torch.empty(r1 - r0, 0, device=dev)
        for c0 in range(0, v, tile):
            c1 = min(v, c0 + tile)
            z = h @ weight[c0:c1].float().T  # [rows, tile] fp32: the only large temporary
            new_max = torch.maximum(run_max, z.amax(-1))  # online logsumexp, rescaled sum
            run_sum = run_sum * torch.exp(run_max - new_max) + (z - new_max[:, None]).exp_().sum(-1)
            run_max = new_max
            n_gt += (z > pivot[:, None]).sum(-1, dtype=torch.int32)
            n_eq = (z == pivot[:, None]).sum(-1, dtype=torch.int32)
            n_tie += torch.where(y >= c1, n_eq, 0)  # ties in tiles wholly below y count
            here = ((y >= c0) & (y < c1)).nonzero()[:, 0]  # rows whose label is in this tile
            if here.numel():
                zh, j = z[here], y[here] - c0
                zyh = zh[torch.arange(here.numel(), device=dev), j]
                z_y[here] = zyh
                n_gt[here] -= (zyh > pivot[here]).long()  # y itself never counts
                left = torch.arange(c1 - c0, device=dev)[None, :] < j[:, None]
                n_tie[here] += ((zh == pivot[here, None]) & left).sum(-1)
            if k > 0:
                best = z.topk(min(k, c1 - c0), dim=-1).values
                both = torch.cat([top, best], dim=-1)
                top = both.topk(min(k, both.shape[-1]), dim=-1).values
        run_lse = run_max + torch.log(run_sum)
        out.lse[r0:r1] = run_lse
        out.label_logprob[r0:r1] = z_y - run_lse
        out.label_rank[r0:r1] = n_gt
        out.label_order[r0:r1] = n_gt + n_tie
        out.top_logprobs[r0:r1, :k] = top - run_lse[:, None]
    return out


def _triton_imports() -> bool:
    try:
        from . import triton_head_stats as th
    except ImportError:  # pragma: no cover
        return False
    return th.is_available()


def _not_int(x: object) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def _validate(hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int, chunk_size: int | None) -> Tensor:
    """Checks the contract; returns labels as int64."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [M, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [M, H] and weight [V, H] disagree on H: {hidden.shape[1]} vs {weight.shape[1]}")
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one vocabulary row (V >= 1)")
    if hidden.dtype not in DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden and weight must share one dtype among {[str(d) for d in DTYPES]}; "
            f"got {hidden.dtype} and {weight.dtype}"
        )
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels must be [M] with M = {hidden.shape[0]}; got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be torch.int64 (or int32); got {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"hidden, weight and labels must be on one device; got {hidden.device}, {weight.device}, {labels.device}"
        )
    if _not_int(top_n) or top_n < 0:
        raise ValueError(f"top_n must be an integer >= 0; got {top_n!r}")
    if chunk_size is not None and (_not_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an integer >= 1; got {chunk_size!r}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ValueError(
            f"labels must lie in [0, V) = [0, {weight.shape[0]}); got min {int(labels.min())}, max {int(labels.max())}"
        )
    return labels.long()
