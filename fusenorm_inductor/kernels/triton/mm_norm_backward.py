"""Triton kernels and launcher for ``fusenorm::mm_norm_backward``: ``dx = norm_backward(dy @ b + extra)``.

Semantics, shapes and dtypes are those of ``mm_norm_backward_reference`` (ops/mm_norm_backward.py):
dn = dy @ b + extra in fp32, hh = src (``src_is_normed``) or rebuilt from src, mean, rstd; t = dn * w;
LayerNorm dx = rstd * (t - mean(t) - hh * mean(t * hh)), RMSNorm dx = rstd * (t - hh * mean(t * hh));
dw = colsum(dn * hh), db = colsum(dn) in fp32 (0-size without weight / bias).

dw and db are deterministic: each M tile writes its column sums to a [cdiv(M, BLOCK_M), N] fp32 buffer
(no atomics), summed on the host afterwards. They need no row statistics, so they always come from the
GEMM kernel.

Kernels as in the forward (kernels/triton/mm_norm.py), run with the configuration the caller passes
(``backward_config`` in tuning/mm_norm_backward.py picks it per shape among ``backward_candidates``). On
Hopper with TMA-compatible operands: "row" (N <= 256, ``_mm_norm_bwd_tma_kernel``) and "spin"/"coop"
(N > 256, ``_mm_norm_bwd_coop_kernel``: tiles publish their row partial sums of t and t * hh; "spin" tiles
wait for the row block's others and finish dx from registers, "coop" ones store dn and the last to arrive
finishes the row block). A config's ``prefetch`` loads the saved tensor's tile before the K loop. Otherwise
the pointer-load kernels:

- single tile (N <= 256): ``_mm_norm_bwd_fused_kernel`` owns BLOCK_M whole rows: dn in registers, the two
  row means, dx, and the dw/db partials. Grid: cdiv(M, BLOCK_M).
- multi tile (N > 256):
  1. ``_mm_norm_bwd_partial_kernel`` (grid cdiv(M, BLOCK_M) * n_tiles) writes per-(tile, row) fp32 partial
     row sums of t (LayerNorm) and t * hh into [n_tiles, M] buffers, the dw/db partials, and dn into a
     scratch;
  2. ``_mm_norm_bwd_finalize_kernel`` (grid cdiv(M, FIN_BLOCK_M) * n_tiles) sums the row partials, reads dn
     back, rebuilds hh and t and writes dx (in place when the scratch is dx).

The scratch for dn is dx itself when ``dx_dtype`` is fp32 or the dtype the unfused graph holds dn in
(promote(dy, extra)); otherwise a buffer in that dtype. So dn is rounded at most as in the unfused graph.
The row sums and dw/db are taken from the unrounded fp32 dn in step 1; only the t term of dx sees the
rounded dn, an error of one rounding of dn * w * rstd, the size of dx's own final rounding for 16-bit dx.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import mm_norm as mm_norm_kernels
from .common import (
    FINALIZE_WARPS,
    GemmConfig,
    cooperative_grid,
    dot_input_precision,
    finalize_block_m,
    num_sms,
    tile_coords,
    tile_matmul,
    tma_descriptors,
    tma_layout,
    tma_tile,
)

__all__ = ["mm_norm_backward_triton"]

# Test hook: when set (a power of two >= 16), the N tile is this size, so N > _FORCE_BLOCK_N takes the
# multi-tile path even for small N (the interpreter tests cover both paths with small shapes). Read where the
# configuration is chosen (tuning/mm_norm_backward.py) and by the launch plans' key (ops/mm_norm_backward.py).
_FORCE_BLOCK_N: Optional[int] = None


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _normed_tile(
    src_ptr, mean_ptr, rstd_ptr, rows, cols, M, N, stride_sm, stride_sn,
    IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr,
):
    """(hh, rstd) for a tile: hh = src, or src * rstd (RMSNorm), or (src - mean) * rstd (LayerNorm);
    hh is 0 outside [M, N] (so padded rows/columns add nothing to any sum), rstd is 0 for rows >= M."""
    s = _load_src(src_ptr, rows, cols, M, N, stride_sm, stride_sn)
    return _normed_from(s, mean_ptr, rstd_ptr, rows, cols, M, N, IS_RMS, SRC_NORMED)


@triton.jit
def _load_src(src_ptr, rows, cols, M, N, stride_sm, stride_sn):
    """The saved tensor's tile in its own dtype, 0 outside [M, N] (the TMA kernels issue this load before
    their K loop, so its latency hides under the GEMM)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return tl.load(src_ptr + rows[:, None] * stride_sm + cols[None, :] * stride_sn, mask=mask, other=0.0)


