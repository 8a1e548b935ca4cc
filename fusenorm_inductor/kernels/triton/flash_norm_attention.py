"""Triton kernels and launchers for ``fusenorm::flash_norm_attention`` (FlashNormAttention, docs/algorithms.md
section 5). Semantics, roundings and the backward's recompute: flash_norm_attention.py's module docstring.

The cross-head problem. Both norms span all H*D features of a token, while attention is per head. The seed
puts the H heads of a Q tile in H CTAs of a cluster that trade row sums through DSMEM; Triton 3.6 on Hopper
has no DSMEM (docs/platform.md). Here the sums over all heads run in **per-token kernels** (one program per
BLOCK_T tokens, looping over the heads), and the attention in **per-(Q tile, head) kernels** shaped like the
GDPA kernels, which rebuild ln_q from q and the LayerNorm statistics on load:

  forward   1. _stats_kernel      LayerNorm statistics of each token over its H*D features: fp32 sums shifted
                                  by p = q[t, 0, 0] (one-pass variance without E[x^2] - E[x]^2's cancellation
                                  when |mean| >> std) -> mean, rstd.
            2. _attn_fwd_kernel   per (Q tile, head), the H programs of a tile adjacent (they read the same q
                                  rows): ln_q_h (* g1 + b1) in registers, o_h = sum over S tiles of
                                  (act(ln_q_h K^T) * scale) V + ln_q_h (the accumulator starts at ln_q), o
                                  stored rounded to q's dtype (rms_in, saved for the backward), sum(o_h^2) per
                                  token to ss [T, H] fp32.
            3. _fwd_finish_kernel rms_rstd from ss, out = o * rms_rstd (* g2) + q.
  backward  1. _rms_bwd_kernel    c2 = sum(dout * g2 * o) over the heads, d(o) = rms_rstd * (dout g2 - o *
                                  rms_rstd^2 * c2 / (H D)) to a buffer in q's dtype (the MMA operand);
                                  rms_weight's column sums.
            2. _attn_bwd_kernel   per (Q tile, head): S = ln_q K^T, dP = d(o) V^T, dS = act'(S) * scale * dP,
                                  d(ln_q) = dS K + d(o) (residual 1), rounded to q's dtype, into dq's buffer.
            3. _dkdv_kernel       per (S tile, b, h), the programs of a sequence adjacent: owns its dK/dV
                                  tiles and walks the sequence's Q tiles (S^T = K ln_q^T, dV += act(S^T) *
                                  scale d(o), dP^T = V d(o)^T, dK += (act'(S^T) * scale * dP^T) ln_q). No
                                  atomics: deterministic; a sequence without tokens gets zeros.
            4. _ln_bwd_kernel     ca = sum(t1), cb = sum(t1 ln_hat) over the heads (t1 = d(ln_q) * g1), then
                                  dq = rstd * (t1 - ca / (H D) - ln_hat * cb / (H D)) + dout (residual 2), in
                                  place of d(ln_q); ln_weight's and ln_bias's column sums.
  Weight gradients: per-program fp32 partials [programs, H*D], summed by torch.
The matmuls are GDPA's (2 forward, 7 backward per head, S tile and Q tile); the norms cost passes over
[T, H, D] around them: HBM sees q three times in the forward (statistics, attention, finish) where a
one-kernel block would read it once.

Measured (H200, B = 768, S = 128, D = 128, bf16, Lmax = 1024; ms forward / backward; GDPA kernels alone 0.278 /
0.773 at H = 2, 1.06 / 2.97 at H = 8): this design 0.574 / 1.497 at H = 2, 2.216 / 5.989 at H = 8,
0.789 / 2.218 at H = 1, Lmax = 3000. The first design, one program owning a Q tile of all heads and making
passes over them (row sums in registers, o staged through L2 between passes; the backward the same with a
per-(S tile, b, h) dK/dV kernel), measured 0.565 / 2.348, 2.313 / 9.001 and 0.709 / 2.757: equal within 4%
in the forward at H <= 4 (10% faster at H = 1), 36-38% slower in the backward. Its loop over the heads around
the S-tile loop took the forward to 238-255 registers per thread (136 for one head: sm_90 compile), 2 CTAs
per SM instead of 3, and its backward's 64-row tiles spilled. It was removed after that measurement
(docs/history/, Attention, second round). Both are about 2x the GDPA kernels' time: neither beats GDPA +
Inductor's norms by the issue's margin (docs/performance.md).

MMA operands are q's dtype (ln_q, P, d(o), dS rounded to it, as the reference does), accumulation fp32; fp32
inputs use ``dot_input_precision`` (exact unless TF32 is allowed for CUDA matmuls).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import dot_input_precision, pow2_at_least
from ...activations import activation_code
from .activations import act_bwd, act_fwd

__all__ = ["FnaConfig", "fna_config", "flash_norm_attention_triton", "flash_norm_attention_backward_triton"]

# The forward's attention step on sm_90 as a Gluon kernel (kernels/hopper/gdpa.py, fna_attention_gluon) where it
# takes the inputs; a switch so the benchmarks can time the Triton attention step beside it.
GLUON_ATTENTION = True
# Where H = 1 the norms span one tile, and the whole forward (the LayerNorm's statistics, the attention, the
# RMSNorm and both residuals) runs as one Gluon kernel (kernels/hopper/gdpa.py, fna_block_gluon) instead of three
# launches, which measures as fast as or faster than the three (docs/history/); a switch so the benchmarks can
# time the three-kernel path beside it.
GLUON_BLOCK = True


class FnaConfig(NamedTuple):
    block_m: int  # tokens per Q tile (forward, backward Q-tile kernel); Q rows per step (dK/dV kernel)
    block_n: int  # KV positions per S tile
    warps: int
    stages: int = 3  # software-pipelining depth of the loops (Triton num_stages)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _head_ptrs(ptr, rows, h, dcols, stride_t, stride_h, stride_d):
    return ptr + rows[:, None] * stride_t + h * stride_h + dcols[None, :] * stride_d


@triton.jit
def _tile_mask(row_ok, d_ok, EVEN_D: tl.constexpr):
    """The mask of a [rows, BLOCK_D] tile. With D == BLOCK_D (EVEN_D) only the rows are masked: a column mask
    with a runtime D made every global load and store of the first kernels a scalar 2-byte access (PTX of an
    sm_90 compile: 331 ld.global.b16 in the forward) instead of 16-byte vectors."""
    if EVEN_D:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & d_ok[None, :]


@triton.jit
def _ln_stats(q_ptr, rows, row_ok, dcols, mask, H, D, sq_t, sq_h, sq_d, eps, BLOCK_M: tl.constexpr):
    """Pass 1: (mean, rstd) of each token over its H*D features, fp32 sums shifted by p = q[t, 0, 0]."""
    pivot = tl.load(q_ptr + rows * sq_t, mask=row_ok, other=0.0).to(tl.float32)
    s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for h in range(H):
        x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
        dx = tl.where(mask, x - pivot[:, None], 0.0)  # padded columns would add 0 - p
        s1 += tl.sum(dx, axis=1)
        s2 += tl.sum(dx * dx, axis=1)
    n = H * D
    shift = s1 / n
    var = tl.maximum(s2 / n - shift * shift, 0.0)
    return pivot + shift, tl.rsqrt(var + eps)


@triton.jit
def _head_vec(w_ptr, h, D, dcols, d_ok):
    """Head h's slice of an [H*D] weight as an fp32 [1, BLOCK_D] row (0 in padded columns)."""
    return tl.load(w_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _ln_apply(x, mean, rstd, w1_ptr, b1_ptr, h, D, dcols, d_ok, mask, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """(ln_hat, ln_q) of one head's [BLOCK_M, BLOCK_D] fp32 tile, 0 outside the valid rows/columns."""
    lnhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    lnq = lnhat
    if HAS_W1:
        lnq = lnq * _head_vec(w1_ptr, h, D, dcols, d_ok)
    if HAS_B1:
        lnq = lnq + tl.where(mask, _head_vec(b1_ptr, h, D, dcols, d_ok), 0.0)
    return lnhat, lnq


@triton.jit
def _lnq_tile(q_ptr, mean_ptr, rstd_ptr, w1_ptr, b1_ptr, rows, row_ok, h, D, dcols, d_ok, mask, sq_t, sq_h, sq_d,
              HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """ln_q (fp32) of head h of ``rows``, rebuilt from q and the saved statistics (mean_ptr / rstd_ptr point
    at the statistics of the token q_ptr points at)."""
    x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    return _ln_apply(x, mean, rstd, w1_ptr, b1_ptr, h, D, dcols, d_ok, mask, HAS_W1, HAS_B1)[1]


@triton.jit
def _kv_offsets(dcols, sk_s, sk_d, sv_s, sv_d, BLOCK_N: tl.constexpr):
    """(local rows, int32 K and V offsets) of a [BLOCK_N, BLOCK_D] K/V tile; loop-invariant, the scalar base
    pointers advance per tile, as in the GDPA kernels."""
    ns = tl.arange(0, BLOCK_N)
    return ns, ns[:, None] * sk_s + dcols[None, :] * sk_d, ns[:, None] * sv_s + dcols[None, :] * sv_d


@triton.jit
def _kv_pair(k_ptr, v_ptr, k_offs, v_offs, n_ok, d_ok, EVEN_D: tl.constexpr):
    """The K and V tiles at the given bases; rows past S (not n_ok) load as 0."""
    mask = _tile_mask(n_ok, d_ok, EVEN_D)
    return tl.load(k_ptr + k_offs, mask=mask, other=0.0), tl.load(v_ptr + v_offs, mask=mask, other=0.0)


@triton.jit
def _attend(acc, lnq_op, k_ptr, v_ptr, k_base, v_base, S, sk_s, sk_d, sv_s, sv_d, dcols, d_ok, scale,
            ACT: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr):
    """acc + sum over S tiles of (act(ln_q K^T) * scale) V for one head, fp32 [BLOCK_M, BLOCK_D]; P is rounded
    to V's dtype for the MMA. Padded KV rows give S = 0 and act(0) = 0 (every activation), and V rows of 0.
    The caller passes acc = ln_q (residual 1): the fp32 ln_q tile is then not live across the loop (it was, as
    a separate addend, and took the forward to 255 registers and a 208-byte stack spill per thread)."""
    k_ptr += k_base
    v_ptr += v_base
    ns, k_offs, v_offs = _kv_offsets(dcols, sk_s, sk_d, sv_s, sv_d, BLOCK_N)
    for n0 in range(0, S, BLOCK_N):
        kt, vt = _kv_pair(k_ptr, v_ptr, k_offs, v_offs, ns < S - n0, d_ok, EVEN_D)
        s = tl.dot(lnq_op, tl.trans(kt), input_precision=INPUT_PRECISION)
        p = act_fwd(s, ACT) * scale
        acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=INPUT_PRECISION)
        k_ptr += BLOCK_N * sk_s
        v_ptr += BLOCK_N * sv_s
    return acc


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, w1_ptr, b1_ptr, mean_ptr, rstd_ptr, do_buf, dk_ptr, dv_ptr,
    H, D: tl.constexpr, S, n_s,
    sq_t, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
    scale,
    ACT: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """dK and dV of S tile pid % n_s of (b, h) = divmod(pid // n_s, H) (module docstring, backward pass D): the
    program owns its [BLOCK_N, D] dK/dV tiles and walks the sequence's Q tiles, rebuilding ln_q from q and
    the saved statistics and reading d(o) from do_buf. dk, dv: contiguous [B, S, H, D] in k's dtype."""
    pid = tl.program_id(0)
    bh = pid // n_s
    b = (bh // H).to(tl.int64)
    h = bh % H
    start = tl.load(off_ptr + b).to(tl.int64)
    n_rows = (tl.load(off_ptr + b + 1).to(tl.int64) - start).to(tl.int32)
    n = H * D
    s0 = (pid % n_s) * BLOCK_N
    dcols = tl.arange(0, BLOCK_D)
    d_ok = dcols < D
    ns, k_offs, v_offs = _kv_offsets(dcols, sk_s, sk_d, sv_s, sv_d, BLOCK_N)
    n_ok = ns < S - s0
    kv_mask = _tile_mask(n_ok, d_ok, EVEN_D)
    kt, vt = _kv_pair(k_ptr + b * sk_b + h * sk_h + s0 * sk_s, v_ptr + b * sv_b + h * sv_h + s0 * sv_s, k_offs, v_offs,
                      n_ok, d_ok, EVEN_D)
    op_ty = k_ptr.dtype.element_ty
    # Rebased at the sequence's first token (int64 scalars), rows local to the sequence (int32).
    q_ptr += start * sq_t
    do_buf += start * n
    mean_ptr += start
    rstd_ptr += start
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for m0 in range(0, n_rows, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = _tile_mask(row_ok, d_ok, EVEN_D)
        lnq_op = _lnq_tile(q_ptr, mean_ptr, rstd_ptr, w1_ptr, b1_ptr, rows, row_ok, h, D, dcols, d_ok, mask,
                           sq_t, sq_h, sq_d, HAS_W1, HAS_B1).to(op_ty)
        do_op = tl.load(_head_ptrs(do_buf, rows, h, dcols, n, D, 1), mask=mask, other=0.0)
        # Transposed tiles (S^T = K ln_q^T, [BLOCK_N, BLOCK_M]): the products land in dK/dV's layout.
        s_t = tl.dot(kt, tl.trans(lnq_op), input_precision=INPUT_PRECISION)
        p_op = (act_fwd(s_t, ACT) * scale).to(op_ty)
        dv = tl.dot(p_op, do_op, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(vt, tl.trans(do_op), input_precision=INPUT_PRECISION)
        ds_op = (act_bwd(s_t, ACT) * scale * dp_t).to(op_ty)
        dk = tl.dot(ds_op, lnq_op, dk, input_precision=INPUT_PRECISION)
    dk_ptr += (b * S + s0) * n + h * D  # int64 scalar base, int32 offsets in the tile
    dv_ptr += (b * S + s0) * n + h * D
    kv_offs = ns[:, None] * n + dcols[None, :]
    tl.store(dk_ptr + kv_offs, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _token_tile(T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows pid * BLOCK_T .. + BLOCK_T of the [T, H, D] tensors: (row0 int64, local rows, masks)."""
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < (T - row0).to(tl.int32)
    dcols = tl.arange(0, BLOCK_D)
    d_ok = dcols < D
    return row0, rows, row_ok, dcols, d_ok, _tile_mask(row_ok, d_ok, EVEN_D)


@triton.jit
def _head_tile(off_ptr, n_m, H, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """This program's (Q tile, head): h = pid % H fastest (the H programs of a Q tile read the same q rows),
    then the tile, then the sequence b. Returns b (int64), h, row0 (int64), n_rows (int32, <= 0 past the
    sequence's end), the local rows, column indices and masks."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // (H * n_m)).to(tl.int64)
    start = tl.load(off_ptr + b).to(tl.int64)
    end = tl.load(off_ptr + b + 1).to(tl.int64)
    row0 = start + ((pid // H) % n_m) * BLOCK_M
    n_rows = (end - row0).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    dcols = tl.arange(0, BLOCK_D)
    d_ok = dcols < D
    return b, h, row0, n_rows, rows, row_ok, dcols, d_ok, _tile_mask(row_ok, d_ok, EVEN_D)


@triton.jit
def _stats_kernel(q_ptr, mean_ptr, rstd_ptr, T, H, D: tl.constexpr, sq_t, sq_h, sq_d, ln_eps,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """Forward 1: the LayerNorm statistics of BLOCK_T tokens over all heads."""
    row0, rows, row_ok, dcols, d_ok, mask = _token_tile(T, D, BLOCK_T, BLOCK_D, EVEN_D)
    q_ptr += row0 * sq_t
    mean, rstd = _ln_stats(q_ptr, rows, row_ok, dcols, mask, H, D, sq_t, sq_h, sq_d, ln_eps, BLOCK_T)
    tl.store(mean_ptr + row0 + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + row0 + rows, rstd, mask=row_ok)


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, w1_ptr, b1_ptr, mean_ptr, rstd_ptr, o_ptr, ss_ptr,
    H, D: tl.constexpr, S, n_m,
    sq_t, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
    scale,
    ACT: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """Forward 2, one (Q tile, head): o_h = attention(ln_q_h) + ln_q_h (ln_q from q and the statistics) to o,
    rounded to q's dtype; the head's sum(o_h^2) per token to ss [T, H] (fp32)."""
    b, h, row0, n_rows, rows, row_ok, dcols, d_ok, mask = _head_tile(off_ptr, n_m, H, D, BLOCK_M, BLOCK_D, EVEN_D)
    if n_rows > 0:
        q_ptr += row0 * sq_t
        o_ptr += row0 * (H * D)
        ss_ptr += row0 * H
        lnq = _lnq_tile(q_ptr, mean_ptr + row0, rstd_ptr + row0, w1_ptr, b1_ptr, rows, row_ok, h, D, dcols, d_ok,
                        mask, sq_t, sq_h, sq_d, HAS_W1, HAS_B1)
        o = _attend(lnq, lnq.to(k_ptr.dtype.element_ty), k_ptr, v_ptr, b * sk_b + h * sk_h, b * sv_b + h * sv_h,
                    S, sk_s, sk_d, sv_s, sv_d, dcols, d_ok, scale, ACT, BLOCK_N, INPUT_PRECISION, EVEN_D)
        o = o.to(o_ptr.dtype.element_ty)  # rounded as stored: the RMS sees the o the backward gets
        of = o.to(tl.float32)
        tl.store(_head_ptrs(o_ptr, rows, h, dcols, H * D, D, 1), o, mask=mask)
        tl.store(ss_ptr + rows * H + h, tl.sum(of * of, axis=1), mask=row_ok)


@triton.jit
def _fwd_finish_kernel(q_ptr, w2_ptr, o_ptr, ss_ptr, out_ptr, r2_ptr, T, H, D: tl.constexpr,
                             sq_t, sq_h, sq_d, rms_eps, HAS_W2: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_D: tl.constexpr):
    """Forward 3, BLOCK_T tokens over all heads: rms_rstd from the per-head sums, out = o * rms_rstd (* g2) + q."""
    row0, rows, row_ok, dcols, d_ok, mask = _token_tile(T, D, BLOCK_T, BLOCK_D, EVEN_D)
    n = H * D
    q_ptr += row0 * sq_t
    o_ptr += row0 * n
    out_ptr += row0 * n
    hs = tl.arange(0, BLOCK_H)
    ss = tl.load(ss_ptr + row0 * H + rows[:, None] * H + hs[None, :], mask=row_ok[:, None] & (hs < H)[None, :],
                 other=0.0)
    r2 = tl.rsqrt(tl.sum(ss, axis=1) / n + rms_eps)
    tl.store(r2_ptr + row0 + rows, r2, mask=row_ok)
    for h in range(H):
        o = tl.load(_head_ptrs(o_ptr, rows, h, dcols, n, D, 1), mask=mask, other=0.0).to(tl.float32)
        x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
        y = o * r2[:, None]
        if HAS_W2:
            y = y * _head_vec(w2_ptr, h, D, dcols, d_ok)
        tl.store(_head_ptrs(out_ptr, rows, h, dcols, n, D, 1), (y + x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_kernel(dout_ptr, w2_ptr, o_ptr, r2_ptr, do_ptr, pw2_ptr, T, H, D: tl.constexpr,
                          sg_t, sg_h, sg_d, HAS_W2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          EVEN_D: tl.constexpr):
    """Backward 1, BLOCK_T tokens over all heads: the RMSNorm backward, d(o) = rms_rstd * (dout g2 - o *
    rms_rstd^2 * c2 / (H D)) with c2 = sum(dout * g2 * o), to do (q's dtype); rms_weight's column sums."""
    row0, rows, row_ok, dcols, d_ok, mask = _token_tile(T, D, BLOCK_T, BLOCK_D, EVEN_D)
    n = H * D
    dout_ptr += row0 * sg_t
    o_ptr += row0 * n
    do_ptr += row0 * n
    r2 = tl.load(r2_ptr + row0 + rows, mask=row_ok, other=0.0)
    part = tl.program_id(0).to(tl.int64) * n
    c2 = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h in range(H):
        o = tl.load(_head_ptrs(o_ptr, rows, h, dcols, n, D, 1), mask=mask, other=0.0).to(tl.float32)
        g = tl.load(_head_ptrs(dout_ptr, rows, h, dcols, sg_t, sg_h, sg_d), mask=mask, other=0.0).to(tl.float32)
        t2 = g
        if HAS_W2:
            t2 = g * _head_vec(w2_ptr, h, D, dcols, d_ok)
            tl.store(pw2_ptr + part + h * D + dcols, tl.sum(g * o * r2[:, None], axis=0), mask=d_ok)
        c2 += tl.sum(t2 * o, axis=1)
    coef = r2 * r2 * r2 * c2 / n
    for h in range(H):
        o = tl.load(_head_ptrs(o_ptr, rows, h, dcols, n, D, 1), mask=mask, other=0.0).to(tl.float32)
        t2 = tl.load(_head_ptrs(dout_ptr, rows, h, dcols, sg_t, sg_h, sg_d), mask=mask, other=0.0).to(tl.float32)
        if HAS_W2:
            t2 = t2 * _head_vec(w2_ptr, h, D, dcols, d_ok)
        do = r2[:, None] * t2 - o * coef[:, None]
        tl.store(_head_ptrs(do_ptr, rows, h, dcols, n, D, 1), do.to(do_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, w1_ptr, b1_ptr, mean_ptr, rstd_ptr, do_ptr, dl_ptr,
    H, D: tl.constexpr, S, n_m,
    sq_t, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
    scale,
    ACT: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """Backward 2, one (Q tile, head): d(ln_q_h) = dS K + d(o_h) (residual 1), rounded to q's dtype, to dl;
    per S tile S = ln_q K^T (ln_q rebuilt), dP = d(o) V^T, dS = act'(S) * scale * dP."""
    b, h, row0, n_rows, rows, row_ok, dcols, d_ok, mask = _head_tile(off_ptr, n_m, H, D, BLOCK_M, BLOCK_D, EVEN_D)
    if n_rows > 0:
        op_ty = k_ptr.dtype.element_ty
        q_ptr += row0 * sq_t
        do_ptr += row0 * (H * D)
        dl_ptr += row0 * (H * D)
        lnq_op = _lnq_tile(q_ptr, mean_ptr + row0, rstd_ptr + row0, w1_ptr, b1_ptr, rows, row_ok, h, D, dcols, d_ok,
                           mask, sq_t, sq_h, sq_d, HAS_W1, HAS_B1).to(op_ty)
        do_op = tl.load(_head_ptrs(do_ptr, rows, h, dcols, H * D, D, 1), mask=mask, other=0.0)
        dlnq = do_op.to(tl.float32)  # residual 1
        k_ptr += b * sk_b + h * sk_h
        v_ptr += b * sv_b + h * sv_h
        ns, k_offs, v_offs = _kv_offsets(dcols, sk_s, sk_d, sv_s, sv_d, BLOCK_N)
        for n0 in range(0, S, BLOCK_N):
            kt, vt = _kv_pair(k_ptr, v_ptr, k_offs, v_offs, ns < S - n0, d_ok, EVEN_D)
            s = tl.dot(lnq_op, tl.trans(kt), input_precision=INPUT_PRECISION)
            dp = tl.dot(do_op, tl.trans(vt), input_precision=INPUT_PRECISION)
            ds_op = (act_bwd(s, ACT) * scale * dp).to(op_ty)
            dlnq = tl.dot(ds_op, kt, dlnq, input_precision=INPUT_PRECISION)
            k_ptr += BLOCK_N * sk_s
            v_ptr += BLOCK_N * sv_s
        tl.store(_head_ptrs(dl_ptr, rows, h, dcols, H * D, D, 1), dlnq.to(dl_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd_kernel(q_ptr, dout_ptr, w1_ptr, mean_ptr, rstd_ptr, dl_ptr, dq_ptr, pw1_ptr, pb1_ptr,
                         T, H, D: tl.constexpr, sq_t, sq_h, sq_d, sg_t, sg_h, sg_d,
                         HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         EVEN_D: tl.constexpr):
    """Backward 4, BLOCK_T tokens over all heads: the LayerNorm backward, dq = rstd * (t1 - mean(t1) - ln_hat *
    mean(t1 ln_hat)) + dout (residual 2), t1 = d(ln_q) * g1; ln_weight's and ln_bias's column sums."""
    row0, rows, row_ok, dcols, d_ok, mask = _token_tile(T, D, BLOCK_T, BLOCK_D, EVEN_D)
    n = H * D
    q_ptr += row0 * sq_t
    dout_ptr += row0 * sg_t
    dl_ptr += row0 * n
    dq_ptr += row0 * n
    mean = tl.load(mean_ptr + row0 + rows, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + row0 + rows, mask=row_ok, other=0.0)
    part = tl.program_id(0).to(tl.int64) * n
    ca = tl.zeros((BLOCK_T,), dtype=tl.float32)
    cb = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h in range(H):
        dl = tl.load(_head_ptrs(dl_ptr, rows, h, dcols, n, D, 1), mask=mask, other=0.0).to(tl.float32)
        x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
        lnhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        t1 = dl
        if HAS_W1:
            t1 = dl * _head_vec(w1_ptr, h, D, dcols, d_ok)
            tl.store(pw1_ptr + part + h * D + dcols, tl.sum(dl * lnhat, axis=0), mask=d_ok)
        if HAS_B1:
            tl.store(pb1_ptr + part + h * D + dcols, tl.sum(dl, axis=0), mask=d_ok)
        ca += tl.sum(t1, axis=1)
        cb += tl.sum(t1 * lnhat, axis=1)
    for h in range(H):
        dl = tl.load(_head_ptrs(dl_ptr, rows, h, dcols, n, D, 1), mask=mask, other=0.0).to(tl.float32)
        x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
        g = tl.load(_head_ptrs(dout_ptr, rows, h, dcols, sg_t, sg_h, sg_d), mask=mask, other=0.0).to(tl.float32)
        lnhat = (x - mean[:, None]) * rstd[:, None]
        t1 = dl
        if HAS_W1:
            t1 = dl * _head_vec(w1_ptr, h, D, dcols, d_ok)
        dq = rstd[:, None] * (t1 - (ca / n)[:, None] - lnhat * (cb / n)[:, None]) + g
        tl.store(_head_ptrs(dq_ptr, rows, h, dcols, n, D, 1), dq.to(dq_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch the launchers leave for the kernels to write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def fna_config(q: Tensor, k: Tensor, kernel: str = "fwd") -> FnaConfig:
    """The default tiles of ``kernel``'s attention kernels ("fwd"; "bwd": the backward's Q-tile kernel;
    "dkdv"). On CUDA, from sweeps on the H200 (bf16, D = 128, B = 768, S = 128, Lmax = 1024, H in {2, 8}):
    64-token Q tiles, 4 warps; S tiles of 32 and 3 stages in the forward, 64 and 2 stages in the backward.
    8 warps and 128-token tiles were slower in every kernel (the 64-row wgmma tile is one warpgroup's;
    forward 64 x 32: 0.574 ms at H = 2, 64 x 64: 0.669, 128 x 32 x 8 warps: 0.746).
    D <= 64 was not measured: the same tiles with 64-wide S tiles. In the interpreter (CPU tensors) 16 x 16
    tiles, so small test sequences span several Q and S tiles."""
    s = k.shape[1]
    block_n = min(64, pow2_at_least(s))
    if q.device.type != "cuda":
        return FnaConfig(16, min(16, block_n), 4)
    if kernel == "fwd":
        return FnaConfig(64, min(block_n, 32) if q.shape[2] > 64 else block_n, 4, 3)
    return FnaConfig(64, block_n, 4, 2)


def _common(q: Tensor, k: Tensor, v: Tensor, config: FnaConfig, activation: str):
    t, h, d = q.shape
    if d > 256:
        raise ValueError(f"flash_norm_attention Triton kernels: head dim {d} > 256 is not supported")
    return dict(
        H=h, D=d, S=k.shape[1],
        sq_t=q.stride(0), sq_h=q.stride(1), sq_d=q.stride(2),
        sk_b=k.stride(0), sk_s=k.stride(1), sk_h=k.stride(2), sk_d=k.stride(3),
        sv_b=v.stride(0), sv_s=v.stride(1), sv_h=v.stride(2), sv_d=v.stride(3),
        ACT=activation_code(activation, "fusenorm::flash_norm_attention"),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=pow2_at_least(d), EVEN_D=d == pow2_at_least(d),
        INPUT_PRECISION=dot_input_precision(q.dtype, q.device), num_warps=config.warps,
        num_stages=config.stages,
    )


def _token_args(q: Tensor):
    """Tile arguments of the per-token kernels: BLOCK_T tokens (64 on CUDA, 16 in the interpreter)."""
    d = q.shape[2]
    return dict(BLOCK_T=64 if q.device.type == "cuda" else 16, BLOCK_D=pow2_at_least(d),
                EVEN_D=d == pow2_at_least(d), num_warps=4)


def _on_gluon(kind: str, q, k, v, weights: tuple, outs: tuple, activation: str, launch) -> bool:
    """Run ``launch(hopper, act)``, a launch of kernels/hopper/gdpa.py, where the inputs suit the Gluon kernels
    (``kernels/triton/gdpa.gluon_unsupported`` accepts q and k; q, k, v and the present weights contiguous)
    through ``kernels/triton/gdpa.run_gluon``'s guard; False: the caller's Triton path runs."""
    from .gdpa import gluon_unsupported, run_gluon

    present = [w for w in weights if w is not None]
    if gluon_unsupported(q, k) is not None or not all(x.is_contiguous() for x in (q, k, v, *present)):
        return False
    from ..hopper import gdpa as hopper

    act = activation_code(activation, "fusenorm::flash_norm_attention")
    key = (kind, q.shape[1:], k.shape[1:], q.dtype, act, tuple(None if w is None else w.dtype for w in weights))
    return run_gluon(key, (q, k, v, *outs), lambda: launch(hopper, act))


def _gluon_attention(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, mean, rstd, rms_in, ss, activation,
                     scale) -> bool:
    """The attention step on the sm_90 Gluon kernel where it is switched on and takes the inputs; False: the
    Triton kernel runs."""
    return GLUON_ATTENTION and _on_gluon(
        "fna", q, k, v, (ln_weight, ln_bias), (rms_in,), activation,
        lambda hopper, act: hopper.fna_attention_gluon(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, mean,
                                                       rstd, rms_in, ss, act, scale))


def _gluon_block(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation,
                 scale, out, mean, rstd, r2, rms_in) -> bool:
    """The whole forward in one sm_90 Gluon kernel where it is switched on, H = 1 and the inputs suit the Gluon
    kernels; False: the three-launch path runs."""
    return GLUON_BLOCK and q.shape[1] == 1 and _on_gluon(
        "fnb", q, k, v, (ln_weight, ln_bias, rms_weight), (out, rms_in), activation,
        lambda hopper, act: hopper.fna_block_gluon(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight,
                                                   ln_eps, rms_eps, out, mean, rstd, r2, rms_in, act, scale))


def flash_norm_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
    ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], rms_weight: Optional[Tensor],
    ln_eps: float, rms_eps: float, activation: str, scale: float, config: Optional[FnaConfig] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, ln_mean, ln_rstd, rms_rstd, rms_in) of ``flash_norm_attention_reference``; inputs already
    checked. ``config``: a test hook (the attention kernel's tiles); None takes ``fna_config``."""
    t, h, d = q.shape
    dev, f32 = q.device, torch.float32
    explicit = config is not None
    config = config or fna_config(q, k)
    out = _alloc((t, h, d), q.dtype, dev)
    rms_in = _alloc((t, h, d), q.dtype, dev)
    mean, rstd, r2 = (_alloc((t,), f32, dev) for _ in range(3))
    if t == 0 or max_seq_len_q == 0:
        return out, mean, rstd, r2, rms_in
    if not explicit and _gluon_block(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps,
                                     rms_eps, activation, scale, out, mean, rstd, r2, rms_in):
        return out, mean, rstd, r2, rms_in
    n_m = triton.cdiv(max_seq_len_q, config.block_m)
    tok = _token_args(q)
    n_t = triton.cdiv(t, tok["BLOCK_T"])
    _stats_kernel[(n_t,)](q, mean, rstd, t, h, d, *q.stride(), float(ln_eps), **tok)
    ss = _alloc((t, h), f32, dev)
    # config given (a test hook for the Triton tiles): the Triton kernel
    if explicit or not _gluon_attention(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, mean, rstd, rms_in, ss,
                                        activation, scale):
        _attn_fwd_kernel[(k.shape[0] * n_m * h,)](
            q, k, v, q_offsets, ln_weight, ln_bias, mean, rstd, rms_in, ss, n_m=n_m, scale=float(scale),
            HAS_W1=ln_weight is not None, HAS_B1=ln_bias is not None, **_common(q, k, v, config, activation),
        )
    _fwd_finish_kernel[(n_t,)](q, rms_weight, rms_in, ss, out, r2, t, h, d, *q.stride(), float(rms_eps),
                               HAS_W2=rms_weight is not None, BLOCK_H=pow2_at_least(h, 1), **tok)
    return out, mean, rstd, r2, rms_in


def flash_norm_attention_backward_triton(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
    ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], rms_weight: Optional[Tensor],
    ln_mean: Tensor, ln_rstd: Tensor, rms_rstd: Tensor, rms_in: Tensor, activation: str, scale: float,
    config: Optional[FnaConfig] = None, dkdv_config: Optional[FnaConfig] = None,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dq, dk, dv, d_ln_weight, d_ln_bias, d_rms_weight) of ``flash_norm_attention_backward_reference``.
    ``config`` / ``dkdv_config``: test hooks (tiles of the attention kernels); None takes ``fna_config``."""
    t, h, d = q.shape
    bsz, s = k.shape[0], k.shape[1]
    dev, f32 = q.device, torch.float32
    config = config or fna_config(q, k, "bwd")
    dkdv_config = dkdv_config or fna_config(q, k, "dkdv")
    n_m = triton.cdiv(max_seq_len_q, config.block_m) if t > 0 else 0
    tok = _token_args(q)
    n_t = triton.cdiv(t, tok["BLOCK_T"])
    dq = _alloc((t, h, d), q.dtype, dev)
    do_buf = _alloc((t, h, d), q.dtype, dev)
    dk = _alloc((bsz, s, h, d), k.dtype, dev)
    dv = _alloc((bsz, s, h, d), v.dtype, dev)
    # Per-program column sums of the weight gradients: summed over programs, so they start at zero.
    parts = [torch.zeros((n_t, h * d), dtype=f32, device=dev) if w is not None else None
             for w in (ln_weight, ln_bias, rms_weight)]
    rms_in = rms_in.contiguous()
    flags = dict(HAS_W1=ln_weight is not None, HAS_B1=ln_bias is not None)
    if n_m > 0:
        # d(ln_q) goes into dq's buffer: the LayerNorm backward reads each element of it before it writes the
        # same element's dq (same program, same tile layout), so the backward needs one [T, H, D] buffer less
        # (measured: its peak was one such tensor above the unfused graph's).
        dl = dq
        _rms_bwd_kernel[(n_t,)](dout, rms_weight, rms_in, rms_rstd, do_buf, parts[2], t, h, d, *dout.stride(),
                                HAS_W2=rms_weight is not None, **tok)
        _attn_bwd_kernel[(bsz * n_m * h,)](
            q, k, v, q_offsets, ln_weight, ln_bias, ln_mean, ln_rstd, do_buf, dl, n_m=n_m, scale=float(scale),
            **flags, **_common(q, k, v, config, activation),
        )
        _ln_bwd_kernel[(n_t,)](q, dout, ln_weight, ln_mean, ln_rstd, dl, dq, parts[0], parts[1], t, h, d,
                               *q.stride(), *dout.stride(), **flags, **tok)
    n_s = triton.cdiv(s, dkdv_config.block_n)
    if bsz * h * n_s > 0:  # every dK/dV element is written (zeros for a sequence without tokens)
        _dkdv_kernel[(n_s * bsz * h,)](
            q, k, v, q_offsets, ln_weight, ln_bias, ln_mean, ln_rstd, do_buf, dk, dv, n_s=n_s,
            scale=float(scale), **flags, **_common(q, k, v, dkdv_config, activation),
        )
    dws = tuple(p.sum(0).to(w.dtype) if w is not None else None
                for p, w in zip(parts, (ln_weight, ln_bias, rms_weight)))
    return (dq, dk, dv) + dws
