"""Triton kernels and launcher for ``fusenorm::norm_mm`` ("Lazy Pre-Norm"): ``c = norm(a) @ b + bias``.

Semantics are those of ``norm_mm_reference`` (ops/norm_mm.py): the norm runs over a's K columns in fp32, its affine
(weight, norm_bias) applies before the GEMM, the GEMM accumulates in fp32, c is rounded once to ``out_dtype``;
mean (fp32 [M], 0-size for RMSNorm) and rstd (fp32 [M]) are returned for the backward.

The norm is never applied to A. Row scaling commutes with the matmul, and the affine folds into B
(docs/algorithms.md section 2), so on the host (``fold_norm_affine``):
    b'     = weight[:, None] * b            rounded once to a's dtype (the tensor cores' operand type)
    bias'  = bias + norm_bias @ b           fp32 [N]
    colsum = sum_k b'[k, :]                 fp32 [N], from the *rounded* b', so the rank-1 correction below
                                            subtracts exactly what the GEMM added
and each [BLOCK_M, BLOCK_N] tile of c is one GEMM tile acc = a @ b' (fp32) plus an epilogue:
    RMSNorm:   c = rstd * acc + bias'
    LayerNorm: c = rstd * (acc - mean * colsum) + bias'
The row statistics come from the A tiles the K loop reads for the GEMM anyway (CUDA-core reductions beside
the MMA; on the TMA path through their own loads of the tile, which hit L2: ``_tma_k_loop`` says why). The
pointer kernel and the TMA kernel's flattened walk recompute them in every N tile of a row block; the
row-block walk computes them in its first N tile only; the first tile stores mean and rstd.

Statistics (fp32):
- RMSNorm: rstd = rsqrt(sum_k a^2 / K + eps).
- LayerNorm, one pass with a per-row shift: p = a[row, 0] (a sample of the row), s1 = sum_k (a - p),
  s2 = sum_k (a - p)^2, mean = p + s1 / K, var = max(s2 / K - (s1 / K)^2, 0). A plain one-pass
  E[a^2] - E[a]^2 cancels catastrophically when |mean| >> std (rows of 1000 + N(0, 1): E[a^2] ~ 1e6, whose
  fp32 rounding alone is ~0.06 of var = 1); shifted by a sample of the row, s2 / K ~ var + (p - mean)^2 stays
  of the order of var. Zero-padded K columns would add (0 - p) to s1, so they are masked out.

Numerics of c (besides the final rounding): b' carries one rounding of w * b to a's dtype (the unfused graph
instead rounds y = norm(a) * w before its GEMM: the same order of error, u * sum_k |y_k b'_k|); fp16/bf16
products are exact in fp32. LayerNorm's rank-1 correction cancels: acc and mean * colsum are both
~|mean| * |colsum|, so their fp32 rounding errors (~u32 * |mean| * sum_k |b'_k| * sqrt(K)) reach c multiplied
by rstd. That is harmless while |mean| * rstd is moderate (|mean| / std = 1000: ~1e-4 of |c|), but for rows
nearly constant around a large mean (std << sqrt(eps)) rstd -> rsqrt(eps) amplifies it, where the unfused
norm would give exactly 0 before its GEMM. fp32 operands with TF32 allowed (``dot_input_precision``): the MMA
rounds a and b' to TF32 (u = 2^-11) while mean and colsum are exact fp32, so the correction leaves
~u * |mean| * rstd * sum_k |b'_k| behind: like the unfused TF32 GEMM of y when |mean| <~ std, |mean| / std
times worse beyond. (16-bit operands are exact in the MMA; only fp32 accumulation rounds.)

The kernels behind ``norm_mm_triton``, which runs the configuration (``GemmConfig``) it is given and asks
no tuning: the op's CUDA path (ops/norm_mm.py) passes the one ``prenorm_config`` picks among
``prenorm_candidates`` (tuning/norm_mm.py, which also holds the tile sizes quoted below):
- kind "tma" (Hopper, 16-bit, ``tma_layout`` not None: A row-major, b' = W.T of a row-major weight or a
  row-major [K, N], 16-byte aligned rows): ``_norm_mm_fwd_tma_kernel``, a persistent TMA-fed kernel (host-side
  descriptors; out-of-bounds boxes read as 0) with one flattened loop over (row block, N tile) tiles, N tiles
  of a row block adjacent (they share A in L2); kind "tma_rows": the same kernel walking whole row blocks,
  statistics once per row block (``_norm_mm_fwd_tma_kernel``). Row sums as [BLOCK_M] vectors or
  [BLOCK_M, BLOCK_K] partials (``_tile_sums``), no K mask when K % BLOCK_K == 0.
  128 x 128 or 128 x 256 tiles, BLOCK_K 64, 8 warps, 3 stages
  (``tma_config`` drops stages, then rows, to fit shared memory next to the c staging tile: an fp32 c gets
  64 x 256); c leaves through a TMA store when its row pitch allows (``tma_store_ok``), else, or when the
  compiler reports the staging tile does not fit (OutOfResources, remembered), through pointer stores.
- kinds "gl_coop" / "gl_pp" / "gl_rows" (sm_90, 16-bit, TMA-readable operands, output in a's dtype;
  ``gluon_unsupported`` in tuning/norm_mm.py): the Gluon GEMM core with its row-statistics mainloop
  (kernels/hopper/norm_mm.py), first among the candidates, on operands folded in one launch
  (``fold_one_launch``); a specialization that spills is never launched: the launcher raises ``SpillError``
  (kernels/hopper/mm_norm.py) and the op runs the tl kernels' first choice instead.
- kind "ptr": ``_norm_mm_fwd_kernel``, masked pointer loads, any strides and dtypes (fp32 too), one program
  per tile (``pointer_config``). It runs in the CPU interpreter; the TMA kernel does too when
  ``common._FORCE_TMA`` (kernels/triton/common.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..fold import fold_norm_affine
from .common import (
    GemmConfig,
    dot_input_precision,
    gemm_num_warps,
    launch_with_tma_store,
    num_sms,
    pow2_at_least,
    tensor_descriptor,
    tma_descriptors,
    tma_layout,
)

__all__ = ["fold_norm_affine", "fold_one_launch", "norm_mm_triton", "normed_triton", "pointer_config"]


PTR_BLOCK_N = 128  # widest N tile of the pointer kernel (a 128 x 128 fp32 accumulator at 8 warps)
# Row sums as [BLOCK_M, BLOCK_K] partials (True) or reduced every K step (False); None: ``_tile_sums`` decides.
# A probe hook (benchmarks/probes/probe_prenorm.py); tests leave it None.
TILE_SUMS_OVERRIDE: Optional[bool] = None


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _row_pivot(a_ptr, rows, M, stride_am, IS_RMS: tl.constexpr, BLOCK_M: tl.constexpr):
    """LayerNorm's per-row shift p = a[row, 0] in fp32 (0 for rows past M); RMSNorm needs none (0)."""
    if IS_RMS:
        pivot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        pivot = tl.load(a_ptr + rows * stride_am, mask=rows < M, other=0.0).to(tl.float32)
    return pivot


