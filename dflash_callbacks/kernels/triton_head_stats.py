"""Fused LM-head statistics in one Triton kernel: lm_head matmul + logsumexp + the
label's log-prob, rank and tie order + the running top-N logits, without ever
writing the [M, V] logits.

Contract: the same as `head_stats.head_stats_reference` (see `head_stats.py`), for
`1 <= top_n <= MAX_KERNEL_TOP_N` or `top_n == 0`; `head_stats.head_stats` routes
larger `top_n` to the chunked torch path.

How one program works (it owns `BLOCK_M` rows):

1. Prologue: the pivot `p = <hidden[m], weight[y_m]>` in fp32 (a gathered row dot,
   M*H work, nothing stored). Counting ranks needs a pivot before the pass.
2. One stream over the vocabulary in tiles of `BLOCK_V` columns. Per tile:
   `z = hidden_block @ weight_tile.T` by `tl.dot` with fp32 accumulation over
   `BLOCK_H`-wide slices of H (fp32 inputs use IEEE fp32 products, never TF32);
   online logsumexp (running max and rescaled sum); the label's logit is picked up
   from the tile that holds column y (this is the value `label_logprob` uses, so it
   is bitwise the value the top-N list holds when y is among the top);
   `#{v != y : z_v > p}` and `#{v < y : z_v == p}` are counted; the running top-N
   is merged (below).
3. Epilogue: lse = max + log(sum); stores lse, z_y - lse, the two counts and the
   top-N logits minus lse.

Running top-N: the kernel keeps `TOP_K = next_power_of_two(top_n)` values per row in
registers, sorted descending, for `top_n <= MAX_KERNEL_TOP_N` (64; DDTree budgets used
in practice are 4, 8, ..., 64). Per tile, and only when some logit in the tile beats a
row's current TOP_K-th value, a bitonic top-k network takes the tile's TOP_K best per
row in ascending order; `maximum(running, tile_best)` is then a bitonic sequence
holding the TOP_K largest of the union, and one bitonic merge sorts it descending.
The tile is widened to at least TOP_K columns. Above MAX_KERNEL_TOP_N this module
refuses (`head_stats` then uses the chunked torch path for all outputs, so they stay
mutually consistent). The network is written here with min/max reductions rather than
taken from `tl.topk` / `tl.sort`: the same algorithm, but Triton's versions use an
xor-sum reduction that the interpreter runs element by element in Python (minutes
per call at these tile sizes), which would keep the kernel out of CPU tests.

Ranks use the pivot from step 1, which can differ from the tile's z_y in the last
fp32 bit; ranks are exact whenever the logits are exact in fp32 (e.g. integer-valued)
and otherwise exact up to such near-ties, like any fp32 reference.

Triton is imported guarded: without triton this module imports, `is_available()` is
False and `triton_head_stats` raises. Interpreter mode (CPU tensors) is fixed when
the kernel is decorated, i.e. when this module is first imported: TRITON_INTERPRET=1
must be in the environment by then.
"""

from __future__ import annotations

import torch

try:  # guarded: the package must import on machines without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

MAX_KERNEL_TOP_N = 64
"""The largest top_n the kernel keeps in registers itself."""

_BLOCK_M = 64
_BLOCK_V = 128
_BLOCK_H = 64


def is_available() -> bool:
    """True when triton imported."""
    return triton is not None


