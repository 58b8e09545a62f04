"""Fused LM-head statistics in Triton, split over rows and vocabulary: the LM-head
matmul, logsumexp, the label's log-prob, rank and tie order and the top-N logits,
without ever writing the [M, V] logits.

Contract: the same as `head_stats.head_stats_reference` (see `head_stats.py`), for
`0 <= top_n <= MAX_KERNEL_TOP_N`; `head_stats.head_stats` routes larger `top_n` to the
chunked torch path.

Two passes:

1. `_split_kernel` on a grid of (row tiles of BLOCK_M) x (vocabulary splits of
   `split_width` columns, a multiple of BLOCK_V). Program (i, s):
   a. The pivot p = z_y of each of its rows, computed by the same function as every
      logit tile (`_logit_tile`: `tl.dot` over BLOCK_H-wide slices of H in the same
      order) applied to the rows' label columns; p is the diagonal of that tile. So p
      is bitwise the value the tile holding y computes, and a token tied with y in
      the kernel's logits (e.g. a duplicate of y's weight row) counts as a tie. The
      tests check p == z_y bitwise (`SplitPartials.pivot`), in the interpreter and
      on CUDA.
   b. One stream over its split in tiles of BLOCK_V columns: z = hidden @ weight.T by
      `tl.dot` with fp32 accumulation (bf16/fp16 operands straight into the tensor
      cores; fp32 operands with input_precision="ieee", never TF32); online
      logsumexp (running max, rescaled sum); the label's logit from the tile that
      holds y; #{v != y : z_v > p} and #{v < y : z_v == p}; the running top-N.
   c. Writes its partials (`split_merge.SplitPartials`).
2. `split_merge.merge_splits` (torch ops): log-add-exp of the splits, summed counts,
   top-N of the union of the split lists, label_logprob = z_y - lse.

Running top-N: per row a list of TOP_K = max(8, next_power_of_two(top_n)) register
slots, the first top_n live (start at -inf), the rest pinned at +inf so they are never
the minimum; kth = min of the list. A tile whose row maxima (computed for the
logsumexp anyway) are all <= kth costs nothing more: the common case once a split is
under way. Otherwise, while some row took a value in the last round, every row takes
its largest remaining logit above kth (ties: lowest column first; "remaining" =
ordered after the last one it took) into the slot holding kth and recomputes kth: at
most top_n + 1 rounds per tile, usually one or two. Values only, in no order: the
merge sorts. Only max/min reductions and selects, which stay vectorised in the
interpreter (tl.sort / tl.topk reduce with an xor-sum that the interpreter runs per
element in Python: minutes per call).

Split count (`split_plan`): enough splits that the grid holds about
PROGRAMS_PER_SM x (streaming multiprocessors) programs, each split at least
MIN_TILES_PER_SPLIT tiles wide (the pivot tile and the first fill of the top-N list
are per-split overheads); one split when V is small. At the production size (one
task: ~7,700 rows, V = 248,320, BLOCK_M = BLOCK_V = 128, 132 SMs) that is 60 row tiles
x 18 splits of 108 tiles.

Tile configuration (`TILE_CONFIGS`): one per operand width, a heuristic table rather
than `triton.autotune` (autotuning keyed on M would re-tune for every task length,
and every config costs a compile on a fresh machine). The 16-bit entry is sized for
Hopper wgmma (128 x 128 tiles, BLOCK_H 64, two warpgroups); neither entry has been
timed on a GPU yet: `benchmarks/bench_kernels.py --triton-configs` times alternatives.
Offline facts (Triton 3.9, sm_90 cubin, `compile_for_target` + cuobjdump): the bf16
entry pipelines the K loop (cp.async, 3 stages, 96 KiB shared) into wgmma and uses
255 registers with a 32-byte spill stack; 64 x 128 x 64 with 8 warps uses 196 and
does not spill.

Interpreter (TRITON_INTERPRET=1, CPU tensors): `_logit_tile` does not use `tl.dot` there
(constexpr INTERPRETED), for two reasons. The interpreter's `tl.dot` is `np.matmul`, and
numpy's fp32 matmul (OpenBLAS sgemm) rounds an output element differently depending on
the column it sits in: with the fp32 tiles (64 x 32 x 128) one weight row can give logits
that differ in the last bit at tile columns 0-7 and 8-119, so a duplicate of y's row
was not tied with the pivot (computed at another column) and label_order came out one
short. And Triton 3.9's interpreter computes `tl.dot` of bfloat16 operands wrongly.
Instead each BLOCK_H slice is multiplied out in fp64 (the products of fp32, fp16 and
bf16 values are exact there) and summed by `tl.sum` over the slice (numpy's reduction
runs the same loop for every output element), the slices accumulate in fp64 and the
tile is rounded to fp32 once: each logit depends on its row and column values alone,
never on where they sit, so duplicates tie exactly as the design above needs. The
values can differ from the CUDA path's fp32 accumulation in the last bits (the tests'
tolerances); the CUDA kernel is unchanged (the branch is compiled out). Interpreter
mode is fixed when the kernel is decorated, i.e. when this module is first imported:
TRITON_INTERPRET=1 must be in the environment by then. Triton is imported guarded:
without it this module imports, `is_available()` is False and the launchers raise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .split_merge import SplitPartials, merge_splits

try:  # guarded: the package must import on machines without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

MAX_KERNEL_TOP_N = 64
"""The largest top_n the kernel keeps in registers itself."""
PROGRAMS_PER_SM = 8
"""Target grid size of `split_plan`, in programs per streaming multiprocessor."""
MIN_TILES_PER_SPLIT = 8
"""The narrowest split `split_plan` makes, in BLOCK_V tiles."""


class TileConfig(NamedTuple):
    block_m: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int


TILE_CONFIGS = {  # unmeasured heuristics (see module doc)
    "16bit": TileConfig(block_m=128, block_v=128, block_h=64, num_warps=8, num_stages=3),
    "fp32": TileConfig(block_m=64, block_v=128, block_h=32, num_warps=8, num_stages=3),
}


def default_config(dtype: torch.dtype) -> TileConfig:
    return TILE_CONFIGS["fp32" if dtype == torch.float32 else "16bit"]


def is_available() -> bool:
    """True when triton imported."""
    return triton is not None


def is_interpreted() -> bool:
    """True when the kernel was built in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and type(_split_kernel).__name__ == "InterpretedFunction"