@triton.jit
def _accumulate_row_stats(a, pivot, k_ok, s1, s2, IS_RMS: tl.constexpr, TILE_SUMS: tl.constexpr,
                          EVEN_K: tl.constexpr):
    """Adds one [BLOCK_M, BLOCK_K] A tile (0 outside the matrix) to the row sums: RMSNorm s2 += a^2;
    LayerNorm s1 += a - p, s2 += (a - p)^2 over the valid columns (k_ok) only.

    s1/s2 are [BLOCK_M] (each step reduces across the tile's columns: shuffles between threads) or, with
    TILE_SUMS, [BLOCK_M, BLOCK_K] (elementwise partial sums, one reduction after the K loop: no shuffles in
    the loop, at the cost of registers). EVEN_K: K is a multiple of BLOCK_K, nothing to mask.
    """
    x = a.to(tl.float32)
    if IS_RMS:
        d = x
    elif EVEN_K:
        d = x - pivot[:, None]
    else:
        # A padded column reads 0, but 0 - p is not 0: mask it.
        d = tl.where(k_ok[None, :], x - pivot[:, None], 0.0)
    if TILE_SUMS:
        s2 += d * d
        if not IS_RMS:
            s1 += d
    else:
        s2 += tl.sum(d * d, axis=1)
        if not IS_RMS:
            s1 += tl.sum(d, axis=1)
    return s1, s2