def is_interpreted() -> bool:
    """True when the kernel was built in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and type(_head_stats_kernel).__name__ == "InterpretedFunction"


if triton is not None:

    # Bitonic network on a row block x [2**LOG_M, 2**LOG_C] viewed as a hypercube
    # [2] * (LOG_M + LOG_C): bit j of the flat index (j < LOG_C: a column bit) is
    # hypercube axis n_dims - 1 - j. A compare-exchange takes the min and the max of
    # each pair of partners (plain reductions over a size-2 axis, which compile to
    # register ops and stay vectorised in the interpreter, unlike xor_sum-based
    # tl.sort / tl.topk / tl.flip, whose generic reduce the interpreter runs per
    # element in Python).

    @triton.jit
    def _bit(n_dims: tl.constexpr, j: tl.constexpr):
        """Bit j of the flat index, broadcastable against the hypercube."""
        return tl.reshape(tl.arange(0, 2), [1] * (n_dims - 1 - j) + [2] + [1] * j)

    @triton.jit
    def _compare_exchange(h, flip, j: tl.constexpr, n_dims: tl.constexpr):
        """Orders each partner pair differing in bit j: ascending where flip is 0."""
        lo = tl.min(h, axis=n_dims - 1 - j, keep_dims=True)
        hi = tl.max(h, axis=n_dims - 1 - j, keep_dims=True)
        return tl.where((_bit(n_dims, j) ^ flip) != 0, hi, lo)

    @triton.jit
    def _bitonic_merge(h, stage: tl.constexpr, order: tl.constexpr, n_dims: tl.constexpr):
        """Sorts bitonic runs of 2**stage: order 0 ascending, 1 descending, 2 alternating
        (run r ascending for even r)."""
        for i in tl.static_range(stage):
            if order == 2:
                h = _compare_exchange(h, _bit(n_dims, stage), stage - 1 - i, n_dims)
            else:
                h = _compare_exchange(h, order, stage - 1 - i, n_dims)
        return h

    @triton.jit
    def _row_topk_ascending(x, LOG_M: tl.constexpr, LOG_C: tl.constexpr, LOG_K: tl.constexpr):
        """The 2**LOG_K largest values of each row of x [2**LOG_M, 2**LOG_C], ascending
        (bitonic top-k: sort runs of 2**LOG_K alternately, then repeatedly keep the
        pairwise max of neighbouring runs, a bitonic run holding their top, and re-sort)."""
        if LOG_K == 0:
            out = tl.max(x, axis=1, keep_dims=True)
        else:
            h = tl.reshape(x, [2] * (LOG_M + LOG_C))
            for s in tl.static_range(1, LOG_K + 1):
                h = _bitonic_merge(h, s, 2 if s < LOG_C else 0, LOG_M + LOG_C)
            for i in tl.static_range(LOG_K + 1, LOG_C + 1):
                # dims before this step: LOG_M + LOG_C - (i - LOG_K - 1); bit LOG_K's axis:
                h = tl.max(h, axis=LOG_M + LOG_C - i)
                h = _bitonic_merge(h, LOG_K, 2 if i < LOG_C else 0, LOG_M + LOG_C - (i - LOG_K))
            out = tl.reshape(h, [2**LOG_M, 2**LOG_K])
        return out

    @triton.jit(do_not_specialize=["M", "V", "H", "TOP_N"])  # sizes vary per call: one compile per config
    def _head_stats_kernel(
        h_ptr, w_ptr, y_ptr,  # hidden [M, H], weight [V, H], labels [M] int64
        lse_ptr, lp_ptr, gt_ptr, tie_ptr, top_ptr,  # outputs
        M, V, H,
        stride_hm, stride_hk, stride_wv, stride_wk, stride_top,
        TOP_N,  # columns of the top output actually stored
        TOP_K: tl.constexpr,  # running top width (power of two, or 0 for none)
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        LOG_M: tl.constexpr, LOG_V: tl.constexpr, LOG_K: tl.constexpr,  # log2 of the three widths
        DOT_FP32: tl.constexpr,  # fp32 IEEE products (fp32 inputs: never TF32; see launcher)
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        labels = tl.load(y_ptr + rows, mask=row_ok, other=0)
        ks0 = tl.arange(0, BLOCK_H)

        # 1. pivot p = <hidden[m], weight[y_m]> in fp32
        pivot = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + ks0
            mk = row_ok[:, None] & (ks < H)[None, :]
            a = tl.load(h_ptr + rows64[:, None] * stride_hm + ks[None, :] * stride_hk, mask=mk, other=0.0)
            b = tl.load(w_ptr + labels[:, None] * stride_wv + ks[None, :] * stride_wk, mask=mk, other=0.0)
            pivot += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)

        # 2. one stream over V
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        z_y = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_gt = tl.zeros([BLOCK_M], dtype=tl.int32)
        n_tie = tl.zeros([BLOCK_M], dtype=tl.int32)
        if TOP_K > 0:
            top = tl.full([BLOCK_M, TOP_K], float("-inf"), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < V
            cols64 = cols.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_H):
                ks = k0 + ks0
                k_ok = ks < H
                a = tl.load(
                    h_ptr + rows64[:, None] * stride_hm + ks[None, :] * stride_hk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                )
                b = tl.load(  # [BLOCK_H, BLOCK_V]: the weight tile, transposed by addressing
                    w_ptr + cols64[None, :] * stride_wv + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0,
                )
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            z = tl.where(col_ok[None, :], acc, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(z, axis=1))
            s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m_i = m_new

            is_y = cols[None, :] == labels[:, None]
            z_y += tl.sum(tl.where(is_y, z, 0.0), axis=1)
            n_gt += tl.sum(((z > pivot[:, None]) & (~is_y)).to(tl.int32), axis=1)
            n_tie += tl.sum(((z == pivot[:, None]) & (cols[None, :] < labels[:, None])).to(tl.int32), axis=1)

            if TOP_K > 0:
                kth = tl.min(top, axis=1)  # running list is sorted: min == TOP_K-th largest
                if tl.sum((z > kth[:, None]).to(tl.int32)) > 0:  # skip tiles with nothing new
                    best = _row_topk_ascending(z, LOG_M, LOG_V, LOG_K)  # [BLOCK_M, TOP_K]
                    # descending running list vs ascending tile best: their elementwise max
                    # is bitonic and holds the TOP_K largest of both; sort it descending
                    h = tl.reshape(tl.maximum(top, best), [2] * (LOG_M + LOG_K))
                    top = tl.reshape(_bitonic_merge(h, LOG_K, 1, LOG_M + LOG_K), [BLOCK_M, TOP_K])

        # 3. epilogue
        lse = m_i + tl.log(s_i)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        tl.store(lp_ptr + rows, z_y - lse, mask=row_ok)
        tl.store(gt_ptr + rows, n_gt, mask=row_ok)
        tl.store(tie_ptr + rows, n_tie, mask=row_ok)
        if TOP_K > 0:
            kk = tl.arange(0, TOP_K)
            tl.store(
                top_ptr + rows64[:, None] * stride_top + kk[None, :],
                top - lse[:, None],
                mask=row_ok[:, None] & (kk < TOP_N)[None, :],
            )


def _constexprs(top_n: int, block_m: int, block_v: int, block_h: int, dot_fp32: bool) -> dict:
    """Validates the launch configuration; returns the kernel's constexpr arguments."""
    if not 0 <= top_n <= MAX_KERNEL_TOP_N:
        raise ValueError(f"the Triton kernel keeps 0 <= top_n <= {MAX_KERNEL_TOP_N}; got {top_n}")
    for name, value in (("block_m", block_m), ("block_v", block_v), ("block_h", block_h)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16; got {value!r}")
    top_k = 1 << (top_n - 1).bit_length() if top_n > 0 else 0
    block_v = max(block_v, top_k)  # the tile top-k takes at most the tile width
    return {
        "TOP_K": top_k, "BLOCK_M": block_m, "BLOCK_V": block_v, "BLOCK_H": block_h,
        "LOG_M": block_m.bit_length() - 1, "LOG_V": block_v.bit_length() - 1,
        "LOG_K": max(top_k, 1).bit_length() - 1, "DOT_FP32": dot_fp32,
    }


def triton_head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    top_n: int,
    *,
    block_m: int = _BLOCK_M,
    block_v: int = _BLOCK_V,
    block_h: int = _BLOCK_H,
    num_warps: int = 8,
    num_stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the kernel on already validated inputs (see `head_stats.head_stats`).

    Returns (lse [M] fp32, label_logprob [M] fp32, label_rank [M] int64,
    label_order [M] int64, top_logprobs [M, top_n] fp32). Requires
    `0 <= top_n <= MAX_KERNEL_TOP_N`; block sizes are powers of two >= 16.
    Raises RuntimeError when triton is missing, or for CPU tensors outside the
    interpreter (TRITON_INTERPRET=1 set before this module was first imported).
    """
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package; install triton or use backend='torch'")
    if not hidden.is_cuda and not is_interpreted():
        raise RuntimeError(
            "backend='triton' on CPU tensors runs only in Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before triton is first imported, move the tensors to CUDA, or use backend='torch'"
        )
    m, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    # Triton 3.9's interpreter gets tl.dot of bfloat16 operands wrong; there the tiles
    # are upcast first (bf16 products are exact in fp32: the same math)
    dot_fp32 = hidden.dtype == torch.float32 or (hidden.dtype == torch.bfloat16 and is_interpreted())
    consts = _constexprs(top_n, block_m, block_v, block_h, dot_fp32)

    lse = torch.empty(m, dtype=torch.float32, device=dev)
    logprob = torch.empty(m, dtype=torch.float32, device=dev)
    n_gt = torch.empty(m, dtype=torch.int32, device=dev)
    n_tie = torch.empty(m, dtype=torch.int32, device=dev)
    top = torch.empty(m, top_n, dtype=torch.float32, device=dev)
    if m == 0:
        return lse, logprob, n_gt.long(), n_tie.long(), top
    labels = labels.contiguous()
    grid = (triton.cdiv(m, consts["BLOCK_M"]),)
    _head_stats_kernel[grid](
        hidden, weight, labels,
        lse, logprob, n_gt, n_tie, top,
        m, v, h,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), max(top.stride(0), 1),
        top_n,
        **consts,
        num_warps=num_warps, num_stages=num_stages,
    )
    rank = n_gt.long()
    return lse, logprob, rank, rank + n_tie.long(), top


_ARG_TYPES = {
    "h_ptr": "*{dt}", "w_ptr": "*{dt}", "y_ptr": "*i64",
    "lse_ptr": "*fp32", "lp_ptr": "*fp32", "gt_ptr": "*i32", "tie_ptr": "*i32", "top_ptr": "*fp32",
}
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_for_target(
    dtype: torch.dtype,
    top_n: int,
    *,
    arch: int = 90,
    block_m: int = _BLOCK_M,
    block_v: int = _BLOCK_V,
    block_h: int = _BLOCK_H,
    num_warps: int = 8,
    num_stages: int = 3,
):
    """Compiles the kernel ahead of time for CUDA compute capability `arch` (e.g. 90
    for H100/H200) without needing a GPU, so CI can check the compiled path.

    Returns triton's compiled kernel (`.asm` holds "ttir", "ttgir", "llir", "ptx",
    "cubin"). Needs a non-interpreted build of the kernel and triton's NVIDIA backend.
    """
    if triton is None or is_interpreted():
        raise RuntimeError("compile_for_target needs triton imported without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"dtype must be one of {list(_TRITON_DTYPES)}; got {dtype}")
    consts = _constexprs(top_n, block_m, block_v, block_h, dtype == torch.float32)
    names = _head_stats_kernel.arg_names
    signature = {
        n: "constexpr" if n in consts else _ARG_TYPES.get(n, "i32").format(dt=_TRITON_DTYPES[dtype]) for n in names
    }
    src = ASTSource(
        fn=_head_stats_kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in consts.items()},
    )
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
