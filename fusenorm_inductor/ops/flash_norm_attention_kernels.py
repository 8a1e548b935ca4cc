"""Triton kernels and launchers for ``fusenorm::flash_norm_attention`` (FlashNormAttention, algorithms.md
section 5). Semantics, roundings and the backward's recompute: flash_norm_attention.py's module docstring.

The cross-head problem. Both norms span all H*D features of a token, while attention is per head. The seed
puts the H heads of a Q tile in H CTAs of a cluster that trade row sums through DSMEM; Triton 3.6 on Hopper
has no DSMEM (platform.md). Here **one program owns a Q tile of BLOCK_M tokens of one sequence across all
heads** and makes passes over the heads; what one pass produces for the next is either a [BLOCK_M] vector in
registers (row sums) or a [BLOCK_M, D] tile per head written to global memory by this program and re-read by
it after a CTA barrier (it stays in L2: one tile is BLOCK_M * H * D * 2 bytes, 64 KiB at BLOCK_M = 64,
H*D = 512, ~8.5 MiB for 132 resident programs against a 60 MB L2).

Forward, program (Q tile m, sequence b), a 1-D grid of B * cdiv(max_seq_len_q, BLOCK_M) programs, the Q tiles of a
sequence adjacent (they share its K/V in L2; 1-D: no 65535 limit on B):
  pass 1, heads h: read q_h, LayerNorm row sums, shifted by p = q[t, 0, 0] (s1 = sum(q - p), s2 = sum(q - p)^2:
          one-pass variance without E[x^2] - E[x]^2's cancellation when |mean| >> std) -> mean, rstd.
  pass 2, heads h: ln_q_h = (q_h - mean) * rstd (* g1 + b1) in registers; o_h = sum over S tiles of
          (act(ln_q_h K_tile^T) * scale) V_tile + ln_q_h (K/V tiles of (b, h) streamed, BLOCK_N wide; the
          activation is elementwise, so unlike softmax no running max/rescale); sum(o_h^2) accumulates the RMS
          row sums; o_h is staged unnormalized, in ``out`` itself (default, ``stage="out"``: rounded to the
          output dtype as the unfused graph rounds the attention output) or an fp32 scratch (``stage="fp32"``).
  barrier; pass 3, heads h: out_h = o_h * rms_rstd (* g2) + q_h.
q is read three times, o written and read back once, out written once: all L2 traffic but the first read
of q and the final write of out (HBM sees q once and out once, K/V once per Q tile); the matmuls (2 per head
and S tile) are done once. The alternative, the whole
[BLOCK_M, H, D] o tile in registers (3-D batched tl.dot over heads), saves the staging but needs
H * D * BLOCK_M fp32 registers: at H*D = 512 only BLOCK_M = 16 fits, too thin for wgmma, so it would help only
for H*D <= 256; not built (no GPU to measure it on in this round). The ``stage`` switch keeps the two staging
precisions to compare on the H200.

Backward, the same grid and ownership, 5 matmuls per head and S tile plus the recompute of o (2):
  pass A, heads h: rebuild ln_q_h (saved mean/rstd), recompute o_h = P V + ln_q_h (stored fp32 into a scratch),
          RMS row dot c2 = sum_h sum(dout_h * g2_h * o_h).
  barrier; pass B, heads h: d(o_h) = rms_rstd * (dout_h g2_h - o_h * rms_rstd^2 * c2 / (H D)); per S tile:
          S, P (recomputed), dP = d(o) V^T, dS = act'(S) * scale * dP, d(ln_q_h) += dS K, and the tile's
          dV = P^T d(o), dK = dS^T ln_q_h **atomically added (fp32) into [B, S, H, D] buffers** (the Q tiles of a
          sequence all add into the same (b, h) K/V rows: short S, few Q tiles per sequence, so contention is
          low; a separate (b, h, S tile) kernel looping over Q tiles would be deterministic but must stage
          d(o) and recompute S and dP once more). d(ln_q_h) = dS K + d(o_h) (residual 1) goes to a second fp32
          scratch; LayerNorm row sums ca = sum(t1), cb = sum(t1 * ln_hat), t1 = d(ln_q) * g1.
  barrier; pass C, heads h: dq_h = rstd * (t1 - ca / (H D) - ln_hat * cb / (H D)) + dout_h (residual 2).
  Weight gradients: each program writes its Q tile's column sums (dout * o_hat, d(ln_q) * ln_hat, d(ln_q))
  to fp32 partials [programs, H*D]; torch sums them over programs.
The atomics make dK and dV non-deterministic in their last bits (fp32 sums in arrival order).

MMA operands are q's dtype (ln_q, P, d(o), dS rounded to it, as the reference does), accumulation fp32; fp32
inputs use ``dot_input_precision`` (exact unless TF32 is allowed for CUDA matmuls).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_common import dot_input_precision, pow2_at_least
from .activations import act_bwd, act_fwd, activation_code

__all__ = ["FnaConfig", "fna_config", "flash_norm_attention_triton", "flash_norm_attention_backward_triton"]


class FnaConfig(NamedTuple):
    block_m: int  # tokens per Q tile (one program: this many tokens of one sequence, all heads)
    block_n: int  # KV positions per S tile
    warps: int
    stage: str = "out"  # forward: o staged in "out" (output dtype) or an "fp32" scratch


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _head_ptrs(ptr, rows, h, dcols, stride_t, stride_h, stride_d):
    return ptr + rows[:, None] * stride_t + h * stride_h + dcols[None, :] * stride_d


@triton.jit
def _ln_stats(q_ptr, rows, row_ok, dcols, d_ok, H, D, sq_t, sq_h, sq_d, eps, BLOCK_M: tl.constexpr):
    """Pass 1: (mean, rstd) of each token over its H*D features, fp32 sums shifted by p = q[t, 0, 0]."""
    mask = row_ok[:, None] & d_ok[None, :]
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
def _ln_apply(x, mean, rstd, w1_ptr, b1_ptr, h, D, dcols, d_ok, mask, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """(ln_hat, ln_q) of one head's [BLOCK_M, BLOCK_D] fp32 tile, 0 outside the valid rows/columns."""
    lnhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    lnq = lnhat
    if HAS_W1:
        lnq = lnq * tl.load(w1_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B1:
        lnq = lnq + tl.where(mask, tl.load(b1_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :], 0.0)
    return lnhat, lnq


@triton.jit
def _kv_tile(ptr, base, ns, dcols, n_ok, d_ok, stride_s, stride_d):
    return tl.load(ptr + base + ns[:, None] * stride_s + dcols[None, :] * stride_d,
                   mask=n_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _attend(lnq_op, k_ptr, v_ptr, k_base, v_base, S, sk_s, sk_d, sv_s, sv_d, dcols, d_ok, scale,
            ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
    """sum over S tiles of (act(ln_q K^T) * scale) V for one head, fp32 [BLOCK_M, BLOCK_D]; P is rounded to
    V's dtype for the MMA. Padded KV rows give S = 0 and act(0) = 0 (every activation), and V rows of 0."""
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, S, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_ok = ns < S
        kt = _kv_tile(k_ptr, k_base, ns, dcols, n_ok, d_ok, sk_s, sk_d)
        vt = _kv_tile(v_ptr, v_base, ns, dcols, n_ok, d_ok, sv_s, sv_d)
        s = tl.dot(lnq_op, tl.trans(kt), input_precision=INPUT_PRECISION)
        p = act_fwd(s, ACT) * scale
        acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _q_tile(off_ptr, n_m, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's Q tile: tile pid % n_m of sequence b = pid // n_m (a 1-D grid, a sequence's tiles
    adjacent). Returns b and row0 (int64), n_rows (int32, <= 0 past the sequence's end: nothing to do), and the
    tile's local rows (int32), column indices and masks."""
    pid = tl.program_id(0)
    b = (pid // n_m).to(tl.int64)  # b * stride_b must not overflow int32
    start = tl.load(off_ptr + b).to(tl.int64)
    end = tl.load(off_ptr + b + 1).to(tl.int64)
    row0 = start + (pid % n_m) * BLOCK_M
    n_rows = (end - row0).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    dcols = tl.arange(0, BLOCK_D)
    d_ok = dcols < D
    return b, row0, n_rows, rows, row_ok, dcols, d_ok, row_ok[:, None] & d_ok[None, :]


@triton.jit
def _fna_fwd_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, w1_ptr, b1_ptr, w2_ptr, out_ptr, stage_ptr, mean_ptr, rstd_ptr, r2_ptr,
    H, D, S, n_m,
    sq_t, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
    ln_eps, rms_eps, scale,
    ACT: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_W2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Q tile pid % n_m of sequence pid // n_m, all heads (module docstring, forward passes 1-3).
    out and the stage are contiguous [T, H, D]; q, k, v any strides."""
    b, row0, n_rows, rows, row_ok, dcols, d_ok, mask = _q_tile(off_ptr, n_m, D, BLOCK_M, BLOCK_D)
    if n_rows > 0:  # Q tiles past the sequence's end have nothing to do
        # Pointers rebased at the tile's first row (int64 scalars), rows local to the tile (int32): [BLOCK_M,
        # BLOCK_D] tiles of int64 offsets cost two registers per element and made the kernels spill.
        q_ptr += row0 * sq_t
        out_ptr += row0 * (H * D)
        stage_ptr += row0 * (H * D)
        mean_ptr += row0
        rstd_ptr += row0
        r2_ptr += row0
        n = H * D
        # Pass 1: LayerNorm statistics over all heads.
        mean, rstd = _ln_stats(q_ptr, rows, row_ok, dcols, d_ok, H, D, sq_t, sq_h, sq_d, ln_eps, BLOCK_M)
        # Pass 2: per head, o_h = attention(ln_q_h) + ln_q_h, staged; RMS row sums.
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for h in range(H):
            x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
            _, lnq = _ln_apply(x, mean, rstd, w1_ptr, b1_ptr, h, D, dcols, d_ok, mask, HAS_W1, HAS_B1)
            o = _attend(lnq.to(k_ptr.dtype.element_ty), k_ptr, v_ptr, b * sk_b + h * sk_h, b * sv_b + h * sv_h,
                        S, sk_s, sk_d, sv_s, sv_d, dcols, d_ok, scale, ACT, BLOCK_M, BLOCK_N, BLOCK_D,
                        INPUT_PRECISION)
            o = (o + lnq).to(stage_ptr.dtype.element_ty)  # the stage's rounding; the RMS sees the stored o
            of = o.to(tl.float32)
            ss += tl.sum(of * of, axis=1)
            tl.store(_head_ptrs(stage_ptr, rows, h, dcols, n, D, 1), o, mask=mask)
        r2 = tl.rsqrt(ss / n + rms_eps)
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        tl.store(r2_ptr + rows, r2, mask=row_ok)
        # The stage's tiles were written by other threads of this program: make them visible.
        tl.debug_barrier()
        # Pass 3: out = o * rms_rstd (* g2) + q.
        for h in range(H):
            o = tl.load(_head_ptrs(stage_ptr, rows, h, dcols, n, D, 1), mask=mask, other=0.0).to(tl.float32)
            x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
            y = o * r2[:, None]
            if HAS_W2:
                y = y * tl.load(w2_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(_head_ptrs(out_ptr, rows, h, dcols, n, D, 1), (y + x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fna_bwd_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, w1_ptr, b1_ptr, w2_ptr, dout_ptr, mean_ptr, rstd_ptr, r2_ptr,
    o_buf, dl_buf, dq_ptr, dk_ptr, dv_ptr, pw1_ptr, pb1_ptr, pw2_ptr,
    H, D, S, n_m,
    sq_t, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d, sg_t, sg_h, sg_d,
    scale,
    ACT: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_W2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Gradients of Q tile pid % n_m of sequence pid // n_m (module docstring, backward passes A-C).
    o_buf, dl_buf, dq: contiguous [T, H, D] (scratch fp32, fp32, q's dtype); dk, dv: zeroed fp32 [B, S, H, D],
    atomically accumulated; pw1/pb1/pw2: zeroed fp32 [B * n_m, H * D] per-program column sums."""
    b, row0, n_rows, rows, row_ok, dcols, d_ok, mask = _q_tile(off_ptr, n_m, D, BLOCK_M, BLOCK_D)
    if n_rows > 0:
        # Pointers rebased at the tile's first row, rows local to the tile (int32): see the forward kernel.
        q_ptr += row0 * sq_t
        dout_ptr += row0 * sg_t
        o_buf += row0 * (H * D)
        dl_buf += row0 * (H * D)
        dq_ptr += row0 * (H * D)
        mean_ptr += row0
        rstd_ptr += row0
        r2_ptr += row0
        n = H * D
        op_ty = k_ptr.dtype.element_ty
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        r2 = tl.load(r2_ptr + rows, mask=row_ok, other=0.0)
        part = tl.program_id(0).to(tl.int64) * n  # this program's row of the [B * n_m, H * D] partials
        # Pass A: recompute o per head (fp32 scratch), RMS row dot c2 = sum(dout * g2 * o).
        c2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for h in range(H):
            x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
            _, lnq = _ln_apply(x, mean, rstd, w1_ptr, b1_ptr, h, D, dcols, d_ok, mask, HAS_W1, HAS_B1)
            o = _attend(lnq.to(op_ty), k_ptr, v_ptr, b * sk_b + h * sk_h, b * sv_b + h * sv_h, S, sk_s, sk_d,
                        sv_s, sv_d, dcols, d_ok, scale, ACT, BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION) + lnq
            tl.store(_head_ptrs(o_buf, rows, h, dcols, n, D, 1), o, mask=mask)
            t2 = tl.load(_head_ptrs(dout_ptr, rows, h, dcols, sg_t, sg_h, sg_d), mask=mask, other=0.0).to(tl.float32)
            if HAS_W2:
                t2 = t2 * tl.load(w2_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            c2 += tl.sum(t2 * o, axis=1)
        # d(o) = r2 * (t2 - o_hat * mean(t2 * o_hat)) = r2 * t2 - o * coef, o_hat = o * r2.
        coef = r2 * r2 * r2 * c2 / n
        tl.debug_barrier()
        # Pass B: per head, the attention backward; d(ln_q) to the second scratch; LayerNorm row sums.
        ca = tl.zeros((BLOCK_M,), dtype=tl.float32)
        cb = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for h in range(H):
            o = tl.load(_head_ptrs(o_buf, rows, h, dcols, n, D, 1), mask=mask, other=0.0)
            g = tl.load(_head_ptrs(dout_ptr, rows, h, dcols, sg_t, sg_h, sg_d), mask=mask, other=0.0).to(tl.float32)
            t2 = g
            if HAS_W2:
                t2 = g * tl.load(w2_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(pw2_ptr + part + h * D + dcols, tl.sum(g * o * r2[:, None], axis=0), mask=d_ok)
            do = r2[:, None] * t2 - o * coef[:, None]
            do_op = do.to(op_ty)
            x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
            lnhat, lnq = _ln_apply(x, mean, rstd, w1_ptr, b1_ptr, h, D, dcols, d_ok, mask, HAS_W1, HAS_B1)
            lnq_op = lnq.to(op_ty)
            k_base = b * sk_b + h * sk_h
            v_base = b * sv_b + h * sv_h
            kv_base = b * S * n + h * D  # dk/dv buffers: contiguous [B, S, H, D]; int64 scalar, int32 tiles
            dk_head = dk_ptr + kv_base
            dv_head = dv_ptr + kv_base
            dlnq = do  # residual 1
            for n0 in range(0, S, BLOCK_N):
                ns = n0 + tl.arange(0, BLOCK_N)
                n_ok = ns < S
                kt = _kv_tile(k_ptr, k_base, ns, dcols, n_ok, d_ok, sk_s, sk_d)
                vt = _kv_tile(v_ptr, v_base, ns, dcols, n_ok, d_ok, sv_s, sv_d)
                s = tl.dot(lnq_op, tl.trans(kt), input_precision=INPUT_PRECISION)
                p_op = (act_fwd(s, ACT) * scale).to(op_ty)
                dp = tl.dot(do_op, tl.trans(vt), input_precision=INPUT_PRECISION)
                ds_op = (act_bwd(s, ACT) * scale * dp).to(op_ty)
                dlnq = tl.dot(ds_op, kt, dlnq, input_precision=INPUT_PRECISION)
                dv_t = tl.dot(tl.trans(p_op), do_op, input_precision=INPUT_PRECISION)
                dk_t = tl.dot(tl.trans(ds_op), lnq_op, input_precision=INPUT_PRECISION)
                kv_offs = ns[:, None] * n + dcols[None, :]
                kv_mask = n_ok[:, None] & d_ok[None, :]
                tl.atomic_add(dv_head + kv_offs, dv_t, mask=kv_mask)
                tl.atomic_add(dk_head + kv_offs, dk_t, mask=kv_mask)
            tl.store(_head_ptrs(dl_buf, rows, h, dcols, n, D, 1), dlnq, mask=mask)
            t1 = dlnq
            if HAS_W1:
                t1 = dlnq * tl.load(w1_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(pw1_ptr + part + h * D + dcols, tl.sum(dlnq * lnhat, axis=0), mask=d_ok)
            if HAS_B1:
                tl.store(pb1_ptr + part + h * D + dcols, tl.sum(dlnq, axis=0), mask=d_ok)
            ca += tl.sum(t1, axis=1)
            cb += tl.sum(t1 * lnhat, axis=1)
        tl.debug_barrier()
        # Pass C: LayerNorm backward over all heads, + dout (residual 2).
        for h in range(H):
            dl = tl.load(_head_ptrs(dl_buf, rows, h, dcols, n, D, 1), mask=mask, other=0.0)
            x = tl.load(_head_ptrs(q_ptr, rows, h, dcols, sq_t, sq_h, sq_d), mask=mask, other=0.0).to(tl.float32)
            g = tl.load(_head_ptrs(dout_ptr, rows, h, dcols, sg_t, sg_h, sg_d), mask=mask, other=0.0).to(tl.float32)
            lnhat = (x - mean[:, None]) * rstd[:, None]
            t1 = dl
            if HAS_W1:
                t1 = dl * tl.load(w1_ptr + h * D + dcols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            dq = rstd[:, None] * (t1 - (ca / n)[:, None] - lnhat * (cb / n)[:, None]) + g
            tl.store(_head_ptrs(dq_ptr, rows, h, dcols, n, D, 1), dq.to(dq_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch the launchers leave for the kernels to write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def fna_config(q: Tensor, k: Tensor, backward: bool = False) -> FnaConfig:
    """The default tile: on CUDA, Q tiles of 64 tokens and 8 warps; S tiles of up to 64 (forward with
    D = 128: 32). Chosen by register spills of an offline sm_90 compile (bf16, cuobjdump -res-usage; not
    timed yet): the forward at 64 x 64 x 4 warps, the first guess, spilled 1.2 KB (D = 64) / 3.2 KB (D = 128)
    of stack per thread, at 8 warps 8 B / 0.6 KB with 32-wide S tiles. The backward (8 warps) still spills
    0.8 KB / 3.5 KB: it holds ~10 [BLOCK_M, D] tiles per head (docs/design.md, Attention). In the interpreter
    (CPU tensors) 16 x 16 tiles, so small test sequences span several Q and S tiles."""
    s = k.shape[1]
    block_n = min(64, pow2_at_least(s))
    if q.device.type != "cuda":
        return FnaConfig(16, min(16, block_n), 4)
    if not backward and q.shape[2] > 64:
        block_n = min(block_n, 32)
    return FnaConfig(64, block_n, 8)


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
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=pow2_at_least(d),
        INPUT_PRECISION=dot_input_precision(q.dtype, q.device), num_warps=config.warps,
    )


def flash_norm_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
    ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], rms_weight: Optional[Tensor],
    ln_eps: float, rms_eps: float, activation: str, scale: float, config: Optional[FnaConfig] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, ln_mean, ln_rstd, rms_rstd) of ``flash_norm_attention_reference``; inputs already checked."""
    t, h, d = q.shape
    dev, f32 = q.device, torch.float32
    config = config or fna_config(q, k)
    out = _alloc((t, h, d), q.dtype, dev)
    mean, rstd, r2 = (_alloc((t,), f32, dev) for _ in range(3))
    if t == 0 or max_seq_len_q == 0:
        return out, mean, rstd, r2
    stage = out if config.stage == "out" else _alloc((t, h, d), f32, dev)
    n_m = triton.cdiv(max_seq_len_q, config.block_m)
    _fna_fwd_kernel[(k.shape[0] * n_m,)](
        q, k, v, q_offsets, ln_weight, ln_bias, rms_weight, out, stage, mean, rstd, r2, n_m=n_m,
        ln_eps=float(ln_eps), rms_eps=float(rms_eps), scale=float(scale),
        HAS_W1=ln_weight is not None, HAS_B1=ln_bias is not None, HAS_W2=rms_weight is not None,
        **_common(q, k, v, config, activation),
    )
    return out, mean, rstd, r2


def flash_norm_attention_backward_triton(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
    ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], rms_weight: Optional[Tensor],
    ln_mean: Tensor, ln_rstd: Tensor, rms_rstd: Tensor, activation: str, scale: float,
    config: Optional[FnaConfig] = None,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dq, dk, dv, d_ln_weight, d_ln_bias, d_rms_weight) of ``flash_norm_attention_backward_reference``."""
    t, h, d = q.shape
    bsz, s = k.shape[0], k.shape[1]
    dev, f32 = q.device, torch.float32
    config = config or fna_config(q, k, backward=True)
    n_m = triton.cdiv(max_seq_len_q, config.block_m) if t > 0 else 0
    dq = _alloc((t, h, d), q.dtype, dev)
    # Accumulated (atomics, per-program partials): must start at zero, never poisoned.
    dk_acc = torch.zeros((bsz, s, h, d), dtype=f32, device=dev)
    dv_acc = torch.zeros((bsz, s, h, d), dtype=f32, device=dev)
    parts = [torch.zeros((bsz * n_m, h * d), dtype=f32, device=dev) if w is not None else None
             for w in (ln_weight, ln_bias, rms_weight)]
    if n_m > 0:
        o_buf = _alloc((t, h, d), f32, dev)
        dl_buf = _alloc((t, h, d), f32, dev)
        _fna_bwd_kernel[(bsz * n_m,)](
            q, k, v, q_offsets, ln_weight, ln_bias, rms_weight, dout, ln_mean, ln_rstd, rms_rstd,
            o_buf, dl_buf, dq, dk_acc, dv_acc, *parts,
            n_m=n_m, sg_t=dout.stride(0), sg_h=dout.stride(1), sg_d=dout.stride(2), scale=float(scale),
            HAS_W1=ln_weight is not None, HAS_B1=ln_bias is not None, HAS_W2=rms_weight is not None,
            **_common(q, k, v, config, activation),
        )
    dws = tuple(p.sum(0).to(w.dtype) if w is not None else None
                for p, w in zip(parts, (ln_weight, ln_bias, rms_weight)))
    return (dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)) + dws