@triton.jit
def _row_stats(s1, s2, pivot, K, eps, IS_RMS: tl.constexpr, TILE_SUMS: tl.constexpr):
    """(mean, rstd) from the row sums ([BLOCK_M], or with TILE_SUMS [BLOCK_M, BLOCK_K] partials reduced
    here); for RMSNorm mean is a placeholder (rstd), never stored."""
    if TILE_SUMS:
        s2 = tl.sum(s2, axis=1)
        if not IS_RMS:
            s1 = tl.sum(s1, axis=1)
    if IS_RMS:
        rstd = tl.rsqrt(s2 / K + eps)
        mean = rstd
    else:
        shift = s1 / K  # mean - p, of the order of the row's spread
        mean = pivot + shift
        # Rounding can push the difference a hair below 0 for (nearly) constant rows.
        var = tl.maximum(s2 / K - shift * shift, 0.0)
        rstd = tl.rsqrt(var + eps)
    return mean, rstd


@triton.jit
def _store_row_stats(mean, rstd, rows, M, mean_ptr, rstd_ptr, store, IS_RMS: tl.constexpr):
    """Writes the rows' mean (LayerNorm) and rstd when ``store`` (once per row block)."""
    stat_mask = (rows < M) & store
    if not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=stat_mask)
    tl.store(rstd_ptr + rows, rstd, mask=stat_mask)


@triton.jit
def _norm_epilogue(acc, mean, rstd, cols, N, colsum_ptr, bias_ptr, stride_bias,
                   HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr):
    """c = rstd * acc (RMSNorm) or rstd * (acc - mean * colsum) (LayerNorm), + bias', in fp32."""
    mask_n = cols < N
    if IS_RMS:
        c = acc * rstd[:, None]
    else:
        colsum = tl.load(colsum_ptr + cols, mask=mask_n, other=0.0)
        c = (acc - mean[:, None] * colsum[None, :]) * rstd[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=mask_n, other=0.0)
        c += bias.to(tl.float32)[None, :]
    return c


