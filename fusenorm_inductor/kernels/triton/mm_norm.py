"""Triton kernels and launcher for ``fusenorm::mm_norm``: ``y = norm(a @ b + bias + residual)``.

Semantics, output shapes and dtypes are those of ``mm_norm_reference`` (ops/mm_norm.py): the GEMM accumulates
in fp32, bias and residual are added in fp32, statistics are fp32, y is rounded once to ``out_dtype``, hh once
to the pre-norm dtype.

Which kernel runs is the ``GemmConfig`` (kernels/triton/common.py) the caller passes: tuning/mm_norm.py lists
the ones worth timing for a shape (``forward_candidates``) and picks the measured best (``forward_config``,
cached per shape; the first one without CUDA or tuning), which ops/mm_norm.py passes in.

On Hopper, with TMA-compatible operands (``tma_layout``: 16-bit, A row-major, b a transposed row-major
weight or a row-major [K, N] matrix, 16-byte aligned rows), persistent TMA-fed kernels:
- "row" (N <= 256), ``_mm_norm_fwd_tma_kernel``: one tile holds whole rows; GEMM, bias/residual, two-pass
  statistics in registers, y/hh/mean/rstd (``_full_row_epilogue``), in a flattened persistent loop.
- "spin" and "coop" (N > 256), ``_mm_norm_fwd_coop_kernel``: a row spans N_TILES tiles whose programs
  cannot read each other's registers (no DSMEM in Triton 3.6, docs/platform.md), so each tile publishes per-row
  partials (LayerNorm tile mean and M2, RMSNorm sum of squares) and bumps its row block's counter. "spin":
  the tiles of a row block run in the same wave and wait for each other, then normalize their own registers
  (the DSMEM exchange, through L2). "coop": nobody waits; each tile also writes its h to a scratch and the
  last one to arrive normalizes the whole row block from there. docs/history/design-history.md compares them.
Otherwise the pointer-load kernels (any strides and dtypes, fp32 too), chosen by ``gemm_config``:
- single tile (N <= 256): ``_mm_norm_fwd_fused_kernel`` owns BLOCK_M full rows, grid cdiv(M, BLOCK_M).
- multi tile (N > 256):
  1. ``_mm_norm_fwd_partial_kernel`` (grid cdiv(M, BLOCK_M) * n_tiles) writes per-(tile, row) fp32
     partials and the tile's h into a scratch, for LayerNorm *centered on the tile mean*;
  2. ``_mm_norm_fwd_finalize_kernel`` (grid cdiv(M, FIN_BLOCK_M) * n_tiles) combines the partials of its
     rows (Chan's formula), reads the scratch back and writes y, hh, mean, rstd (in place when the scratch
     is y or hh).

The scratch (the h round trip of "coop" and the multi-tile path): y itself when ``out_dtype`` is fp32 or the
pre-norm dtype, else hh when it is written (it has the pre-norm dtype), else a fresh buffer in the pre-norm
dtype. So h is rounded at most to the precision the unfused graph materializes it in (``a @ b + residual``
in the pre-norm dtype), never to a narrower ``out_dtype``, and no extra buffer is allocated in the common
cases. Storing ``h - tile_mean`` rather than h for LayerNorm keeps that rounding relative to the row's spread
instead of to |h|: with |mean| >> std (e.g. rows of 1000 + N(0, 1) in fp16, ulp(1000) = 0.5) rounding h
itself would destroy hh, whereas the centered value rounds like the final output does. The tile mean stays
in fp32 (the partials) and is added back in fp32 when normalizing. (An always-fp32 scratch would be exact
but makes the round trip 8 bytes per element instead of 4 for 16-bit models.) "spin" needs no scratch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    FINALIZE_WARPS,
    GemmConfig,
    cooperative_grid,
    launch_with_tma_store,
    chan_combine,
    dot_input_precision,
    finalize_block_m,
    num_sms,
    tile_coords,
    tile_matmul,
    tma_descriptors,
    tensor_descriptor,
    tma_layout,
    tma_tile,
)

__all__ = ["mm_norm_triton"]

# Test hook: when set (a power of two >= 16), the N tile is this size, so N > _FORCE_BLOCK_N takes the
# multi-tile path even for small N (the interpreter tests cover both paths with small shapes). Read where the
# configuration is chosen (tuning/mm_norm.py) and by the launch plans' key (ops/mm_norm.py).
_FORCE_BLOCK_N: Optional[int] = None


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _prenorm_tile(
    a_ptr, b_ptr, bias_ptr, res_ptr, rows, cols, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_bias, stride_rm, stride_rn,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """h = a @ b + bias + residual for one tile, fp32, exactly 0 outside [M, N] (all loads masked to 0)."""
    h = tile_matmul(
        a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
    )
    return _add_bias_residual(h, bias_ptr, res_ptr, rows, cols, M, N, stride_bias, stride_rm, stride_rn,
                              HAS_BIAS, HAS_RES)


@triton.jit
def _affine_store(
    hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
    HAS_W: tl.constexpr, HAS_NB: tl.constexpr, SAVE_NORMED: tl.constexpr,
):
    """y = hh * w + nb (fp32, rounded once to y's dtype); hh stored too when SAVE_NORMED."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    y = _affine(hh, w_ptr, nb_ptr, cols, N, stride_w, stride_nb, HAS_W, HAS_NB)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    _store_normed(hh, hh_ptr, rows, cols, M, N, stride_hm, SAVE_NORMED)


@triton.jit
def _affine(hh, w_ptr, nb_ptr, cols, N, stride_w, stride_nb, HAS_W: tl.constexpr, HAS_NB: tl.constexpr):
    """hh * w + nb in fp32."""
    mask_n = cols < N
    y = hh
    if HAS_W:
        w = tl.load(w_ptr + cols * stride_w, mask=mask_n, other=0.0)
        y = y * w.to(tl.float32)[None, :]
    if HAS_NB:
        nb = tl.load(nb_ptr + cols * stride_nb, mask=mask_n, other=0.0)
        y = y + nb.to(tl.float32)[None, :]
    return y


@triton.jit
def _store_normed(hh, hh_ptr, rows, cols, M, N, stride_hm, SAVE_NORMED: tl.constexpr):
    if SAVE_NORMED:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        hh_ptrs = hh_ptr + rows[:, None] * stride_hm + cols[None, :]
        tl.store(hh_ptrs, hh.to(hh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm_norm_fwd_fused_kernel(
    a_ptr, b_ptr, bias_ptr, res_ptr, w_ptr, nb_ptr,
    y_ptr, hh_ptr, mean_ptr, rstd_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_bias, stride_rm, stride_rn,
    stride_w, stride_nb, stride_ym, stride_hm,
    eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_NB: tl.constexpr,
    IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Single tile (BLOCK_N >= N): the program owns BLOCK_M whole rows of h = a @ b + bias + residual.

    LayerNorm: mean = sum(h)/N, var = sum((h - mean)^2)/N, rstd = rsqrt(var + eps), hh = (h - mean) * rstd
    RMSNorm:   rstd = rsqrt(sum(h^2)/N + eps), hh = h * rstd
    y = hh * w + nb.
    """
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    h = _prenorm_tile(
        a_ptr, b_ptr, bias_ptr, res_ptr, rows, cols, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_bias, stride_rm, stride_rn,
        HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
    )
    _full_row_epilogue(
        h, rows, cols, M, N, w_ptr, nb_ptr, y_ptr, hh_ptr, mean_ptr, rstd_ptr,
        stride_w, stride_nb, stride_ym, stride_hm, eps, HAS_W, HAS_NB, IS_RMS, SAVE_NORMED,
    )


@triton.jit
def _full_row_epilogue(
    h, rows, cols, M, N, w_ptr, nb_ptr, y_ptr, hh_ptr, mean_ptr, rstd_ptr,
    stride_w, stride_nb, stride_ym, stride_hm, eps,
    HAS_W: tl.constexpr, HAS_NB: tl.constexpr, IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr,
):
    """Norm of whole rows held in registers (h is 0 outside [M, N]); writes y, hh, mean, rstd."""
    hh = _full_row_norm(h, rows, cols, M, N, mean_ptr, rstd_ptr, eps, IS_RMS)
    _affine_store(
        hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
        HAS_W, HAS_NB, SAVE_NORMED,
    )


@triton.jit
def _full_row_norm(h, rows, cols, M, N, mean_ptr, rstd_ptr, eps, IS_RMS: tl.constexpr):
    """hh of whole rows held in registers (h is 0 outside [M, N]); writes mean and rstd."""
    mask_m = rows < M
    # The whole row is in registers, so the exact two-pass variance costs no memory traffic.
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        hh = h * rstd[:, None]
    else:
        mean = tl.sum(h, axis=1) / N
        # Padded columns must not contribute (h - mean) to the variance.
        d = tl.where((cols < N)[None, :], h - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=1) / N + eps)
        hh = d * rstd[:, None]
        tl.store(mean_ptr + rows, mean, mask=mask_m)
    tl.store(rstd_ptr + rows, rstd, mask=mask_m)
    return hh


@triton.jit
def _mm_norm_fwd_tma_kernel(
    a_desc, w_desc, bias_ptr, res_ptr, w_ptr, nb_ptr,
    y_ptr, y_desc, hh_ptr, mean_ptr, rstd_ptr,
    M, N, K,
    stride_bias, stride_rm, stride_rn, stride_w, stride_nb, stride_ym, stride_hm,
    eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_NB: tl.constexpr,
    IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr, GEMM_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGS: tl.constexpr,
    B_KN: tl.constexpr, Y_TMA: tl.constexpr,
):
    """Single tile on Hopper: the same math as ``_mm_norm_fwd_fused_kernel``, with A [M, K] and the weight
    W = b.T [N, K] fed by TMA (host-side descriptors; out-of-bounds rows/columns/K read as 0) and a
    persistent, flattened loop over row blocks, so the next block's loads overlap this block's epilogue.
    GEMM_ONLY stores h = a @ b as y and skips the norm (the benchmark's "GEMM base" measurement).
    Y_TMA: y leaves through a TMA store (y_desc, box [BLOCK_M, BLOCK_N], clipped at M and N), which the
    H200 probe measured 3-6% faster than pointer stores at N = 256 (docs/history/); hh, only written with
    an affine norm, keeps pointer stores (a second staging tile would not fit shared memory).
    """
    k_tiles = tl.cdiv(K, BLOCK_K)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    for rb in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_PROGS, flatten=True):
        acc = tma_tile(a_desc, w_desc, rb * BLOCK_M, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
        rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride must not overflow
        acc = _add_bias_residual(acc, bias_ptr, res_ptr, rows, cols, M, N, stride_bias, stride_rm, stride_rn,
                                 HAS_BIAS, HAS_RES)
        if not GEMM_ONLY:
            hh = _full_row_norm(acc, rows, cols, M, N, mean_ptr, rstd_ptr, eps, IS_RMS)
            _store_normed(hh, hh_ptr, rows, cols, M, N, stride_hm, SAVE_NORMED)
            acc = _affine(hh, w_ptr, nb_ptr, cols, N, stride_w, stride_nb, HAS_W, HAS_NB)
        if Y_TMA:
            y_desc.store([rb * BLOCK_M, 0], acc.to(y_desc.dtype))
        else:
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_bias_residual(acc, bias_ptr, res_ptr, rows, cols, M, N, stride_bias, stride_rm, stride_rn,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """(acc + bias) + residual in fp32, the reference's order; 0 stays 0 outside [M, N]."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if HAS_RES:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask, other=0.0)
        acc += res.to(tl.float32)
    return acc


@triton.jit
def _mm_norm_fwd_coop_kernel(
    a_desc, w_desc, bias_ptr, res_ptr, w_ptr, nb_ptr,
    y_ptr, hh_ptr, mean_ptr, rstd_ptr, scr_ptr, p1_ptr, p2_ptr, count_ptr,
    M, N, K,
    stride_bias, stride_rm, stride_rn, stride_w, stride_nb, stride_ym, stride_hm, stride_sm,
    eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_NB: tl.constexpr,
    IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr, GEMM_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGS: tl.constexpr,
    B_KN: tl.constexpr, N_TILES: tl.constexpr, TILES_P2: tl.constexpr, SPIN: tl.constexpr,
):
    """Rows wider than one tile on Hopper, in one persistent TMA-fed kernel ("cooperative finalize in L2").

    Tiles are numbered row block by row block, so the N_TILES tiles of a row block run at about the same
    time on neighbouring programs. Each program, for its tile (rb, j):
    1. computes h = a @ b + bias + residual (TMA, fp32) and the tile's per-row partials (as the two-kernel
       path: LayerNorm tile mean and M2, centred h in the scratch; RMSNorm sum of squares, h);
    2. publishes them and bumps the row block's arrival counter (acq_rel, after a CTA barrier, so every
       thread's stores are visible to whoever sees the new count);
    3. if it arrived last, it owns the row block's finalize: Chan-combine the partials, then normalize all
       N_TILES tiles of the scratch (read back from L2, where they were written moments ago) into y/hh.
    Nothing waits for another program, so the kernel cannot deadlock whatever the scheduling (it runs in
    the CPU interpreter, programs one after another), and the finalize work spreads over the programs.
    The partials and scratch are those of ``_mm_norm_fwd_partial_kernel``; counters start at 0.
    """
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_rb = tl.cdiv(M, BLOCK_M)
    # Not flattened: Triton 3.6's loop fusion fails on the finalize branch's inner loop.
    for t in tl.range(tl.program_id(0), n_rb * N_TILES, NUM_PROGS):
        rb = t // N_TILES
        j = t % N_TILES
        acc = tma_tile(a_desc, w_desc, rb * BLOCK_M, j * BLOCK_N, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
        rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_m = rows < M
        mask = mask_m[:, None] & (cols < N)[None, :]
        acc = _add_bias_residual(acc, bias_ptr, res_ptr, rows, cols, M, N, stride_bias, stride_rm, stride_rn,
                                 HAS_BIAS, HAS_RES)
        if GEMM_ONLY:
            tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            stat = j.to(tl.int64) * M + rows  # partials are [N_TILES, M]
            if IS_RMS:
                tl.store(p1_ptr + stat, tl.sum(acc * acc, axis=1), mask=mask_m)
                out = acc
            else:
                n_j = tl.minimum(N - j * BLOCK_N, BLOCK_N)
                tmean = tl.sum(acc, axis=1) / n_j
                out = tl.where(mask, acc - tmean[:, None], 0.0)
                tl.store(p1_ptr + stat, tmean, mask=mask_m)
                tl.store(p2_ptr + stat, tl.sum(out * out, axis=1), mask=mask_m)
            if not SPIN:
                tl.store(scr_ptr + rows[:, None] * stride_sm + cols[None, :], out.to(scr_ptr.dtype.element_ty),
                         mask=mask)
            # Every thread's stores above happen before the one release of the counter.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
            if SPIN:
                # Co-resident exchange: wait until every tile of the row block has published its partials
                # (they run in the same wave: see the docstring), then normalize this tile from registers.
                seen = arrived + 1
                while seen < N_TILES:
                    seen = tl.atomic_add(count_ptr + rb, 0, sem="acquire", scope="gpu")
                mean, rstd = _row_stats(rows, M, N, p1_ptr, p2_ptr, eps, IS_RMS, BLOCK_N, N_TILES, TILES_P2)
                if IS_RMS:
                    hh = out * rstd[:, None]
                else:
                    hh = tl.where(mask, (out + (tmean - mean)[:, None]) * rstd[:, None], 0.0)
                if j == 0:
                    if not IS_RMS:
                        tl.store(mean_ptr + rows, mean, mask=mask_m)
                    tl.store(rstd_ptr + rows, rstd, mask=mask_m)
                _affine_store(
                    hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
                    HAS_W, HAS_NB, SAVE_NORMED,
                )
            elif arrived == N_TILES - 1:
                _finalize_row_block(
                    rows, M, N, scr_ptr, p1_ptr, p2_ptr, w_ptr, nb_ptr, y_ptr, hh_ptr, mean_ptr, rstd_ptr,
                    stride_sm, stride_w, stride_nb, stride_ym, stride_hm, eps,
                    HAS_W, HAS_NB, IS_RMS, SAVE_NORMED, BLOCK_N, N_TILES, TILES_P2,
                )


@triton.jit
def _row_stats(rows, M, N, p1_ptr, p2_ptr, eps, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr,
               N_TILES: tl.constexpr, TILES_P2: tl.constexpr):
    """(mean, rstd) of rows from the N_TILES per-tile partials (".cg": written by other SMs); LayerNorm
    Chan-combines (tile mean, M2), RMSNorm sums the tile sums of squares (mean is then unused)."""
    mask_m = rows < M
    tiles = tl.arange(0, TILES_P2)
    tile_ok = tiles < N_TILES
    pmask = mask_m[:, None] & tile_ok[None, :]
    pidx = tiles.to(tl.int64)[None, :] * M + rows[:, None]
    if IS_RMS:
        sumsq = tl.sum(tl.load(p1_ptr + pidx, mask=pmask, other=0.0, cache_modifier=".cg"), axis=1)
        rstd = tl.rsqrt(sumsq / N + eps)
        mean = rstd
    else:
        tmean = tl.load(p1_ptr + pidx, mask=pmask, other=0.0, cache_modifier=".cg")
        tm2 = tl.load(p2_ptr + pidx, mask=pmask, other=0.0, cache_modifier=".cg")
        count = tl.where(tile_ok, tl.minimum(N - tiles * BLOCK_N, BLOCK_N), 0).to(tl.float32)
        mean, m2 = chan_combine(tmean, tm2, count, N)
        rstd = tl.rsqrt(m2 / N + eps)
    return mean, rstd


@triton.jit
def _finalize_row_block(
    rows, M, N, scr_ptr, p1_ptr, p2_ptr, w_ptr, nb_ptr, y_ptr, hh_ptr, mean_ptr, rstd_ptr,
    stride_sm, stride_w, stride_nb, stride_ym, stride_hm, eps,
    HAS_W: tl.constexpr, HAS_NB: tl.constexpr, IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr,
    BLOCK_N: tl.constexpr, N_TILES: tl.constexpr, TILES_P2: tl.constexpr,
):
    """The last-arriving program of a row block: combine the N_TILES partials of its rows, write mean/rstd,
    normalize every tile of the scratch into y (and hh). Loads bypass L1 (".cg"): the data was written by
    other SMs."""
    mask_m = rows < M
    mean, rstd = _row_stats(rows, M, N, p1_ptr, p2_ptr, eps, IS_RMS, BLOCK_N, N_TILES, TILES_P2)
    if not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=mask_m)
    tl.store(rstd_ptr + rows, rstd, mask=mask_m)
    for jj in range(N_TILES):
        cols = (jj * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = mask_m[:, None] & (cols < N)[None, :]
        x = tl.load(scr_ptr + rows[:, None] * stride_sm + cols[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        if IS_RMS:
            hh = x * rstd[:, None]
        else:
            # Undo the tile centring in fp32: h - mean = (h - m_jj) + (m_jj - mean).
            own = tl.load(p1_ptr + jj * M + rows, mask=mask_m, other=0.0, cache_modifier=".cg")
            hh = tl.where(mask, (x + (own - mean)[:, None]) * rstd[:, None], 0.0)
        _affine_store(
            hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
            HAS_W, HAS_NB, SAVE_NORMED,
        )


@triton.jit
def _mm_norm_fwd_partial_kernel(
    a_ptr, b_ptr, bias_ptr, res_ptr,
    scr_ptr, p1_ptr, p2_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_bias, stride_rm, stride_rn, stride_sm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, IS_RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Multi tile, step 1: tile (pid_m, j) of h = a @ b + bias + residual and its per-row partials.

    LayerNorm: p1[j, row] = tile mean m_j = sum_tile(h)/n_j, p2[j, row] = M2_j = sum_tile((h - m_j)^2),
               scratch = h - m_j (centered: see the module docstring).
    RMSNorm:   p1[j, row] = sum_tile(h^2), scratch = h.
    n_j = min(BLOCK_N, N - j*BLOCK_N) is the number of valid columns of tile j.
    """
    pid_m, pid_n, rows, cols = tile_coords(N, BLOCK_M, BLOCK_N)
    mask_m = rows < M
    mask_n = cols < N
    h = _prenorm_tile(
        a_ptr, b_ptr, bias_ptr, res_ptr, rows, cols, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_bias, stride_rm, stride_rn,
        HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
    )
    stat = pid_n.to(tl.int64) * M + rows  # partial buffers are [n_tiles, M]
    if IS_RMS:
        tl.store(p1_ptr + stat, tl.sum(h * h, axis=1), mask=mask_m)
        out = h
    else:
        n_j = tl.minimum(N - pid_n * BLOCK_N, BLOCK_N)
        tmean = tl.sum(h, axis=1) / n_j
        # Two-pass within the tile (exact in registers); padded columns excluded.
        out = tl.where(mask_n[None, :], h - tmean[:, None], 0.0)
        tl.store(p1_ptr + stat, tmean, mask=mask_m)
        tl.store(p2_ptr + stat, tl.sum(out * out, axis=1), mask=mask_m)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(scr_ptr + rows[:, None] * stride_sm + cols[None, :], out.to(scr_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm_norm_fwd_finalize_kernel(
    scr_ptr, p1_ptr, p2_ptr, w_ptr, nb_ptr,
    y_ptr, hh_ptr, mean_ptr, rstd_ptr,
    M, N,
    stride_sm, stride_w, stride_nb, stride_ym, stride_hm,
    eps,
    HAS_W: tl.constexpr, HAS_NB: tl.constexpr, IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES_P2: tl.constexpr,
):
    """Multi tile, step 2: combine the row partials of all N tiles and normalize tile (pid_m, j) in place.

    LayerNorm: (mean, M2) = Chan-combine of (m_i, M2_i, n_i); rstd = rsqrt(M2/N + eps);
               hh = (scratch + (m_j - mean)) * rstd = (h - mean) * rstd.
    RMSNorm:   rstd = rsqrt(sum_i p1[i, row] / N + eps); hh = scratch * rstd.
    y = hh * w + nb. The program with j == 0 writes mean and rstd.
    """
    pid_m, pid_n, rows, cols = tile_coords(N, BLOCK_M, BLOCK_N)
    mask_m = rows < M
    mask = mask_m[:, None] & (cols < N)[None, :]
    # Every program re-combines its rows' partials: n_tiles values per row, cheaper than another launch.
    tiles = tl.arange(0, TILES_P2)
    tile_ok = tiles < tl.cdiv(N, BLOCK_N)
    pmask = mask_m[:, None] & tile_ok[None, :]
    pidx = tiles.to(tl.int64)[None, :] * M + rows[:, None]
    x = tl.load(scr_ptr + rows[:, None] * stride_sm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        sumsq = tl.sum(tl.load(p1_ptr + pidx, mask=pmask, other=0.0), axis=1)
        rstd = tl.rsqrt(sumsq / N + eps)
        hh = x * rstd[:, None]
    else:
        tmean = tl.load(p1_ptr + pidx, mask=pmask, other=0.0)
        tm2 = tl.load(p2_ptr + pidx, mask=pmask, other=0.0)
        count = tl.where(tile_ok, tl.minimum(N - tiles * BLOCK_N, BLOCK_N), 0).to(tl.float32)
        mean, m2 = chan_combine(tmean, tm2, count, N)
        rstd = tl.rsqrt(m2 / N + eps)
        # Undo the tile centering in fp32: h - mean = (h - m_j) + (m_j - mean).
        own = tl.load(p1_ptr + pid_n.to(tl.int64) * M + rows, mask=mask_m, other=0.0)
        hh = tl.where(mask, (x + (own - mean)[:, None]) * rstd[:, None], 0.0)
        if pid_n == 0:
            tl.store(mean_ptr + rows, mean, mask=mask_m)
    if pid_n == 0:
        tl.store(rstd_ptr + rows, rstd, mask=mask_m)
    _affine_store(
        hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
        HAS_W, HAS_NB, SAVE_NORMED,
    )


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


# The allocator Inductor's generated code uses: no Python argument parsing, a third of torch.empty's host time.
_EMPTY_STRIDED_CUDA = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "_empty_strided_cuda", None)


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the launcher writes (outputs, partials, scratch) comes from here (tests poison it).
    ``shape`` is a tuple of one or two ints; the buffer is contiguous."""
    if _EMPTY_STRIDED_CUDA is not None and device.type == "cuda" and device.index == torch._C._cuda_getDevice():
        return _EMPTY_STRIDED_CUDA(shape, (shape[1], 1) if len(shape) == 2 else (1,), dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _outputs(m: int, n: int, out_dtype, h_dtype, is_rms: bool, save_normed: bool, dev) -> tuple:
    """The op's (y, hh, mean, rstd) buffers (module docstring of ops/mm_norm.py: hh and mean may be 0-size)."""
    f32 = torch.float32
    y = _alloc((m, n), out_dtype, dev)
    hh = _alloc((m, n), h_dtype, dev) if save_normed else _alloc((0,), f32, dev)
    return y, hh, _alloc((0,) if is_rms else (m,), f32, dev), _alloc((m,), f32, dev)


def _scratch(y, hh, out_dtype, h_dtype, save_normed, m, n, dev) -> Tensor:
    """Where multi-tile paths keep h between the GEMM and the normalization (module docstring): y when it
    has the pre-norm dtype or fp32, else hh when it is written, else a fresh buffer in the pre-norm dtype."""
    if out_dtype == torch.float32 or out_dtype == h_dtype:
        return y
    if save_normed:
        return hh
    return _alloc((m, n), h_dtype, dev)


def mm_norm_triton(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype],
    save_normed: bool,
    config: Optional[GemmConfig],
    gemm_only: bool = False,
    plan_out: Optional[list] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, hh, mean, rstd) of ``mm_norm_reference``; inputs already checked by the op.

    ``config``: the configuration to run, one of tuning/mm_norm.py's ``forward_candidates`` (None only where
    M = 0: nothing launches). A Gluon one ("gl_*") whose specialization spills registers raises
    ``SpillError`` (kernels/hopper/mm_norm.py) before launching anything; the op then runs the ``tl`` kernels
    (ops/mm_norm.py). ``gemm_only`` (TMA configs only): y = a @ b + bias + residual, no norm (the benchmark's
    GEMM base). ``plan_out``: where a Gluon launch appends a function that launches the same again on inputs
    of the same signature (``mm_norm_cuda`` in ops/mm_norm.py caches it).
    """
    m, k = a.shape
    n = b.shape[1]
    dev = a.device
    out_dtype = out_dtype or a.dtype
    h_dtype = torch.promote_types(a.dtype, residual.dtype) if residual is not None else a.dtype
    f32 = torch.float32
    y, hh, mean, rstd = _outputs(m, n, out_dtype, h_dtype, is_rms, save_normed, dev)
    if m == 0:
        return y, hh, mean, rstd
    if config.kind.startswith("gl_"):
        from ..hopper.mm_norm import mm_norm_gluon

        plan = mm_norm_gluon(a, b, bias, residual, weight, norm_bias, eps, is_rms, save_normed, y, hh, mean, rstd,
                             config, gemm_only, lambda shape, dtype: _alloc(shape, dtype, dev))
        if plan_out is not None:
            plan_out.append(_gluon_launcher(plan, m, n, out_dtype, h_dtype, is_rms, save_normed, dev))
        return y, hh, mean, rstd
    if config.kind == "spin" and triton.cdiv(n, config.block_n) > num_sms(dev):
        tiles = triton.cdiv(n, config.block_n)
        raise ValueError(f"{config.label()}: a row block's {tiles} tiles cannot all be resident (spin exchange)")
    flags = dict(
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        HAS_W=weight is not None, HAS_NB=norm_bias is not None, IS_RMS=is_rms,
    )
    res_strides = (residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)
    w_strides = (
        weight.stride(0) if weight is not None else 0,
        norm_bias.stride(0) if norm_bias is not None else 0,
    )
    hh_stride = hh.stride(0) if save_normed else 0
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if config.kind in ("row", "coop", "spin"):
        progs = num_sms(dev) * config.progs_per_sm
        layout = tma_layout(a, b)
        descs = tma_descriptors(a, b, layout, bm, bn, bk)
        common = dict(
            **flags, SAVE_NORMED=save_normed, GEMM_ONLY=gemm_only, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=config.warps, num_stages=config.stages, B_KN=layout == "kn",
        )
        bias_stride = bias.stride(0) if bias is not None else 0
        if config.kind == "row":
            grid = min(progs, triton.cdiv(m, bm))

            def launch(y_tma):
                _mm_norm_fwd_tma_kernel[(grid,)](
                    *descs, bias, residual, weight, norm_bias, y,
                    tensor_descriptor(y, [bm, bn]) if y_tma else None, hh, mean, rstd, m, n, k,
                    bias_stride, *res_strides, *w_strides, y.stride(0), hh_stride, float(eps),
                    NUM_PROGS=grid, Y_TMA=y_tma, **common,
                )

            # Not with two programs per SM: the store's staging tile would push their shared memory past
            # half an SM, and they only pay off by sharing one.
            key = ("mm_norm row", config, y.dtype, tuple(sorted(common.items())))
            launch_with_tma_store(key, y, launch, allowed=config.progs_per_sm == 1)
            return y, hh, mean, rstd
        n_tiles = triton.cdiv(n, bn)
        # The spin exchange keeps every tile in registers: no scratch (y stands in, never written early).
        scratch = y if config.kind == "spin" else _scratch(y, hh, out_dtype, h_dtype, save_normed, m, n, dev)
        p1 = _alloc((n_tiles, m), f32, dev)
        p2 = _alloc((n_tiles, m), f32, dev) if not is_rms else p1
        count = torch.zeros((triton.cdiv(m, bm),), dtype=torch.int32, device=dev)
        tiles = triton.cdiv(m, bm) * n_tiles
        progs = min(cooperative_grid(dev, n_tiles, config.progs_per_sm), tiles)
        _mm_norm_fwd_coop_kernel[(progs,)](
            *descs, bias, residual, weight, norm_bias, y, hh, mean, rstd, scratch, p1, p2, count, m, n, k,
            bias_stride, *res_strides, *w_strides, y.stride(0), hh_stride, scratch.stride(0), float(eps),
            NUM_PROGS=progs, N_TILES=n_tiles, TILES_P2=triton.next_power_of_2(n_tiles),
            SPIN=config.kind == "spin", **common,
        )
        return y, hh, mean, rstd
    if gemm_only:
        raise ValueError("gemm_only needs a TMA configuration")
    block_m, block_n, block_k, num_warps = bm, bn, bk, config.warps
    single = n <= block_n
    precision = dot_input_precision(a.dtype, dev)
    gemm_args = (
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        bias.stride(0) if bias is not None else 0,
        residual.stride(0) if residual is not None else 0,
        residual.stride(1) if residual is not None else 0,
    )
    if single:
        _mm_norm_fwd_fused_kernel[(triton.cdiv(m, block_m),)](
            a, b, bias, residual, weight, norm_bias, y, hh, mean, rstd,
            m, n, k, *gemm_args, *w_strides, y.stride(0), hh_stride, float(eps),
            HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            HAS_W=weight is not None, HAS_NB=norm_bias is not None,
            IS_RMS=is_rms, SAVE_NORMED=save_normed,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=precision,
            num_warps=num_warps, num_stages=3,
        )
        return y, hh, mean, rstd

    scratch = _scratch(y, hh, out_dtype, h_dtype, save_normed, m, n, dev)
    n_tiles = triton.cdiv(n, block_n)
    p1 = _alloc((n_tiles, m), f32, dev)
    p2 = _alloc((n_tiles, m), f32, dev) if not is_rms else p1
    _mm_norm_fwd_partial_kernel[(triton.cdiv(m, block_m) * n_tiles,)](
        a, b, bias, residual, scratch, p1, p2,
        m, n, k, *gemm_args, scratch.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, IS_RMS=is_rms,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=precision,
        num_warps=num_warps, num_stages=3,
    )
    fin_m = finalize_block_m(m, block_n)
    _mm_norm_fwd_finalize_kernel[(triton.cdiv(m, fin_m) * n_tiles,)](
        scratch, p1, p2, weight, norm_bias, y, hh, mean, rstd,
        m, n, scratch.stride(0), *w_strides, y.stride(0), hh_stride, float(eps),
        HAS_W=weight is not None, HAS_NB=norm_bias is not None, IS_RMS=is_rms, SAVE_NORMED=save_normed,
        BLOCK_M=fin_m, BLOCK_N=block_n, TILES_P2=triton.next_power_of_2(n_tiles),
        num_warps=FINALIZE_WARPS,
    )
    return y, hh, mean, rstd


def _gluon_launcher(plan, m: int, n: int, out_dtype, h_dtype, is_rms: bool, save_normed: bool, dev) -> Callable:
    """What ``plan_out`` receives from a Gluon launch: the plan relaunched on new inputs of the same signature,
    into fresh output buffers."""

    def launch(a, b, bias, residual, weight, norm_bias, eps):
        y, hh, mean, rstd = _outputs(m, n, out_dtype, h_dtype, is_rms, save_normed, dev)
        plan(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd)
        return y, hh, mean, rstd

    return launch