def split_plan(m: int, v: int, block_m: int, block_v: int, sm_count: int) -> tuple[int, int]:
    """(number of splits, split width in columns) for M rows and V columns (see module doc)."""
    row_tiles = -(-max(m, 1) // block_m)
    v_tiles = -(-v // block_v)
    splits = min(max(1, v_tiles // MIN_TILES_PER_SPLIT), -(-PROGRAMS_PER_SM * sm_count // row_tiles))
    return fixed_splits(v, block_v, max(splits, 1))


def fixed_splits(v: int, block_v: int, splits: int) -> tuple[int, int]:
    """(splits, width) for about `splits` equal splits of whole tiles (fewer when V has
    fewer tiles than that); every split holds at least one column."""
    v_tiles = -(-v // block_v)
    width = -(-v_tiles // min(splits, v_tiles)) * block_v
    return -(-v // width), width


if triton is not None:

    @triton.jit
    def _logit_tile(
        h_ptr, w_ptr, rows64, row_ok, cols64, col_ok, H,
        stride_hm, stride_hk, stride_wv, stride_wk,
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_FP32: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """z [BLOCK_M, BLOCK_V] fp32 = hidden[rows] @ weight[cols].T (masked entries 0). In the
        interpreter: fp64 products summed per element, one rounding to fp32 (see module doc)."""
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float64 if INTERPRETED else tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < H
            a = tl.load(
                h_ptr + rows64[:, None] * stride_hm + ks[None, :] * stride_hk,
                mask=row_ok[:, None] & k_ok[None, :], other=0.0,
            )
            b = tl.load(
                w_ptr + cols64[:, None] * stride_wv + ks[None, :] * stride_wk,
                mask=col_ok[:, None] & k_ok[None, :], other=0.0,
            )
            if INTERPRETED:  # not tl.dot, which is np.matmul there: the same column at every tile position
                acc += tl.sum(a.to(tl.float64)[:, None, :] * b.to(tl.float64)[None, :, :], axis=2)
            elif DOT_FP32:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        return acc.to(tl.float32)

    @triton.jit(do_not_specialize=["M", "V", "SPLIT_V", "TOP_N"])  # vary per call: one compile per config
    def _split_kernel(
        h_ptr, w_ptr, y_ptr,  # hidden [M, H], weight [V, H], labels [M] int64
        max_ptr, sum_ptr, zy_ptr, gt_ptr, tie_ptr, top_ptr, piv_ptr,  # partials [S, M] ([S, M, TOP_N])
        M, V, H, SPLIT_V, TOP_N,
        stride_hm, stride_hk, stride_wv, stride_wk,
        TOP_K: tl.constexpr,  # register slots of the running top list (0: no list)
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        DOT_FP32: tl.constexpr,  # upcast the operands and use IEEE fp32 products (see launcher)
        INTERPRETED: tl.constexpr,  # Triton's CPU interpreter: position-independent fp64 sums (see module doc)
    ):
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        labels = tl.load(y_ptr + rows, mask=row_ok, other=0)
        jj = tl.arange(0, BLOCK_V)

        # a. pivot: the diagonal of the logit tile of the rows' own label columns
        lab_ok = (jj < BLOCK_M) & (row0 + jj < M)
        lab_cols = tl.load(y_ptr + row0 + jj, mask=lab_ok, other=0)
        zp = _logit_tile(h_ptr, w_ptr, rows64, row_ok, lab_cols.to(tl.int64), lab_ok, H,
                         stride_hm, stride_hk, stride_wv, stride_wk, BLOCK_M, BLOCK_V, BLOCK_H, DOT_FP32,
                         INTERPRETED)
        pivot = tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == jj[None, :], zp, 0.0), axis=1)

        # b. one stream over this split's columns
        v_start = pid_s * SPLIT_V
        v_end = tl.minimum(V, v_start + SPLIT_V)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        z_y = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_gt = tl.zeros([BLOCK_M], dtype=tl.int32)
        n_tie = tl.zeros([BLOCK_M], dtype=tl.int32)
        if TOP_K > 0:
            kk = tl.arange(0, TOP_K)
            top = tl.zeros([BLOCK_M, TOP_K], dtype=tl.float32) + tl.where(kk < TOP_N, float("-inf"), float("inf"))[None, :]
            kth = tl.min(top, axis=1)
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + jj
            col_ok = cols < v_end
            acc = _logit_tile(h_ptr, w_ptr, rows64, row_ok, cols.to(tl.int64), col_ok, H,
                              stride_hm, stride_hk, stride_wv, stride_wk, BLOCK_M, BLOCK_V, BLOCK_H, DOT_FP32,
                              INTERPRETED)
            z = tl.where(col_ok[None, :], acc, float("-inf"))

            row_max = tl.max(z, axis=1)
            m_new = tl.maximum(m_i, row_max)
            s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m_i = m_new

            is_y = cols[None, :] == labels[:, None]
            z_y += tl.sum(tl.where(is_y, z, 0.0), axis=1)
            n_gt += tl.sum(((z > pivot[:, None]) & (~is_y)).to(tl.int32), axis=1)
            n_tie += tl.sum(((z == pivot[:, None]) & (cols[None, :] < labels[:, None])).to(tl.int32), axis=1)

            if TOP_K > 0:
                # insert the tile's logits above kth, largest first (ties: lowest column
                # first); (last, last_j) is the latest one taken, so the candidates left
                # are those ordered after it and still above kth
                last = tl.full([BLOCK_M], float("inf"), dtype=tl.float32)
                last_j = tl.full([BLOCK_M], -1, dtype=tl.int32)
                more = tl.max((row_max > kth).to(tl.int32)) > 0
                while more:
                    after = (z < last[:, None]) | ((z == last[:, None]) & (jj[None, :] > last_j[:, None]))
                    cand = after & (z > kth[:, None])
                    best = tl.max(tl.where(cand, z, float("-inf")), axis=1)
                    first = tl.min(tl.where(cand & (z == best[:, None]), jj[None, :], BLOCK_V), axis=1)
                    take = best > kth
                    slot = tl.min(tl.where(top == kth[:, None], kk[None, :], TOP_K), axis=1)
                    top = tl.where((kk[None, :] == slot[:, None]) & take[:, None], best[:, None], top)
                    kth = tl.min(top, axis=1)
                    last = tl.where(take, best, last)
                    last_j = tl.where(take, first, last_j)
                    more = tl.max(take.to(tl.int32)) > 0

        # c. partials of (split, rows)
        out = pid_s.to(tl.int64) * M + rows64
        tl.store(max_ptr + out, m_i, mask=row_ok)
        tl.store(sum_ptr + out, s_i, mask=row_ok)
        tl.store(zy_ptr + out, z_y, mask=row_ok)
        tl.store(gt_ptr + out, n_gt, mask=row_ok)
        tl.store(tie_ptr + out, n_tie, mask=row_ok)
        tl.store(piv_ptr + out, pivot, mask=row_ok)
        if TOP_K > 0:
            tl.store(top_ptr + out[:, None] * TOP_N + kk[None, :], top,
                     mask=row_ok[:, None] & (kk < TOP_N)[None, :])


def _constexprs(top_n: int, config: TileConfig, dot_fp32: bool, interpreted: bool = False) -> dict:
    """Validates the launch configuration; returns the kernel's constexpr arguments."""
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= MAX_KERNEL_TOP_N:
        raise ValueError(f"the Triton kernel keeps 0 <= top_n <= {MAX_KERNEL_TOP_N}; got {top_n!r}")
    for name in ("block_m", "block_v", "block_h"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16; got {value!r}")
    if config.block_v < config.block_m:
        raise ValueError(f"block_v must be >= block_m (the pivot tile holds one label column per row); got {config}")
    top_k = max(8, 1 << (top_n - 1).bit_length()) if top_n > 0 else 0
    return {"TOP_K": top_k, "BLOCK_M": config.block_m, "BLOCK_V": config.block_v, "BLOCK_H": config.block_h,
            "DOT_FP32": dot_fp32, "INTERPRETED": interpreted}


def triton_head_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    top_n: int,
    *,
    config: TileConfig | None = None,
    num_splits: int | None = None,
) -> tuple[SplitPartials, int]:
    """Launches `_split_kernel` on already validated inputs; returns (partials, split
    width). `config` defaults to `default_config(dtype)`; `num_splits` to `split_plan`.
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
    config = config or default_config(hidden.dtype)
    m, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    # the interpreter gets its own logit tiles (see module doc); DOT_FP32 picks the CUDA dot
    consts = _constexprs(top_n, config, hidden.dtype == torch.float32, is_interpreted())
    if num_splits is None:
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if hidden.is_cuda else 1
        splits, width = split_plan(m, v, config.block_m, config.block_v, sm_count)
    else:
        splits, width = fixed_splits(v, config.block_v, num_splits)

    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    parts = SplitPartials(
        torch.empty(splits, m, **f32), torch.empty(splits, m, **f32), torch.empty(splits, m, **f32),
        torch.empty(splits, m, **i32), torch.empty(splits, m, **i32), torch.empty(splits, m, top_n, **f32),
        torch.empty(splits, m, **f32),
    )
    if m == 0:
        return parts, width
    labels = labels.contiguous()
    grid = (triton.cdiv(m, config.block_m), splits)
    with torch.cuda.device_of(hidden):  # Triton launches on the current device: make it the tensors' (restored after)
        _split_kernel[grid](
            hidden, weight, labels,
            parts.max, parts.sum_exp, parts.label_logit, parts.n_greater, parts.n_tied_below, parts.top, parts.pivot,
            m, v, h, width, top_n,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            **consts,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return parts, width


def triton_head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    top_n: int,
    *,
    config: TileConfig | None = None,
    num_splits: int | None = None,
):
    """The five statistics (a `head_stats.HeadStats`) from the kernel and the merge,
    for `0 <= top_n <= MAX_KERNEL_TOP_N` (see `triton_head_partials` for the options)."""
    parts, width = triton_head_partials(hidden, weight, labels, top_n, config=config, num_splits=num_splits)
    return merge_splits(parts, labels.long(), width, top_n)


_ARG_TYPES = {
    "h_ptr": "*{dt}", "w_ptr": "*{dt}", "y_ptr": "*i64",
    "max_ptr": "*fp32", "sum_ptr": "*fp32", "zy_ptr": "*fp32", "gt_ptr": "*i32", "tie_ptr": "*i32",
    "top_ptr": "*fp32", "piv_ptr": "*fp32",
}
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_for_target(dtype: torch.dtype, top_n: int, *, arch: int = 90, config: TileConfig | None = None):
    """Compiles the kernel ahead of time for CUDA compute capability `arch` (e.g. 90
    for H100/H200) without needing a GPU, so CI can check the compiled path.

    Compiles the variant a launch on contiguous inputs with H a multiple of 16 gets:
    unit inner strides as constants, pointers, H and row strides 16-divisible (Triton
    specialises those at launch; without them it cannot pipeline the K loop). Returns
    triton's compiled kernel (`.asm` holds "ttir", "ttgir", "llir", "ptx", "cubin").
    Needs a non-interpreted build of the kernel and triton's NVIDIA backend.
    """
    if triton is None or is_interpreted():
        raise RuntimeError("compile_for_target needs triton imported without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"dtype must be one of {list(_TRITON_DTYPES)}; got {dtype}")
    config = config or default_config(dtype)
    consts = {**_constexprs(top_n, config, dtype == torch.float32), "stride_hk": 1, "stride_wk": 1}
    names = _split_kernel.arg_names
    signature = {
        n: "constexpr" if n in consts else _ARG_TYPES.get(n, "i32").format(dt=_TRITON_DTYPES[dtype]) for n in names
    }
    aligned = [n for n in names if n.endswith("_ptr") or n in ("H", "stride_hm", "stride_wv")]
    src = ASTSource(
        fn=_split_kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