@triton.jit
def _norm_mm_fwd_kernel(
    a_ptr, b_ptr, colsum_ptr, bias_ptr, c_ptr, mean_ptr, rstd_ptr,
    M, N, K, n_tiles_n,
    stride_am, stride_ak, stride_bk, stride_bn, stride_bias, stride_cm,
    eps,
    HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Tile (pid_m, pid_n) of c = norm(a) @ b (module docstring) with masked pointer loads, any strides.

    Grid: cdiv(M, BLOCK_M) * n_tiles_n programs, the N tiles of a row block adjacent. b is b' (the affine
    folded in); masked loads give 0 past M, N and K, so padded rows/columns of acc stay 0.
    """
    pid = tl.program_id(0)
    pid_m = pid // n_tiles_n
    pid_n = pid % n_tiles_n
    # int64 indices: row * stride and k * stride must not overflow int32.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = rows < M
    mask_n = cols < N
    a_rows = a_ptr + rows[:, None] * stride_am
    b_cols = b_ptr + cols[None, :] * stride_bn
    pivot = _row_pivot(a_ptr, rows, M, stride_am, IS_RMS, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        s1, s2 = _accumulate_row_stats(a, pivot, k_ok, s1, s2, IS_RMS, False, False)
    mean, rstd = _row_stats(s1, s2, pivot, K, eps, IS_RMS, False)
    _store_row_stats(mean, rstd, rows, M, mean_ptr, rstd_ptr, pid_n == 0, IS_RMS)
    c = _norm_epilogue(acc, mean, rstd, cols, N, colsum_ptr, bias_ptr, stride_bias, HAS_BIAS, IS_RMS)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], c.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tma_k_loop(a_desc, b_desc, a_ptr, rows, M, stride_am, off_m, off_n, K, pivot, STATS: tl.constexpr,
                IS_RMS: tl.constexpr, TILE_SUMS: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_KN: tl.constexpr):
    """acc = a[off_m tile, :] @ b'[:, off_n tile] (fp32) through TMA loads, and with STATS the row sums of
    the same A tiles (``_accumulate_row_stats``; [BLOCK_M, BLOCK_K] partials when TILE_SUMS).

    The row sums read A through their own pointer loads (L2 hits: the TMA load of the same tile is in
    flight), not from the tile the MMA consumes. Summing the TMA-loaded tile itself is faster but wrong on
    the H200 under Triton 3.6: with 128 x 256 tiles, 2 or 3 stages, either walk, 0.1-10% of c came out
    garbage, differently from launch to launch (a race between the register reads of the shared-memory
    tile and the pipeline's reuse of its buffer; benchmarks/results/probe_prenorm_race_h200.txt). A CTA barrier
    after the sums fixes it at 1.5-4x the time; separate loads fix it for 2-15%."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TILE_SUMS:
        s1 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    else:
        s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, ki * BLOCK_K])
        if B_KN:
            b = b_desc.load([ki * BLOCK_K, off_n])
        else:
            b = b_desc.load([off_n, ki * BLOCK_K]).T
        acc = tl.dot(a, b, acc)
        if STATS:
            ks = ki * BLOCK_K + offs_k
            a_s = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :],
                          mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
            s1, s2 = _accumulate_row_stats(a_s, pivot, ks < K, s1, s2, IS_RMS, TILE_SUMS, EVEN_K)
    return acc, s1, s2


