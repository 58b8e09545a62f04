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
  tile passes, the rank counts against a pivot, and a running top-N merged with
  `torch.topk`. Peak extra memory is one [row_chunk, chunk_size] fp32 tile plus
  temporaries of that size, never [M, V]. No host synchronisation inside the loops.
  The tile GEMM (`_logits`): on CUDA, bf16/fp16 operands go straight into a
  tensor-core GEMM with fp32 accumulation and fp32 output
  (`torch.mm(h, w.T, out_dtype=torch.float32)`, torch >= 2.8; no upcast copy of the
  weight); on the CPU, where torch has no 16-bit GEMM with fp32 output (`mm.dtype`
  is CUDA-only in torch 2.13), the tile of the weight is upcast to fp32 (exact) and
  multiplied in fp32 (also the fallback on CUDA before torch 2.8). fp32 operands use
  an IEEE fp32 GEMM; if the process lets fp32 matmuls round their inputs (TF32 via
  `torch.backends.cuda.matmul.allow_tf32`, `set_float32_matmul_precision("high")` or
  "medium", or the `fp32_precision` settings), that GEMM runs in fp64 and is
  rounded to fp32 instead: no global setting is read-modified (scoring runs beside
  training threads), products stay exact, the accumulation is at least as precise.
  The reference uses the same fp32 rule. The rank pivot is computed before the pass
  by the same GEMM routine on the rows' own label columns (the diagonal of
  `_logits(h, weight[y])`), see Tolerances; when one tile holds the whole vocabulary
  (V <= chunk_size) the pivot is that tile's own z_y and no second GEMM runs.
- "triton": the split-V kernel and merge in `triton_head_stats.py`; CUDA tensors, or
  CPU tensors under TRITON_INTERPRET=1. For top_n above its register limit
  (`MAX_KERNEL_TOP_N`, 64) the whole call runs on the chunked torch path instead, so
  the five outputs always come from one pass and stay mutually consistent.
- "auto": `auto_backend(device, M, H, V)`, from the evidence table `AUTO_TABLE`
  (device kind -> size regimes by M*H*V -> backend, with the measurement that
  justifies it). Deterministic: no in-process timing, so two runs of one config use
  one backend. Today every entry is "torch": on an H200 (main at 751fb1f, production
  scoring) the previous row-tiled Triton kernel took 22.6 s against 7.3 s for the
  torch path with its then fp32 GEMM; the split-V kernel and the bf16-GEMM torch
  path have not been measured on a GPU, and the torch path is the one whose GEMM is
  cuBLAS (within a few x of the 0.28 s bf16 floor by construction: same GEMM plus
  elementwise passes over fp32 tiles). `benchmarks/gpu_check.sh` measures both; an
  entry changes to "triton" only with a measurement showing it faster at that size.

Tempered (`head_stats_tempered`, what a draft sampled from softmax(z / T) is scored by, T > 0): the
five statistics and, from the same pass over the same logits,

    tempered_lse            [M] fp32   logsumexp_v z_v / T
    tempered_label_logprob  [M] fp32   z_y / T - tempered_lse

On the torch path each tile adds one more exponential to the online log-sum-exp (the running max of
z / T is the running max over T), never [M, V]; "triton" runs the torch path (the kernel keeps no
tempered sum), "reference" the materialised definition. Same tolerances as lse and label_logprob.

