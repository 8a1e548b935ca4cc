"""Triton kernels and launcher for ``fusenorm::mm_norm``: ``y = norm(a @ b + bias + residual)``.

Semantics, output shapes and dtypes are those of ``mm_norm_reference`` (mm_norm.py): the GEMM accumulates in
fp32, bias and residual are added in fp32, statistics are fp32, y is rounded once to ``out_dtype``, hh once
to the pre-norm dtype.

Two paths, chosen by ``gemm_config`` (_triton_common.py):

- single tile (N <= 256): one program owns BLOCK_M full rows: the GEMM tile, bias/residual, the row
  statistics in registers (two-pass for LayerNorm), then y, hh, mean, rstd (``_full_row_epilogue``).
  On Hopper with TMA-compatible operands (``tma_eligible``: 16-bit, A row-major, b a transposed row-major
  weight, 16-byte aligned rows) ``_mm_norm_fwd_tma_kernel`` does this in a persistent loop fed by TMA
  (measured: benchmarks/probe_gemm_base.py); otherwise ``_mm_norm_fwd_fused_kernel`` with masked pointer
  loads, any strides, grid cdiv(M, BLOCK_M).
- multi tile (N > 256): a row spans cdiv(N, BLOCK_N) programs that cannot talk to each other (no DSMEM in
  Triton 3.6, platform.md), so the reduction is split:
  1. ``_mm_norm_fwd_partial_kernel`` (grid cdiv(M, BLOCK_M) * n_tiles) writes per-(tile, row) fp32
     partials: LayerNorm the tile mean and tile M2 (two-pass in registers), RMSNorm the tile sum of
     squares; and the tile's h into a scratch, for LayerNorm *centered on the tile mean*;
  2. ``_mm_norm_fwd_finalize_kernel`` (grid cdiv(M, FIN_BLOCK_M) * n_tiles) combines the partials of its
     rows (Chan's formula), reads the scratch back and writes y, hh, mean, rstd (in place when the scratch
     is y or hh).

The scratch (the multi-tile h round trip): y itself when ``out_dtype`` is fp32 or the pre-norm dtype, else
hh when it is written (it has the pre-norm dtype), else a fresh buffer in the pre-norm dtype. So h is rounded
at most to the precision the unfused graph materializes it in (``a @ b + residual`` in the pre-norm dtype),
never to a narrower ``out_dtype``, and no extra buffer is allocated in the common cases. Storing
``h - tile_mean`` rather than h for LayerNorm keeps that rounding relative to the row's spread instead of to
|h|: with |mean| >> std (e.g. rows of 1000 + N(0, 1) in fp16, ulp(1000) = 0.5) rounding h itself would
destroy hh, whereas the centered value rounds like the final output does. The tile mean stays in fp32 (the
partials) and is added back in fp32 in step 2. (An always-fp32 scratch would be exact but makes the round
trip 8 bytes per element instead of 4 for 16-bit models.)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_common import (
    FINALIZE_WARPS,
    TMA_SINGLE_CONFIG,
    chan_combine,
    dot_input_precision,
    finalize_block_m,
    gemm_config,
    num_sms,
    tensor_descriptor,
    tile_coords,
    tile_matmul,
    tma_eligible,
)

__all__ = ["mm_norm_triton"]

# Test hook: when set (a power of two >= 16), the N tile is this size, so N > _FORCE_BLOCK_N takes the
# multi-tile path even for small N (the interpreter tests cover both paths with small shapes).
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
    # Same order as the reference: (a @ b + bias) + residual, all in fp32.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
        h += bias.to(tl.float32)[None, :]
    if HAS_RES:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask, other=0.0)
        h += res.to(tl.float32)
    return h


@triton.jit
def _affine_store(
    hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
    HAS_W: tl.constexpr, HAS_NB: tl.constexpr, SAVE_NORMED: tl.constexpr,
):
    """y = hh * w + nb (fp32, rounded once to y's dtype); hh stored too when SAVE_NORMED."""
    mask_n = cols < N
    mask = (rows < M)[:, None] & mask_n[None, :]
    y = hh
    if HAS_W:
        w = tl.load(w_ptr + cols * stride_w, mask=mask_n, other=0.0)
        y = y * w.to(tl.float32)[None, :]
    if HAS_NB:
        nb = tl.load(nb_ptr + cols * stride_nb, mask=mask_n, other=0.0)
        y = y + nb.to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if SAVE_NORMED:
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
    _affine_store(
        hh, y_ptr, hh_ptr, w_ptr, nb_ptr, rows, cols, M, N, stride_ym, stride_hm, stride_w, stride_nb,
        HAS_W, HAS_NB, SAVE_NORMED,
    )


@triton.jit
def _mm_norm_fwd_tma_kernel(
    a_desc, w_desc, bias_ptr, res_ptr, w_ptr, nb_ptr,
    y_ptr, hh_ptr, mean_ptr, rstd_ptr,
    M, N, K,
    stride_bias, stride_rm, stride_rn, stride_w, stride_nb, stride_ym, stride_hm,
    eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_NB: tl.constexpr,
    IS_RMS: tl.constexpr, SAVE_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr,
):
    """Single tile on Hopper: the same math as ``_mm_norm_fwd_fused_kernel``, with A [M, K] and the weight
    W = b.T [N, K] fed by TMA (host-side descriptors; out-of-bounds rows/columns/K read as 0) and a
    persistent, flattened loop over row blocks, so the next block's loads overlap this block's epilogue.
    """
    k_tiles = tl.cdiv(K, BLOCK_K)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    for rb in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_SMS, flatten=True):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([rb * BLOCK_M, ki * BLOCK_K])
            w = w_desc.load([0, ki * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride must not overflow
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        if HAS_RES:
            res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask, other=0.0)
            acc += res.to(tl.float32)
        _full_row_epilogue(
            acc, rows, cols, M, N, w_ptr, nb_ptr, y_ptr, hh_ptr, mean_ptr, rstd_ptr,
            stride_w, stride_nb, stride_ym, stride_hm, eps, HAS_W, HAS_NB, IS_RMS, SAVE_NORMED,
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


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the launcher writes (outputs, partials, scratch) comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, hh, mean, rstd) of ``mm_norm_reference``; inputs already checked by the op."""
    m, k = a.shape
    n = b.shape[1]
    dev = a.device
    out_dtype = out_dtype or a.dtype
    h_dtype = torch.promote_types(a.dtype, residual.dtype) if residual is not None else a.dtype
    f32 = torch.float32
    y = _alloc((m, n), out_dtype, dev)
    hh = _alloc((m, n), h_dtype, dev) if save_normed else _alloc((0,), f32, dev)
    mean = _alloc((0,) if is_rms else (m,), f32, dev)
    rstd = _alloc((m,), f32, dev)
    if m == 0:
        return y, hh, mean, rstd

    block_m, block_n, block_k, num_warps, single = gemm_config(m, n, k, a.dtype, dev, _FORCE_BLOCK_N)
    precision = dot_input_precision(a.dtype, dev)
    gemm_args = (
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        bias.stride(0) if bias is not None else 0,
        residual.stride(0) if residual is not None else 0,
        residual.stride(1) if residual is not None else 0,
    )
    w_strides = (
        weight.stride(0) if weight is not None else 0,
        norm_bias.stride(0) if norm_bias is not None else 0,
    )
    hh_stride = hh.stride(0) if save_normed else 0
    if single and tma_eligible(a, b, block_n):
        bm, bk, stages, warps = TMA_SINGLE_CONFIG
        sms = num_sms(dev)
        _mm_norm_fwd_tma_kernel[(min(sms, triton.cdiv(m, bm)),)](
            tensor_descriptor(a, [bm, bk]), tensor_descriptor(b.t(), [block_n, bk]),
            bias, residual, weight, norm_bias, y, hh, mean, rstd, m, n, k,
            gemm_args[4], gemm_args[5], gemm_args[6], *w_strides, y.stride(0), hh_stride, float(eps),
            HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            HAS_W=weight is not None, HAS_NB=norm_bias is not None,
            IS_RMS=is_rms, SAVE_NORMED=save_normed,
            BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=bk, NUM_SMS=sms,
            num_warps=warps if block_n > 64 else 4, num_stages=stages,
        )
        return y, hh, mean, rstd
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

    # Multi tile: pick the scratch for h (module docstring): fp32 when y is fp32, else the pre-norm dtype.
    if out_dtype == f32 or out_dtype == h_dtype:
        scratch = y
    elif save_normed:
        scratch = hh
    else:
        scratch = _alloc((m, n), h_dtype, dev)
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