@triton.jit
def _tma_store_tile(c, rows, cols, off_m, off_n, M, N, c_ptr, c_desc, stride_cm, C_TMA: tl.constexpr):
    """Writes one fp32 tile of c: TMA store (clipped at M and N) when C_TMA, else masked pointer stores."""
    if C_TMA:
        c_desc.store([off_m, off_n], c.to(c_desc.dtype))
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], c.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_mm_fwd_tma_kernel(
    a_desc, b_desc, a_ptr, colsum_ptr, bias_ptr, c_ptr, c_desc, mean_ptr, rstd_ptr,
    M, N, K,
    stride_am, stride_bias, stride_cm,
    eps,
    HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGS: tl.constexpr,
    B_KN: tl.constexpr, C_TMA: tl.constexpr, ROW_BLOCKS: tl.constexpr, TILE_SUMS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The same tiles as ``_norm_mm_fwd_kernel`` on Hopper: A and b' fed by TMA (host-side descriptors; b'
    read from a [K, N] descriptor when B_KN, else from the [N, K] descriptor of its transpose), NUM_PROGS
    persistent programs. C_TMA: c leaves through a TMA store, else masked pointer stores.

    Two walks over the tiles:
    - ROW_BLOCKS (kind "tma_rows"): each program takes whole row blocks. The first N tile's K loop also sums
      the rows' statistics; the row block's other N tiles reuse them and run a plain GEMM loop. Statistics
      cost once per row block instead of once per tile (what matters when N spans several tiles).
    - else (kind "tma"): one flattened loop over all (row block, N tile) tiles, each recomputing its rows'
      statistics; the next tile's loads overlap this one's epilogue.
    """
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    if ROW_BLOCKS:
        for rb in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_PROGS):
            off_m = rb * BLOCK_M
            rows = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride must not overflow
            pivot = _row_pivot(a_ptr, rows, M, stride_am, IS_RMS, BLOCK_M)
            acc, s1, s2 = _tma_k_loop(a_desc, b_desc, a_ptr, rows, M, stride_am, off_m, 0, K, pivot, True, IS_RMS,
                                      TILE_SUMS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
            mean, rstd = _row_stats(s1, s2, pivot, K, eps, IS_RMS, TILE_SUMS)
            _store_row_stats(mean, rstd, rows, M, mean_ptr, rstd_ptr, True, IS_RMS)
            cols = tl.arange(0, BLOCK_N).to(tl.int64)
            c = _norm_epilogue(acc, mean, rstd, cols, N, colsum_ptr, bias_ptr, stride_bias, HAS_BIAS, IS_RMS)
            _tma_store_tile(c, rows, cols, off_m, 0, M, N, c_ptr, c_desc, stride_cm, C_TMA)
            for pid_n in range(1, n_tiles_n):
                off_n = pid_n * BLOCK_N
                acc, _, _ = _tma_k_loop(a_desc, b_desc, a_ptr, rows, M, stride_am, off_m, off_n, K, pivot, False,
                                        IS_RMS, False, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
                cols = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
                c = _norm_epilogue(acc, mean, rstd, cols, N, colsum_ptr, bias_ptr, stride_bias, HAS_BIAS,
                                   IS_RMS)
                _tma_store_tile(c, rows, cols, off_m, off_n, M, N, c_ptr, c_desc, stride_cm, C_TMA)
    else:
        for t in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * n_tiles_n, NUM_PROGS, flatten=True):
            pid_n = t % n_tiles_n
            off_m = (t // n_tiles_n) * BLOCK_M
            off_n = pid_n * BLOCK_N
            rows = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
            pivot = _row_pivot(a_ptr, rows, M, stride_am, IS_RMS, BLOCK_M)
            acc, s1, s2 = _tma_k_loop(a_desc, b_desc, a_ptr, rows, M, stride_am, off_m, off_n, K, pivot, True,
                                      IS_RMS, TILE_SUMS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
            mean, rstd = _row_stats(s1, s2, pivot, K, eps, IS_RMS, TILE_SUMS)
            _store_row_stats(mean, rstd, rows, M, mean_ptr, rstd_ptr, pid_n == 0, IS_RMS)
            c = _norm_epilogue(acc, mean, rstd, cols, N, colsum_ptr, bias_ptr, stride_bias, HAS_BIAS, IS_RMS)
            _tma_store_tile(c, rows, cols, off_m, off_n, M, N, c_ptr, c_desc, stride_cm, C_TMA)


@triton.jit
def _normed_kernel(
    a_ptr, mean_ptr, rstd_ptr, w_ptr, nb_ptr, y_ptr, M, K, stride_am, stride_ak, stride_ym,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_NB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = norm(a) * w + nb from the saved row statistics, fp32 math, rounded once to y's dtype
    (``fusenorm::mm_normed``'s rebuilt operand: one read of a, one write of y, no fp32 temporaries)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m, mask_k = rows < M, cols < K
    mask = mask_m[:, None] & mask_k[None, :]
    a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :] * stride_ak, mask=mask, other=0.0)
    y = a.to(tl.float32)
    if not IS_RMS:
        y -= tl.load(mean_ptr + rows, mask=mask_m, other=0.0)[:, None]
    y *= tl.load(rstd_ptr + rows, mask=mask_m, other=0.0)[:, None]
    if HAS_W:
        y *= tl.load(w_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    if HAS_NB:
        y += tl.load(nb_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fold_kernel(b_ptr, w_ptr, nb_ptr, bias_ptr, bf_ptr, biasf_ptr, colsum_ptr, K, N,
                 stride_bk, stride_bn, stride_fk, stride_fn,
                 HAS_W: tl.constexpr, HAS_NB: tl.constexpr, HAS_BIAS: tl.constexpr, COLSUM: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``fold_norm_affine`` in one launch for a block of columns (``fold_one_launch``): b' = w * b rounded
    once to b's dtype, colsum = the column sums of the rounded b', bias' = norm_bias @ b + bias (fp32)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    colsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    nbsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        mask = kmask[:, None] & cmask[None, :]
        b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
            bf = (b * w[:, None]).to(bf_ptr.dtype.element_ty)
            tl.store(bf_ptr + ks[:, None] * stride_fk + cols[None, :] * stride_fn, bf, mask=mask)
            if COLSUM:
                colsum += tl.sum(bf.to(tl.float32), axis=0)
        elif COLSUM:
            colsum += tl.sum(b, axis=0)
        if HAS_NB:
            nb = tl.load(nb_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
            nbsum += tl.sum(b * nb[:, None], axis=0)
    if COLSUM:
        tl.store(colsum_ptr + cols, colsum, mask=cmask)
    if HAS_NB or HAS_BIAS:
        if HAS_BIAS:
            nbsum += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(biasf_ptr + cols, nbsum, mask=cmask)


def fold_one_launch(b: Tensor, bias: Optional[Tensor], weight: Optional[Tensor], norm_bias: Optional[Tensor],
                    is_rms: bool, compiled: Optional[list] = None) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(b', bias', colsum) as ``fold_norm_affine`` gives them for b in a's dtype, in one kernel launch (the
    fused op's host cost: the torch form is up to seven launches per call); bias' is fp32 whenever there is
    one. For the Gluon kernel, which reads bias' in any dtype. b is a 16-bit [K, N] with unit stride along
    one dim. ``compiled``: a one-element list holding the compiled kernel for arguments of this signature
    (launched directly: the JIT's per-call argument binding costs more host time than the launch), or an
    empty list, which this call fills."""
    k, n = b.shape
    colsum_on = not is_rms
    if weight is None and norm_bias is None and bias is None and not colsum_on:
        return b, None, None
    dev = b.device
    b_fold = torch.empty_like(b) if weight is not None else b  # preserve_format: b's strides
    bias_fold = torch.empty((n,), dtype=torch.float32, device=dev) if (bias is not None or norm_bias is not None) \
        else None
    colsum = torch.empty((n,), dtype=torch.float32, device=dev) if colsum_on else None
    any_ = b  # stands in for absent pointers (never read: the flags say so)
    block_n = 64
    grid = triton.cdiv(n, block_n)
    args = (b, weight if weight is not None else any_, norm_bias if norm_bias is not None else any_,
            bias if bias is not None else any_, b_fold, bias_fold if bias_fold is not None else any_,
            colsum if colsum is not None else any_, k, n, b.stride(0), b.stride(1), b_fold.stride(0), b_fold.stride(1))
    consts = dict(HAS_W=weight is not None, HAS_NB=norm_bias is not None, HAS_BIAS=bias is not None,
                  COLSUM=colsum_on, BLOCK_K=64, BLOCK_N=block_n)
    if compiled:
        k_ = compiled[0]
        stream = torch._C._cuda_getCurrentRawStream(b.device.index if b.device.index is not None
                                                    else torch.cuda.current_device())
        k_.run(grid, 1, 1, stream, k_.function, k_.packed_metadata, None, None, None, *args, *consts.values())
        return b_fold, bias_fold, colsum
    _fold_kernel[(grid,)](*args, **consts, num_warps=4)
    if compiled is not None and b.device.type == "cuda":
        k_ = _fold_kernel.warmup(*args, **consts, num_warps=4, grid=(grid,))
        k_ = k_.result() if hasattr(k_, "result") else k_
        k_._init_handles()
        compiled.append(k_)
    return b_fold, bias_fold, colsum


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output the launcher writes comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def pointer_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """The pointer kernel's tile: N tiles up to 128 wide, 128 rows (64 when 128-row tiles would leave SMs
    idle, or for short inputs), BLOCK_K 64 (32 for fp32, whose operands take twice the shared memory)."""
    bn = min(PTR_BLOCK_N, pow2_at_least(n))
    bm = 128 if triton.cdiv(m, 128) * triton.cdiv(n, bn) >= num_sms(device) else 64
    bm = min(bm, pow2_at_least(m))
    bk = min(32 if dtype == torch.float32 else 64, pow2_at_least(k))
    # One stage: with 2-3 the pipelined kernel gave wrong tiles on the H200 under Triton 3.6 (errors ~1
    # against bf16's 0.03, K = 64-256) where the loaded A tile feeds both the MMA and the row sums;
    # single-buffered it is right (scratch probe, 2026-11-29). This is the fallback path (non-TMA layouts).
    return GemmConfig("ptr", bm, bn, bk, 1, gemm_num_warps(bm, bn))