@triton.jit
def _normed_from(s, mean_ptr, rstd_ptr, rows, cols, M, N, IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr):
    """(hh, rstd) from a loaded src tile (see _normed_tile)."""
    mask_m = rows < M
    mask = mask_m[:, None] & (cols < N)[None, :]
    s = s.to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=mask_m, other=0.0)
    if SRC_NORMED:
        hh = s
    elif IS_RMS:
        hh = s * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=mask_m, other=0.0)
        hh = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
    return hh, rstd


@triton.jit
def _grad_tile(
    dy_ptr, b_ptr, extra_ptr, rows, cols, M, N, K,
    stride_dym, stride_dyk, stride_bk, stride_bn, stride_em, stride_en,
    HAS_EXTRA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """dn = dy @ b + extra for one tile, fp32, exactly 0 outside [M, N]."""
    dn = tile_matmul(
        dy_ptr, b_ptr, rows, cols, M, N, K, stride_dym, stride_dyk, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
    )
    return _add_extra(dn, extra_ptr, rows, cols, M, N, stride_em, stride_en, HAS_EXTRA)


@triton.jit
def _weighted(dn, w_ptr, cols, N, stride_w, HAS_W: tl.constexpr):
    """t = dn * w (the gradient reaching hh), or dn without weight."""
    if HAS_W:
        w = tl.load(w_ptr + cols * stride_w, mask=cols < N, other=0.0)
        return dn * w.to(tl.float32)[None, :]
    else:
        return dn


@triton.jit
def _store_affine_partials(
    dn, hh, pdw_ptr, pdb_ptr, pid_m, cols, N, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
):
    """Row pid_m of the [m_tiles, N] partial buffers: colsum(dn * hh) -> dw, colsum(dn) -> db."""
    mask_n = cols < N
    base = tl.cast(pid_m, tl.int64) * N + cols
    if HAS_W:
        tl.store(pdw_ptr + base, tl.sum(dn * hh, axis=0), mask=mask_n)
    if HAS_DB:
        tl.store(pdb_ptr + base, tl.sum(dn, axis=0), mask=mask_n)


@triton.jit
def _mm_norm_bwd_fused_kernel(
    dy_ptr, b_ptr, extra_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr,
    dx_ptr, pdw_ptr, pdb_ptr,
    M, N, K,
    stride_dym, stride_dyk, stride_bk, stride_bn, stride_em, stride_en, stride_sm, stride_sn,
    stride_w, stride_dxm,
    HAS_EXTRA: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
    IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Single tile (BLOCK_N >= N): the program owns BLOCK_M whole rows of dn = dy @ b + extra.

    t = dn * w; c_t = sum(t)/N; c_th = sum(t * hh)/N
    LayerNorm: dx = rstd * (t - c_t - hh * c_th);  RMSNorm: dx = rstd * (t - hh * c_th)
    pdw[pid_m, :] = colsum(dn * hh), pdb[pid_m, :] = colsum(dn).
    """
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    dn = _grad_tile(
        dy_ptr, b_ptr, extra_ptr, rows, cols, M, N, K,
        stride_dym, stride_dyk, stride_bk, stride_bn, stride_em, stride_en,
        HAS_EXTRA, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
    )
    hh, rstd = _normed_tile(
        src_ptr, mean_ptr, rstd_ptr, rows, cols, M, N, stride_sm, stride_sn, IS_RMS, SRC_NORMED
    )
    # dw/db partials first: dn is then dead once t exists (fewer live [BLOCK_M, BLOCK_N] register arrays).
    _store_affine_partials(dn, hh, pdw_ptr, pdb_ptr, pid_m, cols, N, HAS_W, HAS_DB)
    t = _weighted(dn, w_ptr, cols, N, stride_w, HAS_W)
    # Whole rows are in registers: both row means come straight from the tile.
    c_th = tl.sum(t * hh, axis=1) / N
    c_t = tl.sum(t, axis=1) / N  # unused (and dropped by the compiler) for RMSNorm
    dx = _dx_tile(t, hh, rstd, c_t, c_th, IS_RMS)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm_norm_bwd_partial_kernel(
    dy_ptr, b_ptr, extra_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr,
    scr_ptr, q1_ptr, q2_ptr, pdw_ptr, pdb_ptr,
    M, N, K,
    stride_dym, stride_dyk, stride_bk, stride_bn, stride_em, stride_en, stride_sm, stride_sn,
    stride_w, stride_scm,
    HAS_EXTRA: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
    IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Multi tile, step 1: tile (pid_m, j) of dn = dy @ b + extra and its partial sums.

    q1[j, row] = sum_tile(t) (LayerNorm only), q2[j, row] = sum_tile(t * hh), scratch = dn,
    pdw[pid_m, cols] = colsum(dn * hh), pdb[pid_m, cols] = colsum(dn).
    """
    pid_m, pid_n, rows, cols = tile_coords(N, BLOCK_M, BLOCK_N)
    mask_m = rows < M
    dn = _grad_tile(
        dy_ptr, b_ptr, extra_ptr, rows, cols, M, N, K,
        stride_dym, stride_dyk, stride_bk, stride_bn, stride_em, stride_en,
        HAS_EXTRA, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
    )
    hh, rstd = _normed_tile(
        src_ptr, mean_ptr, rstd_ptr, rows, cols, M, N, stride_sm, stride_sn, IS_RMS, SRC_NORMED
    )
    _store_affine_partials(dn, hh, pdw_ptr, pdb_ptr, pid_m, cols, N, HAS_W, HAS_DB)
    mask = mask_m[:, None] & (cols < N)[None, :]
    tl.store(scr_ptr + rows[:, None] * stride_scm + cols[None, :], dn.to(scr_ptr.dtype.element_ty), mask=mask)
    t = _weighted(dn, w_ptr, cols, N, stride_w, HAS_W)
    # Row sums from the unrounded fp32 dn; the finalize kernel only divides by N.
    stat = pid_n.to(tl.int64) * M + rows  # row partial buffers are [n_tiles, M]
    tl.store(q2_ptr + stat, tl.sum(t * hh, axis=1), mask=mask_m)
    if not IS_RMS:
        tl.store(q1_ptr + stat, tl.sum(t, axis=1), mask=mask_m)


@triton.jit
def _mm_norm_bwd_finalize_kernel(
    scr_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr, q1_ptr, q2_ptr,
    dx_ptr,
    M, N,
    stride_scm, stride_sm, stride_sn, stride_w, stride_dxm,
    HAS_W: tl.constexpr, IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES_P2: tl.constexpr,
):
    """Multi tile, step 2: c_t = sum_j q1[j, row] / N, c_th = sum_j q2[j, row] / N, then with t = dn * w
    LayerNorm: dx = rstd * (t - c_t - hh * c_th);  RMSNorm: dx = rstd * (t - hh * c_th)."""
    pid_m, pid_n, rows, cols = tile_coords(N, BLOCK_M, BLOCK_N)
    mask_m = rows < M
    mask = mask_m[:, None] & (cols < N)[None, :]
    # Every program re-sums its rows' partials: n_tiles values per row, cheaper than another launch.
    tiles = tl.arange(0, TILES_P2)
    pmask = mask_m[:, None] & (tiles < tl.cdiv(N, BLOCK_N))[None, :]
    pidx = tiles.to(tl.int64)[None, :] * M + rows[:, None]
    c_th = tl.sum(tl.load(q2_ptr + pidx, mask=pmask, other=0.0), axis=1) / N
    dn = tl.load(scr_ptr + rows[:, None] * stride_scm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # hh is rebuilt from src (one more read of it) rather than stored by step 1: same bytes, no scratch.
    hh, rstd = _normed_tile(
        src_ptr, mean_ptr, rstd_ptr, rows, cols, M, N, stride_sm, stride_sn, IS_RMS, SRC_NORMED
    )
    t = _weighted(dn, w_ptr, cols, N, stride_w, HAS_W)
    if IS_RMS:
        dx = rstd[:, None] * (t - hh * c_th[:, None])
    else:
        c_t = tl.sum(tl.load(q1_ptr + pidx, mask=pmask, other=0.0), axis=1) / N
        dx = rstd[:, None] * (t - c_t[:, None] - hh * c_th[:, None])
    tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dx_tile(t, hh, rstd, c_t, c_th, IS_RMS: tl.constexpr):
    """LayerNorm: dx = rstd * (t - c_t - hh * c_th);  RMSNorm: dx = rstd * (t - hh * c_th)."""
    if IS_RMS:
        return rstd[:, None] * (t - hh * c_th[:, None])
    else:
        return rstd[:, None] * (t - c_t[:, None] - hh * c_th[:, None])


@triton.jit
def _mm_norm_bwd_tma_kernel(
    dy_desc, b_desc, extra_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr,
    dx_ptr, pdw_ptr, pdb_ptr,
    M, N, K,
    stride_em, stride_en, stride_sm, stride_sn, stride_w, stride_dxm,
    HAS_EXTRA: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
    IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr, GEMM_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGS: tl.constexpr,
    B_KN: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Single tile on Hopper: ``_mm_norm_bwd_fused_kernel``'s math, dy and b fed by TMA, persistent over
    row blocks (the row block index is the dw/db partial row). GEMM_ONLY stores dn as dx, no norm."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    for rb in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_PROGS, flatten=True):
        rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if PREFETCH and not GEMM_ONLY:
            s = _load_src(src_ptr, rows, cols, M, N, stride_sm, stride_sn)
        dn = tma_tile(dy_desc, b_desc, rb * BLOCK_M, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
        dn = _add_extra(dn, extra_ptr, rows, cols, M, N, stride_em, stride_en, HAS_EXTRA)
        if GEMM_ONLY:
            dx = dn
        else:
            if not PREFETCH:
                s = _load_src(src_ptr, rows, cols, M, N, stride_sm, stride_sn)
            hh, rstd = _normed_from(s, mean_ptr, rstd_ptr, rows, cols, M, N, IS_RMS, SRC_NORMED)
            _store_affine_partials(dn, hh, pdw_ptr, pdb_ptr, rb, cols, N, HAS_W, HAS_DB)
            t = _weighted(dn, w_ptr, cols, N, stride_w, HAS_W)
            c_th = tl.sum(t * hh, axis=1) / N
            c_t = tl.sum(t, axis=1) / N
            dx = _dx_tile(t, hh, rstd, c_t, c_th, IS_RMS)
        tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_extra(dn, extra_ptr, rows, cols, M, N, stride_em, stride_en, HAS_EXTRA: tl.constexpr):
    if HAS_EXTRA:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        ex = tl.load(extra_ptr + rows[:, None] * stride_em + cols[None, :] * stride_en, mask=mask, other=0.0)
        dn += ex.to(tl.float32)
    return dn


@triton.jit
def _mm_norm_bwd_coop_kernel(
    dy_desc, b_desc, extra_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr,
    dx_ptr, pdw_ptr, pdb_ptr, scr_ptr, q1_ptr, q2_ptr, count_ptr,
    M, N, K,
    stride_em, stride_en, stride_sm, stride_sn, stride_w, stride_dxm, stride_scm,
    HAS_EXTRA: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
    IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr, GEMM_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGS: tl.constexpr,
    B_KN: tl.constexpr, N_TILES: tl.constexpr, TILES_P2: tl.constexpr, SPIN: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Rows wider than one tile on Hopper: the forward's cooperative finalize (kernels/triton/mm_norm.py,
    ``_mm_norm_fwd_coop_kernel``) applied to the backward. Each tile (rb, j) computes dn, its dw/db partials
    and its row partial sums (``_mm_norm_bwd_partial_kernel``'s), stores dn in the scratch and bumps the
    row block's counter; the last to arrive sums the row partials and writes dx for the whole row block."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_rb = tl.cdiv(M, BLOCK_M)
    # Not flattened: Triton 3.6's loop fusion fails on the finalize branch's inner loop.
    for tile in tl.range(tl.program_id(0), n_rb * N_TILES, NUM_PROGS):
        rb = tile // N_TILES
        j = tile % N_TILES
        rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (j * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_m = rows < M
        mask = mask_m[:, None] & (cols < N)[None, :]
        if PREFETCH and not GEMM_ONLY:
            s = _load_src(src_ptr, rows, cols, M, N, stride_sm, stride_sn)
        dn = tma_tile(dy_desc, b_desc, rb * BLOCK_M, j * BLOCK_N, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
        dn = _add_extra(dn, extra_ptr, rows, cols, M, N, stride_em, stride_en, HAS_EXTRA)
        if GEMM_ONLY:
            tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dn.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            if not PREFETCH:
                s = _load_src(src_ptr, rows, cols, M, N, stride_sm, stride_sn)
            hh, rstd = _normed_from(s, mean_ptr, rstd_ptr, rows, cols, M, N, IS_RMS, SRC_NORMED)
            _store_affine_partials(dn, hh, pdw_ptr, pdb_ptr, rb, cols, N, HAS_W, HAS_DB)
            if not SPIN:
                tl.store(scr_ptr + rows[:, None] * stride_scm + cols[None, :], dn.to(scr_ptr.dtype.element_ty),
                         mask=mask)
            t = _weighted(dn, w_ptr, cols, N, stride_w, HAS_W)
            stat = j.to(tl.int64) * M + rows
            tl.store(q2_ptr + stat, tl.sum(t * hh, axis=1), mask=mask_m)
            if not IS_RMS:
                tl.store(q1_ptr + stat, tl.sum(t, axis=1), mask=mask_m)
            tl.debug_barrier()  # every thread's stores happen before the counter's release
            arrived = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
            if SPIN:
                # Wait for the row block's other tiles (co-resident: see the forward), then dx from registers.
                seen = arrived + 1
                while seen < N_TILES:
                    seen = tl.atomic_add(count_ptr + rb, 0, sem="acquire", scope="gpu")
                c_t, c_th = _row_sums(rows, M, N, q1_ptr, q2_ptr, IS_RMS, N_TILES, TILES_P2)
                dx = _dx_tile(t, hh, rstd, c_t, c_th, IS_RMS)
                tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                         mask=mask)
            elif arrived == N_TILES - 1:
                _bwd_finalize_row_block(
                    rows, M, N, scr_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr, q1_ptr, q2_ptr, dx_ptr,
                    stride_scm, stride_sm, stride_sn, stride_w, stride_dxm,
                    HAS_W, IS_RMS, SRC_NORMED, BLOCK_N, N_TILES, TILES_P2,
                )


@triton.jit
def _row_sums(rows, M, N, q1_ptr, q2_ptr, IS_RMS: tl.constexpr, N_TILES: tl.constexpr, TILES_P2: tl.constexpr):
    """(c_t, c_th): the row means of t and t * hh from the N_TILES partial sums (".cg": written by other
    SMs); c_t is unused for RMSNorm."""
    mask_m = rows < M
    tiles = tl.arange(0, TILES_P2)
    pmask = mask_m[:, None] & (tiles < N_TILES)[None, :]
    pidx = tiles.to(tl.int64)[None, :] * M + rows[:, None]
    c_th = tl.sum(tl.load(q2_ptr + pidx, mask=pmask, other=0.0, cache_modifier=".cg"), axis=1) / N
    if IS_RMS:
        c_t = c_th
    else:
        c_t = tl.sum(tl.load(q1_ptr + pidx, mask=pmask, other=0.0, cache_modifier=".cg"), axis=1) / N
    return c_t, c_th


@triton.jit
def _bwd_finalize_row_block(
    rows, M, N, scr_ptr, src_ptr, w_ptr, mean_ptr, rstd_ptr, q1_ptr, q2_ptr, dx_ptr,
    stride_scm, stride_sm, stride_sn, stride_w, stride_dxm,
    HAS_W: tl.constexpr, IS_RMS: tl.constexpr, SRC_NORMED: tl.constexpr,
    BLOCK_N: tl.constexpr, N_TILES: tl.constexpr, TILES_P2: tl.constexpr,
):
    """The last program of a row block: c_t, c_th from the N_TILES partials, then dx for every tile from the
    scratch dn (".cg": written by other SMs) and hh rebuilt from src."""
    mask_m = rows < M
    c_t, c_th = _row_sums(rows, M, N, q1_ptr, q2_ptr, IS_RMS, N_TILES, TILES_P2)
    for jj in range(N_TILES):
        cols = (jj * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = mask_m[:, None] & (cols < N)[None, :]
        dn = tl.load(scr_ptr + rows[:, None] * stride_scm + cols[None, :], mask=mask, other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        hh, rstd = _normed_tile(
            src_ptr, mean_ptr, rstd_ptr, rows, cols, M, N, stride_sm, stride_sn, IS_RMS, SRC_NORMED
        )
        t = _weighted(dn, w_ptr, cols, N, stride_w, HAS_W)
        dx = _dx_tile(t, hh, rstd, c_t, c_th, IS_RMS)
        tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the launcher writes (outputs, partials, scratch) comes from here (tests poison it); the
    forward launcher's allocator (Inductor's ``_empty_strided_cuda`` where it can: less host time)."""
    return mm_norm_kernels._alloc(shape, dtype, device)


def mm_norm_backward_triton(
    dy: Tensor,
    b: Tensor,
    extra: Optional[Tensor],
    src: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    is_rms: bool,
    src_is_normed: bool,
    has_bias: bool,
    dx_dtype: torch.dtype,
    config: Optional[GemmConfig],
    gemm_only: bool = False,
    plan_out: Optional[list] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db) of ``mm_norm_backward_reference``; inputs already checked by the op.

    ``config``: the configuration to run, one of tuning/mm_norm_backward.py's ``backward_candidates`` (None
    only where M = 0: nothing launches). A Gluon one ("gl_*") whose specialization spills registers raises
    ``SpillError`` (kernels/hopper/mm_norm.py) before launching anything; the op then runs the ``tl`` kernels
    (ops/mm_norm_backward.py). ``gemm_only`` (TMA configs only): dx = dy @ b + extra, no norm (the
    benchmark's GEMM base). ``plan_out``: where a Gluon launch appends a function that launches the same again
    on inputs of the same signature (``mm_norm_backward_cuda`` in ops/mm_norm_backward.py caches it)."""
    m, k = dy.shape
    n = b.shape[1]
    dev = dy.device
    f32 = torch.float32
    has_w = weight is not None
    dx = _alloc((m, n), dx_dtype, dev)
    if m == 0:
        # Sums over no rows are zeros, not empty.
        dw = torch.zeros((n,) if has_w else (0,), dtype=f32, device=dev)
        db = torch.zeros((n,) if has_bias else (0,), dtype=f32, device=dev)
        return dx, dw, db

    if config.kind.startswith("gl_"):
        from ..hopper.mm_norm_backward import BackwardPlan

        plan = BackwardPlan(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, config,
                            lambda shape, dtype: _alloc(shape, dtype, dev), dx)
        dw, db = plan(dy, b, extra, src, weight, mean, rstd, dx)
        if plan_out is not None:
            plan_out.append(_gluon_launcher(plan, m, n, dx_dtype, dev))
        return dx, dw, db
    if config.kind == "spin" and triton.cdiv(n, config.block_n) > num_sms(dev):
        tiles = triton.cdiv(n, config.block_n)
        raise ValueError(f"{config.label()}: a row block's {tiles} tiles cannot all be resident (spin exchange)")
    block_m, block_n, block_k, num_warps = config.block_m, config.block_n, config.block_k, config.warps
    single = n <= block_n
    m_tiles = triton.cdiv(m, block_m)
    pdw = _alloc((m_tiles, n), f32, dev) if has_w else None
    pdb = _alloc((m_tiles, n), f32, dev) if has_bias else None
    # mean is read only for LayerNorm with src the norm's input; otherwise pass rstd as a never-read stand-in.
    mean_arg = mean if not (is_rms or src_is_normed) else rstd
    strides = (
        dy.stride(0), dy.stride(1), b.stride(0), b.stride(1),
        extra.stride(0) if extra is not None else 0,
        extra.stride(1) if extra is not None else 0,
        src.stride(0), src.stride(1),
        weight.stride(0) if has_w else 0,
    )
    flags = dict(
        HAS_EXTRA=extra is not None, HAS_W=has_w, HAS_DB=has_bias, IS_RMS=is_rms, SRC_NORMED=src_is_normed
    )
    g_dtype = torch.promote_types(dy.dtype, extra.dtype) if extra is not None else dy.dtype
    if config.kind in ("row", "coop", "spin"):
        layout = tma_layout(dy, b)
        progs = num_sms(dev) * config.progs_per_sm
        common = dict(
            **flags, GEMM_ONLY=gemm_only, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, B_KN=layout == "kn",
            PREFETCH=config.prefetch,
            num_warps=num_warps, num_stages=config.stages,
        )
        descs = tma_descriptors(dy, b, layout, block_m, block_n, block_k)
        tma_strides = (*strides[4:], dx.stride(0))
        if config.kind == "row":
            grid = min(progs, m_tiles)
            _mm_norm_bwd_tma_kernel[(grid,)](
                *descs, extra, src, weight, mean_arg, rstd, dx, pdw, pdb, m, n, k, *tma_strides,
                NUM_PROGS=grid, **common,
            )
        else:
            spin = config.kind == "spin"  # keeps dn in registers: no scratch (dx stands in, never read)
            scratch = dx if spin or dx_dtype in (f32, g_dtype) else _alloc((m, n), g_dtype, dev)
            n_tiles = triton.cdiv(n, block_n)
            q2 = _alloc((n_tiles, m), f32, dev)
            q1 = _alloc((n_tiles, m), f32, dev) if not is_rms else q2
            count = torch.zeros((m_tiles,), dtype=torch.int32, device=dev)
            grid = min(cooperative_grid(dev, n_tiles, config.progs_per_sm), m_tiles * n_tiles)
            _mm_norm_bwd_coop_kernel[(grid,)](
                *descs, extra, src, weight, mean_arg, rstd, dx, pdw, pdb, scratch, q1, q2, count, m, n, k,
                *tma_strides, scratch.stride(0),
                NUM_PROGS=grid, N_TILES=n_tiles, TILES_P2=triton.next_power_of_2(n_tiles), SPIN=spin, **common,
            )
        return _column_sums(dx, pdw, pdb, has_w, has_bias, dev)
    if gemm_only:
        raise ValueError("gemm_only needs a TMA configuration")
    precision = dot_input_precision(dy.dtype, dev)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=precision)
    if single:
        _mm_norm_bwd_fused_kernel[(m_tiles,)](
            dy, b, extra, src, weight, mean_arg, rstd, dx, pdw, pdb,
            m, n, k, *strides, dx.stride(0),
            **flags, **tiles, num_warps=num_warps, num_stages=3,
        )
    else:
        # Scratch for dn (module docstring): dx when it is fp32 or dn's unfused dtype, else a buffer.
        scratch = dx if dx_dtype in (f32, g_dtype) else _alloc((m, n), g_dtype, dev)
        n_tiles = triton.cdiv(n, block_n)
        q2 = _alloc((n_tiles, m), f32, dev)
        q1 = _alloc((n_tiles, m), f32, dev) if not is_rms else q2
        _mm_norm_bwd_partial_kernel[(m_tiles * n_tiles,)](
            dy, b, extra, src, weight, mean_arg, rstd, scratch, q1, q2, pdw, pdb,
            m, n, k, *strides, scratch.stride(0),
            **flags, **tiles, num_warps=num_warps, num_stages=3,
        )
        fin_m = finalize_block_m(m, block_n)
        _mm_norm_bwd_finalize_kernel[(triton.cdiv(m, fin_m) * n_tiles,)](
            scratch, src, weight, mean_arg, rstd, q1, q2, dx,
            m, n, scratch.stride(0), src.stride(0), src.stride(1), strides[-1], dx.stride(0),
            HAS_W=has_w, IS_RMS=is_rms, SRC_NORMED=src_is_normed,
            BLOCK_M=fin_m, BLOCK_N=block_n, TILES_P2=triton.next_power_of_2(n_tiles),
            num_warps=FINALIZE_WARPS,
        )
    return _column_sums(dx, pdw, pdb, has_w, has_bias, dev)


def _column_sums(dx, pdw, pdb, has_w, has_bias, dev):
    """(dx, dw, db): deterministic column sums, a fixed-order reduction of the [m_tiles, N] partials."""
    dw = pdw.sum(0) if has_w else _alloc((0,), torch.float32, dev)
    db = pdb.sum(0) if has_bias else _alloc((0,), torch.float32, dev)
    return dx, dw, db


def _gluon_launcher(plan, m: int, n: int, dx_dtype, dev) -> Callable:
    """What ``plan_out`` receives from a Gluon launch: the plan relaunched on new inputs of the same signature,
    into a fresh dx."""

    def launch(dy, b, extra, src, weight, mean, rstd):
        dx = _alloc((m, n), dx_dtype, dev)
        dw, db = plan(dy, b, extra, src, weight, mean, rstd, dx)
        return dx, dw, db

    return launch