Top-K with ids (`head_topk`, what DFlash 2's candidate selector reads): the k largest z_v of
each row and their ids, [M, k] fp32 values and int64 ids, descending, ties to the lower id,
never materialising [M, V] either. "reference": the fp32 logits sorted (a stable descending
sort, so ties keep the ascending id order). "torch": the same tiles as above; each tile's
logits are turned into int64 keys that order them as (value descending, id ascending)
(the fp32 bits made monotone, in the high 32 bits; the complement of the id, in the low),
so `torch.topk` on the keys is exact and deterministic, and the running top-k of the tiles
merges by one more `topk` (peak extra memory: a few int64 temporaries of the tile's size). A
NaN logit is kept as the largest key, so it surfaces as a NaN value. "triton" and "auto" run the torch path (the Triton kernel keeps no ids). Values are
the tile's own logits, so they differ from the reference's by fp32 summation order only;
ids equal the reference's wherever no two logits lie within that rounding of each other at
the k-th place (exact logits, e.g. small-integer inputs: always).

Tolerances against the reference: lse, label_logprob and top_logprobs differ only by
fp32 summation-order rounding (the matmul's, about sqrt(H) * 6e-8 * |z|, and the
online logsumexp's); the tests hold them to 1e-5 absolute (+1e-6 relative).
Within every backend, label_logprob and top_logprobs are computed from the same logit
value, so when y is the argmax label_logprob == top_logprobs[:, 0] bitwise. Ranks
and orders are exact whenever the logits are exact in fp32 (e.g. small-integer
inputs). Otherwise ranks are counted against a pivot: the Triton kernel computes it
with the same dot as its logit tiles, so it is bitwise its own z_y (tested) and a
token tied with y in the kernel's logits (a duplicate of y's weight row) counts as a
tie exactly as in the reference. So is the torch path's when one tile holds the whole
vocabulary. Over several tiles its pivot comes from a second call of the same GEMM
routine; it equals the tile's z_y whenever the library sums both
products in the same order, which it usually does (on this CPU: every row at 4 of 5
test shapes, 99% at the fifth; a row dot matched 10-25%) but does not promise
(kernel choice depends on the shape; split-K/stream-K orders can differ between
output tiles). Where they differ, a token whose logit is within rounding of z_y, a
duplicate row included, can be counted on either side, as for any two fp32
evaluations of the same matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .types import BACKENDS, HeadStats, HeadTopK, TemperedHeadStats
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CHUNK_SIZE = 8192
"""Default vocabulary tile width of the torch path."""
TILE_ELEMENTS = 1 << 23
"""Default rows per chunk of the torch path = max(1, TILE_ELEMENTS // chunk_size)."""

AUTO_TABLE: dict[str, tuple[tuple[float, str, str], ...]] = {
    # device kind: ((smallest M*H*V of the regime, backend, evidence), ...), ascending
    "cuda": (
        (0, "torch", "unmeasured on GPU in this regime; torch is the safe default (cuBLAS GEMM)"),
        (1e12, "torch", "H200, main 751fb1f, production scoring (calls of 960 rows x 5120 x 248,320): the "
                        "previous row-tiled kernel 22.6 s vs the torch path (fp32 GEMM then) 7.3 s; the split-V "
                        "kernel and the bf16-GEMM torch path not yet measured"),
    ),
    "cpu": ((0, "torch", "the Triton kernel runs on the CPU only in its interpreter (tests)"),),
}
"""What backend="auto" runs, by device kind and size regime, with the evidence (see
the module doc). Device kinds not listed run "torch"."""


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
    own tiles and split count (`triton_head_stats.triton_head_stats` exposes them) and
    the reference ignores it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    labels = _validate(hidden, weight, labels, top_n, chunk_size)
    if backend == "auto":
        backend = auto_backend(hidden.device, hidden.shape[0], hidden.shape[1], weight.shape[0])
        if backend == "triton" and not _triton_imports():
            backend = "torch"
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
    return th.triton_head_stats(hidden, weight, labels, top_n)


def head_stats_tempered(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    top_n: int,
    temperature: float,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> TemperedHeadStats:
    """`head_stats` and the tempered log-sum-exp and label log-prob at `temperature` (> 0) of the module doc,
    in one pass; every backend but "reference" runs the chunked torch path."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0; got {temperature!r}")
    labels = _validate(hidden, weight, labels, top_n, chunk_size)
    if backend == "reference":
        return _reference(hidden, weight, labels, top_n, float(temperature))
    return _chunked(hidden, weight, labels, top_n, chunk_size, None, float(temperature))


def auto_backend(device: torch.device | str, m: int, h: int, v: int) -> str:
    """The backend "auto" runs for M rows, width H and V columns on `device`: the entry
    of `AUTO_TABLE` for the device kind whose regime holds M*H*V."""
    regimes = AUTO_TABLE.get(torch.device(device).type, ((0, "torch", "not in AUTO_TABLE"),))
    return [backend for low, backend, _ in regimes if m * h * v >= low][-1]


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


def head_topk(hidden: Tensor, weight: Tensor, k: int, *, backend: str = "auto",
              chunk_size: int | None = None) -> HeadTopK:
    """The k largest logits of each row of `hidden @ weight.T` and their ids (module doc), 1 <= k <= V.
    Every backend but "reference" runs the chunked torch path (`chunk_size` its vocabulary tile)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    _check_topk(hidden, weight, k, chunk_size)
    if backend == "reference":
        return _reference_topk(hidden, weight, k)
    return _chunked_topk(hidden, weight, k, chunk_size, None)


def head_topk_reference(hidden: Tensor, weight: Tensor, k: int) -> HeadTopK:
    """The plain definition: materialised fp32 logits, a stable descending sort."""
    _check_topk(hidden, weight, k, None)
    return _reference_topk(hidden, weight, k)


def head_topk_torch(hidden: Tensor, weight: Tensor, k: int, *, chunk_size: int | None = None,
                    row_chunk_size: int | None = None) -> HeadTopK:
    """The chunked torch path of `head_topk` with both tile sizes exposed (row_chunk_size >= 1)."""
    _check_topk(hidden, weight, k, chunk_size)
    if row_chunk_size is not None and (_not_int(row_chunk_size) or row_chunk_size < 1):
        raise ValueError(f"row_chunk_size must be None or an integer >= 1; got {row_chunk_size!r}")
    return _chunked_topk(hidden, weight, k, chunk_size, row_chunk_size)


def _reference_topk(hidden: Tensor, weight: Tensor, k: int) -> HeadTopK:
    z = _fp32_matmul(hidden.float(), weight.float())
    values, ids = torch.sort(z, dim=-1, descending=True, stable=True)
    return HeadTopK(values[:, :k], ids[:, :k])


_LOW = 1 << 32  # the id's share of an order key: its low 32 bits


def _order_keys(z: Tensor, first_id: int) -> Tensor:
    """int64 keys of fp32 logits z [rows, cols] (ids first_id + column) whose order is (value
    descending, id ascending): the value's bits made monotone (negative floats' magnitude bits
    flipped; -0.0 is 0.0, NaN the largest), times 2^32, plus 2^32 - 1 - id."""
    bits = torch.where(z.isnan(), z.new_tensor(float("nan")), z + 0.0).view(torch.int32)
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    ids = torch.arange(first_id, first_id + z.shape[1], device=z.device)
    return monotone * _LOW + (_LOW - 1 - ids)


def _from_order_keys(keys: Tensor) -> HeadTopK:
    monotone = keys >> 32  # arithmetic shift: the high half, sign included
    bits = torch.where(monotone < 0, monotone ^ 0x7FFFFFFF, monotone).int()
    return HeadTopK(bits.view(torch.float32), _LOW - 1 - (keys & (_LOW - 1)))


def _chunked_topk(hidden: Tensor, weight: Tensor, k: int, chunk_size: int | None, row_chunk: int | None) -> HeadTopK:
    m, v = hidden.shape[0], weight.shape[0]
    tile = min(chunk_size or DEFAULT_CHUNK_SIZE, v)
    row_chunk = row_chunk or max(1, TILE_ELEMENTS // tile)
    keys = torch.empty(m, k, dtype=torch.int64, device=hidden.device)
    for r0 in range(0, m, row_chunk):
        r1 = min(m, r0 + row_chunk)
        h = _gemm_operand(hidden[r0:r1])
        top = torch.empty(r1 - r0, 0, dtype=torch.int64, device=hidden.device)
        for c0 in range(0, v, tile):
            c1 = min(v, c0 + tile)
            best = _order_keys(_logits(h, weight[c0:c1]), c0).topk(min(k, c1 - c0), dim=-1).values
            both = torch.cat([top, best], dim=-1)
            top = both.topk(min(k, both.shape[-1]), dim=-1).values
        keys[r0:r1] = top
    return _from_order_keys(keys)


def _reference(hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int,
               temperature: float | None = None) -> HeadStats | TemperedHeadStats:
    z = _fp32_matmul(hidden.float(), weight.float())
    m, v = z.shape
    lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, labels[:, None])
    rank = (z > z_y).sum(-1)
    lower = torch.arange(v, dtype=torch.int64, device=z.device)[None, :] < labels[:, None]
    order = rank + ((z == z_y) & lower).sum(-1)
    top = torch.full((m, top_n), float("-inf"), dtype=torch.float32, device=z.device)
    k = min(top_n, v)
    if k > 0:
        top[:, :k] = (z - lse[:, None]).topk(k, dim=-1).values
    if temperature is not None:
        tempered = torch.logsumexp(z / temperature, dim=-1)
        return TemperedHeadStats(lse, z_y[:, 0] - lse, rank, order, top, tempered, z_y[:, 0] / temperature - tempered)
    return HeadStats(lse, z_y[:, 0] - lse, rank, order, top)


def _chunked(
    hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int, chunk_size: int | None, row_chunk: int | None,
    temperature: float | None = None,
) -> HeadStats | TemperedHeadStats:
    m, _ = hidden.shape
    v = weight.shape[0]
    f32, i64 = dict(dtype=torch.float32, device=hidden.device), dict(dtype=torch.int64, device=hidden.device)
    tile = min(chunk_size or DEFAULT_CHUNK_SIZE, v)
    row_chunk = row_chunk or max(1, TILE_ELEMENTS // tile)
    out = HeadStats(
        torch.empty(m, **f32),
        torch.empty(m, **f32),
        torch.empty(m, **i64),
        torch.empty(m, **i64),
        torch.full((m, top_n), float("-inf"), **f32),
    )
    tempered_lse, tempered_label = (torch.empty(m, **f32), torch.empty(m, **f32)) if temperature is not None else (None,) * 2
    k = min(top_n, v)
    column = torch.arange(v, **i64)
    for r0 in range(0, m, row_chunk):
        r1 = min(m, r0 + row_chunk)
        h = _gemm_operand(hidden[r0:r1])
        y = labels[r0:r1]
        # the rank pivot: z_y from the same GEMM routine, before the pass; where one tile
        # holds the whole vocabulary it is taken from that tile itself (bitwise its z_y)
        pivot = None if tile == v else torch.cat(
            [_logits(h[g : g + tile], weight[y[g : g + tile]]).diagonal() for g in range(0, r1 - r0, tile)])
        run_max = torch.full((r1 - r0,), float("-inf"), **f32)
        run_sum = torch.zeros(r1 - r0, **f32)
        z_y = torch.zeros(r1 - r0, **f32)
        n_gt = torch.zeros(r1 - r0, **i64)
        n_tie = torch.zeros(r1 - r0, **i64)
        top = torch.empty(r1 - r0, 0, **f32)
        tempered_sum = torch.zeros(r1 - r0, **f32)
        for c0 in range(0, v, tile):
            c1 = min(v, c0 + tile)
            z = _logits(h, weight[c0:c1])  # [rows, tile] fp32: the only large temporary
            new_max = torch.maximum(run_max, z.amax(-1))  # online logsumexp, rescaled sum
            shifted = z - new_max[:, None]
            if temperature is not None:  # the same for z / T, whose running max is new_max / T
                tempered_sum = (tempered_sum * torch.exp((run_max - new_max) / temperature)
                                + shifted.div(temperature).exp_().sum(-1))
            run_sum = run_sum * torch.exp(run_max - new_max) + shifted.exp_().sum(-1)
            run_max = new_max
            here = (y >= c0) & (y < c1)  # rows whose label is in this tile
            z_here = z.gather(1, (y - c0).clamp(0, c1 - c0 - 1)[:, None])[:, 0]
            z_y = torch.where(here, z_here, z_y)
            pivot = z_y if pivot is None else pivot
            n_gt += (z > pivot[:, None]).sum(-1, dtype=torch.int32) - (here & (z_here > pivot)).int()  # not y itself
            n_tie += ((z == pivot[:, None]) & (column[None, c0:c1] < y[:, None])).sum(-1, dtype=torch.int32)
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
        if temperature is not None:
            tempered_lse[r0:r1] = run_max / temperature + torch.log(tempered_sum)
            tempered_label[r0:r1] = z_y / temperature - tempered_lse[r0:r1]
    if temperature is not None:
        return TemperedHeadStats(*out, tempered_lse, tempered_label)
    return out


_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()  # torch.mm(..., out_dtype=), torch >= 2.8


def _gemm_operand(h: Tensor) -> Tensor:
    """The rows as `_logits` takes them: 16-bit on CUDA (tensor-core GEMM), else fp32."""
    return h if h.is_cuda and h.dtype != torch.float32 and _MM_OUT_DTYPE else h.float()


def _logits(h: Tensor, w: Tensor) -> Tensor:
    """h @ w.T as fp32 [rows, cols] with exact products and fp32 accumulation (see
    the module doc): h from `_gemm_operand`, w rows of the weight in its own dtype."""
    if h.dtype != torch.float32:
        return torch.mm(h, w.T, out_dtype=torch.float32)
    return _fp32_matmul(h, w.float())


def _fp32_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b.T for fp32 a, b with IEEE fp32 products: in fp64 (rounded to fp32) when
    the process lets fp32 matmuls on this device round their inputs (TF32, bf16)."""
    if _fp32_matmul_is_ieee(a.device):
        return a @ b.T
    return (a.double() @ b.double().T).float()


def _fp32_matmul_is_ieee(device: torch.device) -> bool:
    """Whether torch runs fp32 matmuls on `device` in IEEE fp32. Reads the per-backend
    `fp32_precision` settings (torch >= 2.9; "none" inherits), else the legacy global
    `torch.get_float32_matmul_precision()` (which also reflects `allow_tf32`)."""
    backends = torch.backends
    leaf = backends.cuda.matmul if device.type == "cuda" else backends.mkldnn.matmul
    for setting in (getattr(leaf, "fp32_precision", None), getattr(backends, "fp32_precision", None)):
        if setting not in (None, "none"):
            return setting == "ieee"
    return torch.get_float32_matmul_precision() == "highest"


def _triton_imports() -> bool:
    try:
        from . import triton_head_stats as th
    except ImportError:  # pragma: no cover
        return False
    return th.is_available()


def _not_int(x: object) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def _check_topk(hidden: Tensor, weight: Tensor, k: int, chunk_size: int | None) -> None:
    """Checks `head_topk`'s arguments (those it shares with `head_stats` by the same rules)."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    _check_operands(hidden, weight, chunk_size)
    if _not_int(k) or not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be an integer from 1 to V = {weight.shape[0]}; got {k!r}")


def _validate(hidden: Tensor, weight: Tensor, labels: Tensor, top_n: int, chunk_size: int | None) -> Tensor:
    """Checks the contract; returns labels as int64."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    _check_operands(hidden, weight, chunk_size)
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
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ValueError(
            f"labels must lie in [0, V) = [0, {weight.shape[0]}); got min {int(labels.min())}, max {int(labels.max())}"
        )
    return labels.long()


def _check_operands(hidden: Tensor, weight: Tensor, chunk_size: int | None) -> None:
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
    if hidden.device != weight.device:
        raise ValueError(f"hidden and weight must be on one device; got {hidden.device}, {weight.device}")
    if chunk_size is not None and (_not_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an integer >= 1; got {chunk_size!r}")