def _tile_sums(config: GemmConfig, is_rms: bool) -> bool:
    """Whether the TMA kernel keeps [BLOCK_M, BLOCK_K] partial row sums (no shuffles in the K loop) for
    this tile: when they fit in registers beside the accumulator (fp32 elements per thread)."""
    if TILE_SUMS_OVERRIDE is not None:
        return TILE_SUMS_OVERRIDE
    threads = 32 * config.warps
    per_thread = (config.block_m * config.block_n + (1 if is_rms else 2) * config.block_m * config.block_k) // threads
    return per_thread <= 160


def norm_mm_triton(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype],
    config: GemmConfig,
    plan_out: Optional[list] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(c, mean, rstd) of ``norm_mm_reference``; inputs already checked by the op.

    ``config``: one of ``prenorm_candidates`` (tuning/norm_mm.py). A Gluon one ("gl_*") whose specialization
    spills raises ``SpillError`` (kernels/hopper/mm_norm.py) without launching the Gluon kernel: a caller
    timing it hears that it cannot run, and the op's CUDA path runs the tl kernels' first choice instead
    (ops/norm_mm.py). ``plan_out``: where a Gluon launch appends a function that launches the same again on
    inputs of the same signature (``norm_mm_cuda`` in ops/norm_mm.py caches it).
    """
    m, k = a.shape
    n = b.shape[1]
    if k == 0:
        raise ValueError("norm_mm_triton: K == 0 (a norm over no columns) is not supported")
    dev = a.device
    out_dtype = out_dtype or a.dtype
    f32 = torch.float32
    c = _alloc((m, n), out_dtype, dev)
    mean = _alloc((0,) if is_rms else (m,), f32, dev)
    rstd = _alloc((m,), f32, dev)
    if m == 0:
        return c, mean, rstd
    if config.kind.startswith("gl_"):
        from ..hopper.norm_mm import norm_mm_gluon

        b_one, bias_one, colsum_one = fold_one_launch(b, bias, weight, norm_bias, is_rms)
        plan = norm_mm_gluon(a, b_one, bias_one, colsum_one, eps, is_rms, c, mean, rstd, config)
        if plan_out is not None:
            plan_out.append(_gluon_launcher(plan, m, n, out_dtype, is_rms, dev))
        return c, mean, rstd
    b_fold, bias_fold, colsum = fold_norm_affine(b, bias, weight, norm_bias, a.dtype, is_rms)
    bias_stride = bias_fold.stride(0) if bias_fold is not None else 0
    flags = dict(HAS_BIAS=bias_fold is not None, IS_RMS=is_rms)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    tma = config.kind in ("tma", "tma_rows")
    layout = tma_layout(a, b_fold) if tma and n > 0 else None
    if tma and layout is not None:
        descs = tma_descriptors(a, b_fold, layout, bm, bn, bk)
        row_blocks = config.kind == "tma_rows"
        tiles = triton.cdiv(m, bm) * (1 if row_blocks else triton.cdiv(n, bn))
        grid = min(num_sms(dev) * config.progs_per_sm, tiles)
        common = dict(
            **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGS=grid, B_KN=layout == "kn",
            ROW_BLOCKS=row_blocks, TILE_SUMS=_tile_sums(config, is_rms), EVEN_K=k % bk == 0,
            num_warps=config.warps, num_stages=config.stages,
        )

        def launch(c_tma: bool):
            _norm_mm_fwd_tma_kernel[(grid,)](
                *descs, a, colsum, bias_fold, c, tensor_descriptor(c, [bm, bn]) if c_tma else None, mean, rstd,
                m, n, k, a.stride(0), bias_stride, c.stride(0), float(eps), C_TMA=c_tma, **common,
            )

        launch_with_tma_store(("norm_mm", config, c.dtype, tuple(sorted(common.items()))), c, launch)
        return c, mean, rstd
    if tma:
        # A TMA config for operands TMA cannot read (or N == 0): the pointer kernel's own tile instead.
        config = pointer_config(m, n, k, a.dtype, dev)
        bm, bn, bk = config.block_m, config.block_n, config.block_k
    # N == 0 still launches one N tile per row block: mean and rstd must be written.
    n_tiles_n = max(1, triton.cdiv(n, bn))
    _norm_mm_fwd_kernel[(triton.cdiv(m, bm) * n_tiles_n,)](
        a, b_fold, colsum, bias_fold, c, mean, rstd,
        m, n, k, n_tiles_n,
        a.stride(0), a.stride(1), b_fold.stride(0), b_fold.stride(1), bias_stride, c.stride(0),
        float(eps),
        **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INPUT_PRECISION=dot_input_precision(a.dtype, dev),
        num_warps=config.warps, num_stages=config.stages,
    )
    return c, mean, rstd


def _gluon_launcher(plan, m: int, n: int, out_dtype, is_rms: bool, dev) -> Callable:
    """What ``plan_out`` receives: the Gluon plan launched again on fresh outputs, the operands folded by the
    fold kernel compiled on the first call (no JIT argument binding per call)."""
    fold: list = []  # the fold kernel compiled for this signature, on the first call

    def launch(a, b, bias, weight, norm_bias):
        c = _alloc((m, n), out_dtype, dev)
        mean = _alloc((0,) if is_rms else (m,), torch.float32, dev)
        rstd = _alloc((m,), torch.float32, dev)
        b_fold, bias_fold, colsum = fold_one_launch(b, bias, weight, norm_bias, is_rms, fold)
        plan(a, b_fold, bias_fold, colsum, plan.eps, c, mean, rstd)
        return c, mean, rstd

    return launch


def normed_triton(a: Tensor, mean: Optional[Tensor], rstd: Tensor, weight: Optional[Tensor],
                  norm_bias: Optional[Tensor], is_rms: bool) -> Tensor:
    """y = norm(a) * weight + norm_bias in a's dtype, rebuilt from mean/rstd (``_normed_kernel``)."""
    m, k = a.shape
    y = _alloc((m, k), a.dtype, a.device)
    if m == 0 or k == 0:
        return y
    bm, bk = 32, min(256, pow2_at_least(k))
    _normed_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](
        a, mean, rstd, weight, norm_bias, y, m, k, a.stride(0), a.stride(1), y.stride(0),
        IS_RMS=is_rms, HAS_W=weight is not None, HAS_NB=norm_bias is not None, BLOCK_M=bm, BLOCK_K=bk,
        num_warps=4,
    )
    return y
