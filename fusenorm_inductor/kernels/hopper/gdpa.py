"""GDPA forward on sm_90 in Gluon: ``O = act(Q K^T) * scale @ V`` per sequence and head (ops/gdpa.py has the
math, the layouts and the reference).

Structure (a Hopper attention kernel without the softmax: P is elementwise in S, so no row max and no
rescaling of O):
- work items (b, h, chunk): a chunk is ``chunk`` consecutive Q tiles of ``block_m`` rows of sequence b, the
  chunks of one (b, h) adjacent; a chunk past the sequence's end is empty. Two schedules (``choose_config``):
  persistent (one program per SM walks items pid, pid + grid, ...) where every (b, h) is one item, and one
  program per item where sequences span several (the hardware then balances items of very different
  lengths, which a static walk does not).
- a loader partition (1 warp): per item the whole K and V of (b, h) ([S, D] each, S <= 128) into one of two
  buffers (the next item's land under the current item's tiles), then the item's Q tiles into a ring of
  ``q_stages`` slots; mbarriers order it all (``q_ready`` / ``q_empty`` per slot, ``kv_ready`` / ``kv_empty``
  per K/V buffer, the latter released by both consumers).
- two consumer partitions of one warpgroup each take alternate Q tiles of an item: S = Q K^T (async wgmma
  from shared memory), P = act(S) * scale in registers, rounded to the inputs' dtype and fed to the second
  wgmma as its register operand (O = P V, no trip through shared memory). With two consumers the tensor cores
  run one's GEMMs while the other computes its activation, which costs about as many cycles as the GEMMs.
- the epilogue rounds O to the dtype; a tile whose rows all belong to the sequence goes out through a
  staging tile and a TMA store (asynchronous, the next tile's work runs under it); the sequence's last,
  partial tile is stored with a row mask (a TMA store would write the next sequence's rows).
Rows of a Q tile past the sequence's end hold the next sequence's tokens (or TMA's zero fill past T): their S
rows are computed and never stored. Sequence bounds are clamped into [0, T] as in the Triton kernels, so
unvalidated offsets cannot address memory outside q and O.

The backward (``gdpa_bwd_gluon``; the op's switch: kernels/triton/gdpa.GLUON_BACKWARD) recomputes S
per tile, as the Triton kernels do:
- dQ (``gdpa_dq_kernel``): the forward's partitions with dO loaded beside each Q tile, one program per work
  item; per tile and block of 64 K/V rows S = Q K^T and dP = dO V^T, dS = act'(S) * scale * dP rounded to the
  dtype as the register operand of dQ += dS K.
- dK/dV (``gdpa_dkdv_kernel``): one program per (b, h); K and V stay in shared memory, one consumer warpgroup
  per 64 of their rows (S = 64 or 128), the sequence's Q and dO tiles stream through a ring both read; with
  transposed tiles S^T = K Q^T and dP^T = V dO^T (no transposed results), dV += P^T dO and dK += dS^T Q, the
  columns of Q rows past the sequence's end zeroed. Every dK/dV row has one owner (no atomics, the same bits
  run to run); a sequence of length 0 gets zeros.

FlashNormAttention's attention step (``fna_attention_gluon``, the forward's partitions in MODE 2; the op's switch:
kernels/triton/flash_norm_attention.GLUON_ATTENTION) rebuilds ln_q from each Q tile in shared memory and the token
statistics, feeds it to S's wgmma as the register operand, starts O's accumulator at ln_q (the residual), and
stores O rounded with its per-head sums of squares for the RMSNorm that a per-token kernel finishes. Its
compile-time switches are the FLAGS bits below (``fna_flags``).

q and O are read as [T, H * D] and K, V as [B * S, H * D] (views of the contiguous layouts): the tile of
head h is the box at column h * D. The box of K and V is [S, D], so S must be a power of two in [16, 128]
(no K/V rows of the next sequence enter a tile), D 64 or 128, and the dtype bf16 or fp16
(``unsupported`` says why not otherwise; the op then runs the Triton kernels).

The activations are those of activations.py, fast_gelu written as x * sigmoid(2 z) (one exp2 and one
division, as the Triton kernels' tanh); the hardware tanh (``tanh.approx.f32``, one instruction) would halve
the special-function work but errs by about 2^-11, more than the ops' error bound allows at small |P|.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ... import memory
from . import launch as L
from ._compat import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .common import LOAD_REGS, MMA_REGS, descriptor, refuse_spills
from .cpu_compile import compile_sm90, descriptor_type, runtime_attrs
from .gemm_core import mma_layout
from ..gemm_config import num_sms

__all__ = ["Plan", "gdpa_fwd_gluon", "gdpa_bwd_gluon", "fna_attention_gluon", "fna_block_gluon", "unsupported", "misaligned",
           "backward_unsupported", "choose_config", "fna_flags"]


class GdpaGluonConfig(NamedTuple):
    block_m: int  # Q rows per tile (one warpgroup's wgmma M)
    chunk: int  # Q tiles per work item
    q_stages: int  # Q tiles in flight (the loader's ring)
    persistent: bool  # one program per SM walking the items (else one program per item)

    def label(self) -> str:
        return f"gl_gdpa {self.block_m}x{self.chunk} q{self.q_stages} {'persistent' if self.persistent else 'per-item'}"


# Measured on the H200 (benchmarks/results/gdpa_gluon_h200.json): where every (b, h) is one work item the
# persistent walk wins (the next item's K and V load under the current item's tiles); where sequences span
# several items of very different lengths, one program per item wins (the hardware balances the items).
PERSISTENT = GdpaGluonConfig(64, 16, 4, True)
PER_ITEM = GdpaGluonConfig(64, 8, 4, False)


def choose_config(max_seq_len_q: int) -> GdpaGluonConfig:
    return PERSISTENT if max_seq_len_q <= PERSISTENT.block_m * PERSISTENT.chunk else PER_ITEM


# The FLAGS of FlashNormAttention's kernels (gdpa_fna_kernel, gdpa_fnb_kernel): the norm weights present, where
# the LayerNorm's statistics come from, the whole block. gl.constexpr: the kernels read them as globals;
# ``fna_flags`` packs them on the host.
FLAG_LN_WEIGHT = gl.constexpr(1)  # w1: the LayerNorm's weight
FLAG_LN_BIAS = gl.constexpr(2)  # b1: the LayerNorm's bias
FLAG_STAGED_STATS = gl.constexpr(4)  # the loader stages each Q tile's statistics in shared memory
FLAG_BLOCK = gl.constexpr(8)  # the whole block (H = 1): the statistics from the tile, RMSNorm in the epilogue
FLAG_RMS_WEIGHT = gl.constexpr(16)  # w2: the RMSNorm's weight (the whole block)


def fna_flags(ln_weight: bool, ln_bias: bool, rms_weight: bool = False, *, staged_stats: bool = False,
              block: bool = False) -> int:
    """The FLAGS value of these switches (the ``FLAG_*`` bits)."""
    bits = ((ln_weight, FLAG_LN_WEIGHT), (ln_bias, FLAG_LN_BIAS), (rms_weight, FLAG_RMS_WEIGHT),
            (staged_stats, FLAG_STAGED_STATS), (block, FLAG_BLOCK))
    return sum(bit.value for on, bit in bits if on)


# FlashNormAttention's attention step with the LayerNorm statistics of each Q tile staged in shared memory by
# the loader (FLAG_STAGED_STATS), instead of the consumer reading them from global memory in the middle of its
# tile (a few per cent faster on the H200, docs/history/design-history.md); a switch so the benchmarks can time both.
STAGE_STATS = True


@gluon.jit
def _act(x, ACT: gl.constexpr):
    """act(x) for an fp32 tile (ACT: activations.activation_code)."""
    if ACT == 0:  # fast_gelu = 0.5 x (1 + tanh(z)) = x sigmoid(2 z), z = sqrt(2/pi) (x + 0.044715 x^3)
        y = x / (1.0 + gl.exp2(x * (-2.302208198144325 - 0.1029432395800235 * x * x)))
    elif ACT == 1:  # gelu (erf)
        y = 0.5 * x * (1.0 + gl.erf(x * 0.7071067811865476))
    elif ACT == 2:  # silu
        y = x / (1.0 + gl.exp2(x * -1.4426950408889634))
    elif ACT == 3:  # relu
        y = gl.maximum(x, 0.0)
    else:
        y = x
    return y


@gluon.jit
def _act_grad(x, ACT: gl.constexpr):
    """d act / dx for an fp32 tile (the backward's dS = act'(S) * scale * dP)."""
    if ACT == 0:  # fast_gelu: with s = sigmoid(2 z), 0.5 (1 + tanh z) = s and 0.5 x (1 - tanh^2 z) z' = 2 x s (1 - s) z'
        s = 1.0 / (1.0 + gl.exp2(x * (-2.302208198144325 - 0.1029432395800235 * x * x)))
        g = s + 2.0 * x * s * (1.0 - s) * (0.7978845608028654 + 0.10703222440890037 * x * x)
    elif ACT == 1:  # gelu: Phi(x) + x phi(x)
        g = 0.5 * (1.0 + gl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * gl.exp2(x * x * -0.7213475204444817)
    elif ACT == 2:  # silu: s (1 + x (1 - s))
        s = 1.0 / (1.0 + gl.exp2(x * -1.4426950408889634))
        g = s * (1.0 + x * (1.0 - s))
    elif ACT == 3:  # relu (0 at x = 0, as torch)
        g = gl.where(x > 0.0, 1.0, 0.0)
    else:
        g = gl.full(x.shape, 1.0, gl.float32, x.type.layout)
    return g


DQ_SB = gl.constexpr(64)  # K/V rows per dS block of the dQ kernel


@gluon.jit
def _opaque_zero(i):
    """0, computed from the loop counter i in a way the compiler cannot see through. Indexing a shared-memory
    buffer with it makes the wgmma descriptors of that buffer loop-variant: otherwise the compiler hoists every
    k-step's descriptor of every block out of the tile loop and keeps them live in registers (the backward
    kernels spilled 8-300 bytes at D = 128 from that alone)."""
    return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [i], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _ds_block(q, do, k_blk, v_blk, scale, ACT: gl.constexpr, op_layout: gl.constexpr):
    """dS = act'(S) * scale * dP for one column block of K/V rows, S and dP recomputed, as dQ's wgmma operand."""
    BM: gl.constexpr = q.type.shape[0]
    SB: gl.constexpr = k_blk.type.shape[0]
    s_layout: gl.constexpr = mma_layout(BM, SB, 4)
    sc = warpgroup_mma(q, k_blk.permute((1, 0)), gl.zeros([BM, SB], gl.float32, layout=s_layout), use_acc=False,
                       is_async=True)
    dp = warpgroup_mma(do, v_blk.permute((1, 0)), gl.zeros([BM, SB], gl.float32, layout=s_layout), use_acc=False,
                       is_async=True)
    sc, dp = warpgroup_mma_wait(0, deps=(sc, dp))
    return gl.convert_layout((_act_grad(sc, ACT) * scale * dp).to(q.dtype), op_layout)


@gluon.jit
def _dq_tile(q, do, k_buf, v_buf, scale, ACT: gl.constexpr, o_layout: gl.constexpr, SB_MAX: gl.constexpr):
    """dQ of one Q tile, issued (the caller waits): S and dP recomputed in column blocks of SB K/V rows, dQ +=
    dS K per block. Small blocks keep the activation's math beside the live dQ accumulator within the
    registers (whole [BM, 128] S and dP tiles spilled at D = 128)."""
    D: gl.constexpr = q.type.shape[1]
    BM: gl.constexpr = q.type.shape[0]
    S: gl.constexpr = k_buf.type.shape[0]
    SB: gl.constexpr = SB_MAX if S > SB_MAX else S
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # the first block's accumulator is made after its dS: a zero tile made before would be live through the math
    ds = _ds_block(q, do, k_buf.slice(0, SB), v_buf.slice(0, SB), scale, ACT, op_layout)
    dq = warpgroup_mma(ds, k_buf.slice(0, SB), gl.zeros([BM, D], gl.float32, layout=o_layout), use_acc=False,
                       is_async=True)
    for j in gl.static_range(1, S // SB):
        dq = warpgroup_mma_wait(0, deps=(dq,))
        k_blk = k_buf.slice(j * SB, SB)
        ds = _ds_block(q, do, k_blk, v_buf.slice(j * SB, SB), scale, ACT, op_layout)
        dq = warpgroup_mma(ds, k_blk, dq, is_async=True)
    return dq


@gluon.jit
def _item(off_ptr, item, n_chunks, H, T, BM: gl.constexpr, CH: gl.constexpr):
    """(b, h, first row, end of the sequence, Q tiles) of work item ``item`` = (b * H + h) * n_chunks + chunk:
    CH tiles of BM rows from the chunk's first row, fewer at the sequence's end, none past it. The sequence's
    bounds are clamped into [0, T]."""
    chunk = item % n_chunks
    bh = item // n_chunks
    b = bh // H
    end = gl.minimum(gl.maximum(gl.load(off_ptr + b + 1), 0), T)
    start = gl.minimum(gl.maximum(gl.load(off_ptr + b), 0), end)
    row_begin = start + chunk * (CH * BM)
    n_tiles = gl.minimum(gl.maximum(end - row_begin + (BM - 1), 0) // BM, CH)
    return b, bh - b * H, row_begin, end, n_tiles


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, q_ready, q_empty, kv_ready,
            kv_empty, off_ptr, T, H, n_chunks, n_items, eargs, CH: gl.constexpr, MODE: gl.constexpr,
            FLAGS: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = k_desc.block_type.shape[0]
    NQ: gl.constexpr = q_bufs.type.shape[0]
    KVB: gl.constexpr = k_bufs.type.shape[0]
    c = 0  # Q tiles loaded so far (the ring's position)
    j = 0  # work items with tiles so far (the K/V buffer's position)
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, row_begin, end, n_tiles = _item(off_ptr, item, n_chunks, H, T, BM, CH)
        if n_tiles > 0:
            kb = j % KVB
            # a fresh mbarrier counts as having completed the phase before phase 0: the first laps pass
            mbarrier.wait(kv_empty.index(kb), ((j // KVB) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(2 * kb), k_desc.block_type.nbytes)
            tma_load(k_desc, [b * S, h * D], kv_ready.index(2 * kb), k_bufs.index(kb))
            mbarrier.expect(kv_ready.index(2 * kb + 1), v_desc.block_type.nbytes)
            tma_load(v_desc, [b * S, h * D], kv_ready.index(2 * kb + 1), v_bufs.index(kb))
            for i in range(n_tiles):
                s = (c + i) % NQ
                mbarrier.wait(q_empty.index(s), (((c + i) // NQ) & 1) ^ 1)
                if MODE == 2 and FLAGS & FLAG_STAGED_STATS:
                    _stage_stats(stat_bufs, s, eargs, row_begin + i * BM, end, BM)
                if MODE != 1:
                    mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
                else:  # dQ: the tile's dO too, on the same barrier
                    mbarrier.expect(q_ready.index(s), 2 * q_desc.block_type.nbytes)
                    tma_load(do_desc, [row_begin + i * BM, h * D], q_ready.index(s), do_bufs.index(s))
                tma_load(q_desc, [row_begin + i * BM, h * D], q_ready.index(s), q_bufs.index(s))
            c += n_tiles
            j += 1


@gluon.jit
def _stage_stats(stat_bufs, slot, eargs, row0, end, BM: gl.constexpr):
    """The loader's copy of a Q tile's LayerNorm statistics (mean, rstd; 0 past the sequence's end) into the
    tile's slot of shared memory, before it arrives on the slot's barrier: the consumers then read them next to
    the tile instead of waiting on global memory in the middle of their own tile."""
    mean_ptr = eargs[2]
    rstd_ptr = eargs[3]
    layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
    rows = row0 + gl.arange(0, BM, layout=layout)
    ok = rows < end
    stat_bufs.index(2 * slot).store(gl.load(mean_ptr + rows, mask=ok, other=0.0))
    stat_bufs.index(2 * slot + 1).store(gl.load(rstd_ptr + rows, mask=ok, other=0.0))
    thread_barrier()  # every lane's stores precede the arrive that publishes the slot


@gluon.jit
def _store_rows(o, o_ptr, o_buf, o_desc, row0, col, end, ld_o, BM: gl.constexpr, D: gl.constexpr,
                layout: gl.constexpr):
    """Store the O tile of rows row0 .. row0 + BM, but no row at or past ``end`` (the sequence's)."""
    if row0 + BM <= end:
        tma.store_wait(0)  # the staging tile's previous store has read it
        o_buf.store(o.to(o_desc.dtype))
        fence_async_shared()
        tma_store(o_desc, [row0, col], o_buf)
    else:  # the sequence's last tile: only its own rows (TMA would write the next sequence's)
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        offs = gl.expand_dims(rows * ld_o, 1) + gl.expand_dims(cols, 0)
        base = o_ptr + row0.to(gl.int64) * ld_o + col
        gl.store(base + offs, o.to(o_desc.dtype), mask=gl.expand_dims(rows < end - row0, 1))


@gluon.jit
def _ln_tile(q_smem, stat_bufs, slot, row0, end, h, eargs, FLAGS: gl.constexpr, layout: gl.constexpr):
    """ln_q (fp32, ``layout``) of the Q tile in shared memory: (q - mean) * rstd (* w1 + b1) with the token
    statistics of its rows (0 for rows past the sequence's end, which are never stored) and head h's slice of
    the LayerNorm's weight and bias. The statistics are new to every tile: with FLAG_STAGED_STATS the loader
    staged them in ``stat_bufs`` (rows 2 slot and 2 slot + 1 of [2 NQ, BM] fp32 in shared memory); otherwise
    they are read from global memory here, on the tile's critical path. The weight and bias are the same for
    every tile of a work item (L1 hits after the first); kept in registers per item they spilled. FLAG_BLOCK
    (H = 1, the whole block in one kernel): the statistics are the tile's own rows' (two passes over
    registers) and are stored to mean / rstd for the backward; ``eargs[8]`` is the LayerNorm's eps."""
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    w1_ptr = eargs[0]
    b1_ptr = eargs[1]
    mean_ptr = eargs[2]
    rstd_ptr = eargs[3]
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = h * D + gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    if FLAGS & FLAG_BLOCK:  # the whole token is this tile (H = 1): statistics from the tile, stored for the backward
        x = q_smem.load(layout).to(gl.float32)
        mean = gl.sum(x, axis=1) / D
        xc = x - gl.expand_dims(mean, 1)
        rstd = gl.rsqrt(gl.sum(xc * xc, axis=1) / D + eargs[8])
        ok = rows < end
        gl.store(mean_ptr + rows, mean, mask=ok)
        gl.store(rstd_ptr + rows, rstd, mask=ok)
        y = xc * gl.expand_dims(rstd, 1)
    else:
        if FLAGS & FLAG_STAGED_STATS:
            mean = stat_bufs.index(2 * slot).load(gl.SliceLayout(1, layout))
            rstd = stat_bufs.index(2 * slot + 1).load(gl.SliceLayout(1, layout))
        else:
            ok = rows < end
            mean = gl.load(mean_ptr + rows, mask=ok, other=0.0)
            rstd = gl.load(rstd_ptr + rows, mask=ok, other=0.0)
        x = q_smem.load(layout).to(gl.float32)
        y = (x - gl.expand_dims(mean, 1)) * gl.expand_dims(rstd, 1)
    if FLAGS & FLAG_LN_WEIGHT:
        y = y * gl.expand_dims(gl.load(w1_ptr + cols).to(gl.float32), 0)
    if FLAGS & FLAG_LN_BIAS:
        y = y + gl.expand_dims(gl.load(b1_ptr + cols).to(gl.float32), 0)
    return y


@gluon.jit
def _store_row_sums(ss, ss_ptr, row0, end, h, H, BM: gl.constexpr, layout: gl.constexpr):
    """Head h's per-token sums into ss [T, H] (fp32), the sequence's rows only."""
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    gl.store(ss_ptr + rows.to(gl.int64) * H + h, ss, mask=rows < end)


@gluon.jit
def _block_epilogue(o, q_smem, q_empty, o_buf, row0, end, eargs, FLAGS: gl.constexpr, layout: gl.constexpr):
    """The whole block's end for one tile (H = 1): rms_in = o rounded (stored for the backward), its RMSNorm
    statistic r2 (stored), and the output o * r2 (* g2) + q, q read again from the tile's slot, which is then
    released. ``eargs`` = (w1, b1, mean, rstd, r2, w2, rms_desc, rms_ptr, ln_eps, rms_eps)."""
    BM: gl.constexpr = o.type.shape[0]
    D: gl.constexpr = o.type.shape[1]
    # rounded as stored (the RMS sees the o the backward gets), and kept at 16 bits from here: the fp32 tile and
    # the residual's tile live at once spilled (erf GELU, D = 128)
    ob = o.to(q_smem.dtype)
    _store_rows(ob, eargs[7], o_buf, eargs[6], row0, 0, end, D, BM, D, layout)
    of = ob.to(gl.float32)
    r2 = gl.rsqrt(gl.sum(of * of, axis=1) / D + eargs[9])
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    gl.store(eargs[4] + rows, r2, mask=rows < end)
    y = ob.to(gl.float32) * gl.expand_dims(r2, 1)
    if FLAGS & FLAG_RMS_WEIGHT:
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        y = y * gl.expand_dims(gl.load(eargs[5] + cols).to(gl.float32), 0)
    y = y + q_smem.load(layout).to(gl.float32)
    thread_barrier()  # every thread has read the Q slot
    mbarrier.arrive(q_empty)
    return y


@gluon.jit
def _consumer(q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, kv_ready, kv_empty, o_desc, o_ptr,
              off_ptr, T, H, n_chunks, n_items, scale, eargs, ACT: gl.constexpr, CH: gl.constexpr, CID: gl.constexpr,
              MODE: gl.constexpr, FLAGS: gl.constexpr):
    """MODE 0 (forward): O = act(Q K^T) * scale @ V. MODE 1 (dQ): dQ = (act'(Q K^T) * scale * (dO V^T)) @ K, S and dP
    recomputed per tile (o_* then name dQ's output). MODE 2 (FlashNormAttention's attention): ln_q = the
    LayerNorm of the Q tile from the token statistics, O = act(ln_q K^T) * scale @ V + ln_q, rounded, and
    sum(O^2) per token for the RMSNorm (``eargs`` = (w1, b1, mean, rstd, ss) pointers, FLAGS: FLAG_LN_WEIGHT,
    FLAG_LN_BIAS, FLAG_STAGED_STATS with ``stat_bufs`` [2 NQ, BM]). MODE 3 (the whole block, H = 1, FLAG_BLOCK):
    MODE 2 with the LayerNorm statistics from the tile and the RMSNorm and second residual in the epilogue
    (``_block_epilogue``); O is the block's output (``eargs`` in ``gdpa_fnb_kernel``'s order)."""
    BM: gl.constexpr = q_bufs.type.shape[1]
    D: gl.constexpr = q_bufs.type.shape[2]
    S: gl.constexpr = k_bufs.type.shape[1]
    NQ: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    KVB: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = mma_layout(BM, S, 4)
    o_layout: gl.constexpr = mma_layout(BM, D, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_buf = o_bufs.index(CID)
    ld_o = H * D
    c = 0
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, row_begin, end, n_tiles = _item(off_ptr, item, n_chunks, H, T, BM, CH)
        if n_tiles > 0:
            kb = j % KVB
            kv_phase = (j // KVB) & 1
            k_buf = k_bufs.index(kb)
            v_buf = v_bufs.index(kb)
            # Waited for even without tiles here: a consumer releases an item's K and V only after they landed,
            # which the loader allows only once both consumers released the item two back in this buffer. So a
            # consumer with no tiles cannot run ahead and complete a buffer's phase with its own two arrivals.
            mbarrier.wait(kv_ready.index(2 * kb), kv_phase)
            for i in range(CID, n_tiles, 2):
                s = (c + i) % NQ
                mbarrier.wait(q_ready.index(s), ((c + i) // NQ) & 1)
                if MODE == 0:
                    acc = warpgroup_mma(q_bufs.index(s), k_buf.permute((1, 0)),
                                        gl.zeros([BM, S], gl.float32, layout=s_layout), use_acc=False, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    mbarrier.arrive(q_empty.index(s))
                    p = gl.convert_layout((_act(acc, ACT) * scale).to(dtype), p_layout)
                    mbarrier.wait(kv_ready.index(2 * kb + 1), kv_phase)
                    o = warpgroup_mma(p, v_buf, gl.zeros([BM, D], gl.float32, layout=o_layout), use_acc=False,
                                      is_async=True)
                elif MODE == 1:
                    mbarrier.wait(kv_ready.index(2 * kb + 1), kv_phase)
                    z = _opaque_zero(i)
                    o = _dq_tile(q_bufs.index(s), do_bufs.index(s), k_bufs.index(kb + z), v_bufs.index(kb + z), scale,
                                 ACT, o_layout, DQ_SB)
                    mbarrier.arrive(q_empty.index(s))
                else:
                    lnq = _ln_tile(q_bufs.index(s), stat_bufs, s, row_begin + i * BM, end, h, eargs, FLAGS, o_layout)
                    if MODE == 2:  # (MODE 3 reads the tile again for the second residual: released after that)
                        thread_barrier()  # every thread has read the Q slot
                        mbarrier.arrive(q_empty.index(s))
                    a = gl.convert_layout(lnq.to(dtype), gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
                    acc = warpgroup_mma(a, k_buf.permute((1, 0)), gl.zeros([BM, S], gl.float32, layout=s_layout),
                                        use_acc=False, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    p = gl.convert_layout((_act(acc, ACT) * scale).to(dtype), p_layout)
                    mbarrier.wait(kv_ready.index(2 * kb + 1), kv_phase)
                    o = warpgroup_mma(p, v_buf, lnq, is_async=True)  # residual 1: the accumulator starts at ln_q
                o = warpgroup_mma_wait(0, deps=(o,))
                if MODE == 2:
                    o = o.to(dtype).to(gl.float32)  # rounded as stored: the RMS sees the o the backward gets
                    _store_row_sums(gl.sum(o * o, axis=1), eargs[4], row_begin + i * BM, end, h, H, BM, o_layout)
                if MODE == 3:
                    o = _block_epilogue(o, q_bufs.index(s), q_empty.index(s), o_buf, row_begin + i * BM, end, eargs,
                                        FLAGS, o_layout)
                _store_rows(o, o_ptr, o_buf, o_desc, row_begin + i * BM, h * D, end, ld_o, BM, D, o_layout)
            # this consumer's last read of the item's K and V has retired (each consumer arrives once)
            mbarrier.wait(kv_ready.index(2 * kb + 1), kv_phase)
            mbarrier.arrive(kv_empty.index(kb))
            c += n_tiles
            j += 1
    tma.store_wait(0)


@gluon.jit
def gdpa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale,
                    ACT: gl.constexpr, CH: gl.constexpr, NQ: gl.constexpr, LOAD_REGS: gl.constexpr,
                    MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """O for the work items of this program (module docstring)."""
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    _partitions(q_desc, q_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale, (), ACT, CH,
                NQ, 0, 0, LOAD_REGS, MMA_REGS)


@gluon.jit
def gdpa_fna_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale, w1_ptr, b1_ptr,
                    mean_ptr, rstd_ptr, ss_ptr, ACT: gl.constexpr, CH: gl.constexpr, NQ: gl.constexpr,
                    FLAGS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """FlashNormAttention's attention (MODE 2 of the partitions): o = GDPA(ln_q) + ln_q and its per-head sums
    of squares, ln_q rebuilt from the Q tiles in shared memory and the token statistics."""
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    _partitions(q_desc, q_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale,
                (w1_ptr, b1_ptr, mean_ptr, rstd_ptr, ss_ptr), ACT, CH, NQ, 2, FLAGS, LOAD_REGS, MMA_REGS)


@gluon.jit
def gdpa_fnb_kernel(q_desc, k_desc, v_desc, o_desc, rms_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale, w1_ptr,
                    b1_ptr, mean_ptr, rstd_ptr, w2_ptr, r2_ptr, rms_ptr, ln_eps, rms_eps, ACT: gl.constexpr,
                    CH: gl.constexpr, NQ: gl.constexpr, FLAGS: gl.constexpr, LOAD_REGS: gl.constexpr,
                    MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """The whole FlashNormAttention block where H = 1 (MODE 3 of the partitions): out = RMSNorm(GDPA(ln_q) +
    ln_q) (* g2) + q with the LayerNorm's statistics from the tile, rms_in (the rounded o) and the statistics
    stored for the backward; no per-token kernels before or after (FLAGS: FLAG_LN_WEIGHT, FLAG_LN_BIAS,
    FLAG_RMS_WEIGHT, and FLAG_BLOCK always)."""
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    gl.static_assert((FLAGS & (FLAG_STAGED_STATS | FLAG_BLOCK)) == FLAG_BLOCK,
                     "the block's own statistics, none staged")
    _partitions(q_desc, q_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale,
                (w1_ptr, b1_ptr, mean_ptr, rstd_ptr, r2_ptr, w2_ptr, rms_desc, rms_ptr, ln_eps, rms_eps), ACT, CH,
                NQ, 3, FLAGS, LOAD_REGS, MMA_REGS)


@gluon.jit
def gdpa_dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, dq_ptr, off_ptr, T, H, n_chunks, n_items, scale,
                   ACT: gl.constexpr, CH: gl.constexpr, NQ: gl.constexpr, LOAD_REGS: gl.constexpr,
                   MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """dQ for the work items of this program: the forward's structure with dO loaded beside each Q tile."""
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    _partitions(q_desc, do_desc, k_desc, v_desc, dq_desc, dq_ptr, off_ptr, T, H, n_chunks, n_items, scale, (), ACT, CH,
                NQ, 1, 0, LOAD_REGS, MMA_REGS)


@gluon.jit
def _partitions(q_desc, do_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale, eargs,
                ACT: gl.constexpr, CH: gl.constexpr, NQ: gl.constexpr, MODE: gl.constexpr, FLAGS: gl.constexpr,
                LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [NQ, BM, D], q_desc.layout)
    if MODE != 1:
        do_bufs = q_bufs  # not read
    else:
        do_bufs = gl.allocate_shared_memory(dtype, [NQ, BM, D], do_desc.layout)
    # K/V buffers: two in the forward (the next item's land under the current one's tiles); one for dQ, whose
    # program has one item (and with a runtime buffer index its wgmma descriptors did not fit the registers)
    KVB: gl.constexpr = 1 if MODE == 1 else 2
    # the LayerNorm statistics of each Q slot (FlashNormAttention with FLAG_STAGED_STATS; else q_bufs stands in,
    # unread)
    if MODE == 2 and FLAGS & FLAG_STAGED_STATS:
        stat_bufs = gl.allocate_shared_memory(gl.float32, [2 * NQ, BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        stat_bufs = q_bufs
    k_bufs = gl.allocate_shared_memory(dtype, [KVB, S, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [KVB, S, D], v_desc.layout)
    o_bufs = gl.allocate_shared_memory(dtype, [2, BM, D], o_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [2 * KVB, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KVB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NQ):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(2 * KVB):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(KVB):
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release an item's K and V
    gl.warp_specialize([
        (_consumer, (q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, kv_ready, kv_empty,
                     o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale, eargs, ACT, CH, 0, MODE, FLAGS)),
        (_consumer, (q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, kv_ready, kv_empty,
                     o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale, eargs, ACT, CH, 1, MODE, FLAGS)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, q_ready, q_empty,
                   kv_ready, kv_empty, off_ptr, T, H, n_chunks, n_items, eargs, CH, MODE, FLAGS)),
    ], [4, 1], [MMA_REGS, LOAD_REGS])


@gluon.jit
def _dkdv_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_buf, v_buf, q_ready, q_empty, kv_bar, b, h,
                 start, n_tiles):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = k_desc.block_type.shape[0]
    NQ: gl.constexpr = q_bufs.type.shape[0]
    mbarrier.expect(kv_bar.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b * S, h * D], kv_bar.index(0), k_buf.index(0))
    tma_load(v_desc, [b * S, h * D], kv_bar.index(0), v_buf.index(0))
    for i in range(n_tiles):
        s = i % NQ
        mbarrier.wait(q_empty.index(s), ((i // NQ) & 1) ^ 1)
        mbarrier.expect(q_ready.index(s), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [start + i * BM, h * D], q_ready.index(s), q_bufs.index(s))
        tma_load(do_desc, [start + i * BM, h * D], q_ready.index(s), do_bufs.index(s))


@gluon.jit
def _dkdv_consumer(q_bufs, do_bufs, k_buf, v_buf, out_bufs, q_ready, q_empty, kv_bar, dk_desc, dv_desc, b, h, start,
                   end, n_tiles, scale, ACT: gl.constexpr, CID: gl.constexpr):
    """dK and dV of this consumer's 64 rows of K/V over all the sequence's Q tiles, transposed tiles (S^T =
    K Q^T is [64, BM], so no transpose of a result is needed): dV += P^T dO, dK += dS^T Q."""
    BM: gl.constexpr = q_bufs.type.shape[1]
    D: gl.constexpr = q_bufs.type.shape[2]
    S: gl.constexpr = k_buf.type.shape[1]
    NQ: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    R: gl.constexpr = 64  # K/V rows per consumer (one warpgroup's wgmma M)
    t_layout: gl.constexpr = mma_layout(R, BM, 4)
    acc_layout: gl.constexpr = mma_layout(R, D, 4)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dk = gl.zeros([R, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([R, D], gl.float32, layout=acc_layout)
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, t_layout))
    mbarrier.wait(kv_bar.index(0), 0)
    for i in range(n_tiles):
        s = i % NQ
        mbarrier.wait(q_ready.index(s), (i // NQ) & 1)
        z = _opaque_zero(i)
        k_rows = k_buf.index(z).slice(CID * R, R)
        v_rows = v_buf.index(z).slice(CID * R, R)
        st = warpgroup_mma(k_rows, q_bufs.index(s).permute((1, 0)), gl.zeros([R, BM], gl.float32, layout=t_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_rows, do_bufs.index(s).permute((1, 0)),
                            gl.zeros([R, BM], gl.float32, layout=t_layout), use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        # Q rows past the sequence's end (the next sequence's, or TMA's zeros past T) must not contribute
        ok = gl.expand_dims(cols < end - (start + i * BM), 0)
        pt = gl.convert_layout(gl.where(ok, _act(st, ACT) * scale, 0.0).to(dtype), op_layout)
        dv = warpgroup_mma(pt, do_bufs.index(s), dv, is_async=True)
        dst = gl.convert_layout(gl.where(ok, _act_grad(st, ACT) * scale * dpt, 0.0).to(dtype), op_layout)
        dk = warpgroup_mma(dst, q_bufs.index(s), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(s))
    dk_buf = out_bufs.index(2 * CID)
    dv_buf = out_bufs.index(2 * CID + 1)
    dk_buf.store(dk.to(dtype))
    dv_buf.store(dv.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [b * S + CID * R, h * D], dk_buf)
    tma_store(dv_desc, [b * S + CID * R, h * D], dv_buf)
    tma.store_wait(0)


@gluon.jit
def gdpa_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, off_ptr, T, H, scale, ACT: gl.constexpr,
                     NQ: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV of one (b, h) per program: K and V stay in shared memory (S = 64 or 128 rows, one consumer
    warpgroup per 64), the sequence's Q and dO tiles stream through a ring that both consumers read. Each dK/dV
    row has one owner (no atomics); a sequence of length 0 writes zeros."""
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = k_desc.block_type.shape[0]
    NCONS: gl.constexpr = S // 64
    dtype: gl.constexpr = q_desc.dtype
    bh = gl.program_id(0)
    b = bh // H
    h = bh - b * H
    end = gl.minimum(gl.maximum(gl.load(off_ptr + b + 1), 0), T)
    start = gl.minimum(gl.maximum(gl.load(off_ptr + b), 0), end)
    n_tiles = (end - start + (BM - 1)) // BM
    q_bufs = gl.allocate_shared_memory(dtype, [NQ, BM, D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NQ, BM, D], do_desc.layout)
    k_buf = gl.allocate_shared_memory(dtype, [1, S, D], k_desc.layout)  # one buffer, indexed by _opaque_zero
    v_buf = gl.allocate_shared_memory(dtype, [1, S, D], v_desc.layout)
    out_bufs = gl.allocate_shared_memory(dtype, [2 * NCONS, 64, D], dk_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NQ):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NCONS)  # every consumer reads every tile
    mbarrier.init(kv_bar.index(0), count=1)
    if NCONS == 2:
        gl.warp_specialize([
            (_dkdv_consumer, (q_bufs, do_bufs, k_buf, v_buf, out_bufs, q_ready, q_empty, kv_bar, dk_desc, dv_desc, b,
                              h, start, end, n_tiles, scale, ACT, 0)),
            (_dkdv_consumer, (q_bufs, do_bufs, k_buf, v_buf, out_bufs, q_ready, q_empty, kv_bar, dk_desc, dv_desc, b,
                              h, start, end, n_tiles, scale, ACT, 1)),
            (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_buf, v_buf, q_ready, q_empty, kv_bar,
                            b, h, start, n_tiles)),
        ], [4, 1], [MMA_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_dkdv_consumer, (q_bufs, do_bufs, k_buf, v_buf, out_bufs, q_ready, q_empty, kv_bar, dk_desc, dv_desc, b,
                              h, start, end, n_tiles, scale, ACT, 0)),
            (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_buf, v_buf, q_ready, q_empty, kv_bar,
                            b, h, start, n_tiles)),
        ], [1], [LOAD_REGS])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------

GLUON_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)


def unsupported(q: Tensor, k: Tensor) -> Optional[str]:
    """Why the Gluon kernel cannot run these inputs (None: it can). The caller has validated them (and this
    module imports only where Gluon is usable: kernels/triton/gdpa.gluon_unsupported checks that first)."""
    if q.dtype not in GLUON_DTYPES:
        return f"dtype {q.dtype} (the kernel takes bf16 and fp16)"
    t, h, d = q.shape
    s = k.shape[1]
    if d not in HEAD_DIMS:
        return f"head dim {d} (the kernel takes {HEAD_DIMS})"
    if s < 16 or s > 128 or s & (s - 1):
        return f"K/V length {s} (the kernel takes a power of two in [16, 128])"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "not on an sm_90 GPU"
    if t >= 2 ** 31 or k.shape[0] * s >= 2 ** 31:
        return "more than 2^31 rows"
    return None


def _grid(config: GdpaGluonConfig, max_seq_len_q: int, nb: int, h: int) -> tuple[int, int]:
    """(chunks per (b, h), work items)."""
    n_chunks = max(1, -(-max_seq_len_q // (config.block_m * config.chunk)))
    return n_chunks, n_chunks * nb * h


def misaligned(*tensors: Tensor) -> Optional[str]:
    """Why TMA cannot read or write these (contiguous) tensors: a storage address that is not a multiple of 16
    bytes (a view at an odd offset); None when all are aligned. Needs real tensors (not fake ones)."""
    for x in tensors:
        if x.data_ptr() % 16:
            return f"a tensor's storage address is not 16-byte aligned (data_ptr % 16 = {x.data_ptr() % 16})"
    return None


def backward_unsupported(q: Tensor, k: Tensor) -> Optional[str]:
    """Why the Gluon backward kernels cannot run these inputs (None: they can)."""
    why = unsupported(q, k)
    if why is None and k.shape[1] not in (64, 128):
        why = f"K/V length {k.shape[1]} (the backward kernels take 64 or 128: one dK/dV warpgroup per 64 rows)"
    return why


class Plan:
    """One kernel of this module compiled for one argument signature, with its grid and compile-time
    arguments: calling it launches on new tensors of the same shapes, strides and dtypes (``descs``: the 2-D
    views the TMA descriptors cover, ``rest``: the runtime arguments after them). Raises ``common.SpillError`` when
    the specialization spills registers (it is then never launched)."""

    def __init__(self, kernel, label: str, descs: tuple, blocks: tuple, rest: tuple, consts: tuple, grid: int,
                 total_warps: int, device: torch.device) -> None:
        self.blocks, self.consts, self.grid = blocks, consts, grid
        compiled = L.compiled_kernel(kernel, self._descriptors(descs) + rest + consts, 1, num_warps=4,
                                     maxnreg=L.maxnreg(total_warps))
        refuse_spills(compiled, label)
        self.compiled = compiled
        self.fast = L.fast_launcher(compiled, len(descs), 4, device)

    def _descriptors(self, descs: tuple) -> tuple:
        return tuple(descriptor(x, blk) for x, blk in zip(descs, self.blocks))

    def __call__(self, descs: tuple, rest: tuple) -> None:
        if self.fast is not None:
            self.fast(self.grid, descs, rest + self.consts)
            return
        L.run(self.compiled, self.grid, self._descriptors(descs) + rest + self.consts, 4)


_PLANS: dict = memory.cache()


def _launch(key: tuple, make, descs: tuple, rest: tuple) -> None:
    """Launch the cached plan of ``key`` (made by ``make()`` on first use) on these tensors."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = make()
    plan(descs, rest)


def _rows(x: Tensor) -> Tensor:
    """A contiguous [..., H, D] tensor as [rows, H * D]: a head's tile is the TMA box at column h * D."""
    return x.view(-1, x.shape[-2] * x.shape[-1])


def _launch_q_tiles(kind: str, kernel, q: Tensor, k: Tensor, v: Tensor, outs: tuple, q_offsets: Tensor,
                    max_seq_len_q: int, act: int, scale: float, extra: tuple = (), flags: Optional[int] = None,
                    key: tuple = (), config: Optional[GdpaGluonConfig] = None) -> None:
    """Launch a kernel on the Q-tile partitions (``_partitions``) through its cached plan: descriptors of q, k, v
    and of each [T, H, D] output in ``outs`` (the first is also the kernel's o_ptr), then q_offsets, the sizes,
    the scale and ``extra``; compile-time (ACT, CH, NQ[, FLAGS], LOAD_REGS, MMA_REGS). The plan's cache key has
    the signature, the FLAGS and ``key`` (what else the plan depends on: the norm weights' dtypes)."""
    config = config or choose_config(max_seq_len_q)
    t, h, d = q.shape
    nb, s = k.shape[0], k.shape[1]
    n_chunks, n_items = _grid(config, max_seq_len_q, nb, h)
    descs = (_rows(q), _rows(k), _rows(v)) + tuple(_rows(x) for x in outs)
    rest = (outs[0], q_offsets, t, h, n_chunks, n_items, float(scale)) + extra
    consts = (act, config.chunk, config.q_stages) + (() if flags is None else (flags,)) + (LOAD_REGS, MMA_REGS)

    def make():
        grid = max(1, min(n_items, num_sms(q.device)) if config.persistent else n_items)
        tile = [config.block_m, d]
        return Plan(kernel, f"{kind} {config.label()}", descs, (tile, [s, d], [s, d]) + (tile,) * len(outs), rest,
                    consts, grid, _warps("fwd", s), q.device)

    _launch((kind, q.shape, k.shape, q.dtype, q.device, max_seq_len_q, act, config, flags) + key, make, descs, rest)


def gdpa_fwd_gluon(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, o: Tensor, max_seq_len_q: int, act: int,
                   scale: float, config: Optional[GdpaGluonConfig] = None) -> None:
    """Write O of ``gdpa_reference`` into ``o`` (contiguous [T, H, D]); inputs contiguous, checked by the op
    and by ``unsupported``. The launch plan is cached per signature. ``config``: a benchmark hook (None:
    ``choose_config``)."""
    _launch_q_tiles("fwd", gdpa_fwd_kernel, q, k, v, (o,), q_offsets, max_seq_len_q, act, scale, config=config)


def _weights(ws: tuple, stand_in: Tensor) -> tuple:
    """The norm weights ``ws`` as kernel arguments (``stand_in``, never read, where one is absent) and their dtypes
    for the plan's key."""
    return tuple(stand_in if w is None else w for w in ws), tuple(None if w is None else w.dtype for w in ws)


def fna_attention_gluon(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
                        ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
                        rms_in: Tensor, ss: Tensor, act: int, scale: float) -> None:
    """FlashNormAttention's attention step on the forward's structure: rms_in = GDPA(ln_q) + ln_q (rounded to q's
    dtype) and ss [T, H] = its per-head row sums of squares, ln_q rebuilt from q and the LayerNorm statistics
    (mean, rstd [T] fp32) with the norm's weight and bias (contiguous [H * D], or None)."""
    (w1, b1), dtypes = _weights((ln_weight, ln_bias), stand_in=mean)
    flags = fna_flags(ln_weight is not None, ln_bias is not None, staged_stats=STAGE_STATS)
    _launch_q_tiles("fna", gdpa_fna_kernel, q, k, v, (rms_in,), q_offsets, max_seq_len_q, act, scale,
                    (w1, b1, mean, rstd, ss), flags, (dtypes,))


def fna_block_gluon(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
                    ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], rms_weight: Optional[Tensor], ln_eps: float,
                    rms_eps: float, out: Tensor, mean: Tensor, rstd: Tensor, r2: Tensor, rms_in: Tensor, act: int,
                    scale: float) -> None:
    """The whole FlashNormAttention forward where H = 1 (the norms span one tile) in one launch: out, the
    LayerNorm's mean and rstd, the RMSNorm's rstd r2 and rms_in (the rounded o), as the op's Triton path computes
    them in three; inputs contiguous, weights contiguous [D] or None."""
    assert q.shape[1] == 1, "the whole block in one kernel needs the norms inside one tile (H = 1)"
    (w1, b1, w2), dtypes = _weights((ln_weight, ln_bias, rms_weight), stand_in=mean)
    flags = fna_flags(ln_weight is not None, ln_bias is not None, rms_weight is not None, block=True)
    _launch_q_tiles("fnb", gdpa_fnb_kernel, q, k, v, (out, rms_in), q_offsets, max_seq_len_q, act, scale,
                    (w1, b1, mean, rstd, w2, r2, rms_in, float(ln_eps), float(rms_eps)), flags, (dtypes,))


def gdpa_bwd_gluon(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, dq: Tensor, dk: Tensor,
                   dv: Tensor, max_seq_len_q: int, act: int, scale: float) -> None:
    """Write (dq, dk, dv) of ``gdpa_backward_reference`` into the given contiguous buffers; inputs contiguous,
    checked by the op and by ``backward_unsupported``, T > 0 and B * H > 0 (the caller handles the empty
    cases). Two launches: dQ (the forward's structure, one program per work item) and dK/dV (one program per
    (b, h))."""
    t, h, d = q.shape
    nb, s = k.shape[0], k.shape[1]
    cfg = DQ_CONFIG
    n_chunks, n_items = _grid(cfg, max_seq_len_q, nb, h)
    descs = (_rows(q), _rows(dout), _rows(k), _rows(v), _rows(dq))
    rest = (dq, q_offsets, t, h, n_chunks, n_items, float(scale))
    tile, kv = [cfg.block_m, d], [s, d]

    def make_dq():
        return Plan(gdpa_dq_kernel, "gdpa dQ", descs, (tile, tile, kv, kv, tile), rest,
                    (act, cfg.chunk, cfg.q_stages, LOAD_REGS, MMA_REGS), n_items, _warps("dq", s), q.device)

    _launch(("dq", q.shape, k.shape, q.dtype, q.device, max_seq_len_q, act), make_dq, descs, rest)
    bm = dkdv_block_m(d)
    descs = (_rows(q), _rows(dout), _rows(k), _rows(v), _rows(dk), _rows(dv))
    rest = (q_offsets, t, h, float(scale))

    def make_dkdv():
        return Plan(gdpa_dkdv_kernel, "gdpa dK/dV", descs, ([bm, d], [bm, d], kv, kv, [64, d], [64, d]), rest,
                    (act, DKDV_STAGES, LOAD_REGS, MMA_REGS), nb * h, _warps("dkdv", s), q.device)

    _launch(("dkdv", q.shape, k.shape, q.dtype, q.device, act), make_dkdv, descs, rest)


# ----------------------------------------------------------------------------------------------------------
# Offline compile (CPU tests, CI)
# ----------------------------------------------------------------------------------------------------------

_PARAMS = {
    "fwd": ("q_desc", "k_desc", "v_desc", "o_desc", "o_ptr", "off_ptr", "T", "H", "n_chunks", "n_items", "scale",
            "ACT", "CH", "NQ", "LOAD_REGS", "MMA_REGS", "num_warps"),
    "dq": ("q_desc", "do_desc", "k_desc", "v_desc", "dq_desc", "dq_ptr", "off_ptr", "T", "H", "n_chunks", "n_items",
           "scale", "ACT", "CH", "NQ", "LOAD_REGS", "MMA_REGS", "num_warps"),
    "fna": ("q_desc", "k_desc", "v_desc", "o_desc", "o_ptr", "off_ptr", "T", "H", "n_chunks", "n_items", "scale",
            "w1_ptr", "b1_ptr", "mean_ptr", "rstd_ptr", "ss_ptr", "ACT", "CH", "NQ", "FLAGS", "LOAD_REGS", "MMA_REGS",
            "num_warps"),
    "fnb": ("q_desc", "k_desc", "v_desc", "o_desc", "rms_desc", "o_ptr", "off_ptr", "T", "H", "n_chunks", "n_items",
            "scale", "w1_ptr", "b1_ptr", "mean_ptr", "rstd_ptr", "w2_ptr", "r2_ptr", "rms_ptr", "ln_eps", "rms_eps",
            "ACT", "CH", "NQ", "FLAGS", "LOAD_REGS", "MMA_REGS", "num_warps"),
    "dkdv": ("q_desc", "do_desc", "k_desc", "v_desc", "dk_desc", "dv_desc", "off_ptr", "T", "H", "scale", "ACT", "NQ",
             "LOAD_REGS", "MMA_REGS", "num_warps"),
}
DQ_CONFIG = GdpaGluonConfig(64, 8, 2, False)  # two slots of (Q, dO): with K/V double-buffered, 224 KiB
DKDV_STAGES = 2


def dkdv_block_m(d: int) -> int:
    """Q rows per tile of the dK/dV kernel: 32 at D = 128, where [64, 64] S^T and dP^T tiles beside the two
    [64, D] accumulators spill."""
    return 32 if d > 64 else 64


def _kernel(kind: str):
    return {"fwd": gdpa_fwd_kernel, "dq": gdpa_dq_kernel, "dkdv": gdpa_dkdv_kernel, "fna": gdpa_fna_kernel,
            "fnb": gdpa_fnb_kernel}[kind]


def _warps(kind: str, s: int) -> int:
    """All warps of a launch: the consumers' warpgroups and the loader's (padded to a warpgroup)."""
    return 4 * (1 + (s // 64 if kind == "dkdv" else 2))


def compile_offline(d: int, s: int, act: int, dtype: str = "bf16", config: GdpaGluonConfig = PERSISTENT,
                    kind: str = "fwd", w_dtype: str = "bf16", flags: int = fna_flags(True, True)):
    """Compile the forward (``kind`` "fwd"), dQ ("dq"), dK/dV ("dkdv"), FlashNormAttention's attention step
    ("fna") or its whole block at H = 1 ("fnb") for sm_90a on the CPU (``flags``: the latter two's FLAGS)."""
    bm = config.block_m if kind != "dkdv" else dkdv_block_m(d)
    tile, kv = descriptor_type([bm, d], dtype), descriptor_type([s, d], dtype)
    values = dict(q_desc=tile, do_desc=tile, k_desc=kv, v_desc=kv, o_desc=tile, dq_desc=tile,
                  dk_desc=descriptor_type([64, d], dtype), dv_desc=descriptor_type([64, d], dtype),
                  o_ptr=f"*{dtype}", dq_ptr=f"*{dtype}", off_ptr="*i32", T="i32", H="i32", n_chunks="i32",
                  n_items="i32", scale="fp32", w1_ptr=f"*{w_dtype}", b1_ptr=f"*{w_dtype}", mean_ptr="*fp32",
                  rstd_ptr="*fp32", ss_ptr="*fp32", rms_desc=tile, w2_ptr=f"*{w_dtype}", r2_ptr="*fp32",
                  rms_ptr=f"*{dtype}", ln_eps="fp32", rms_eps="fp32")
    stages = DKDV_STAGES if kind == "dkdv" else config.q_stages
    constexprs = dict(ACT=act, CH=config.chunk, NQ=stages, FLAGS=flags, LOAD_REGS=LOAD_REGS, MMA_REGS=MMA_REGS,
                      num_warps=4)
    signature = {p: values.get(p, "constexpr") for p in _PARAMS[kind]}
    constexprs = {k: v for k, v in constexprs.items() if k in signature}
    attrs = runtime_attrs(signature, dict(T=1000, H=3, n_chunks=3, n_items=9))
    return compile_sm90(_kernel(kind), signature, constexprs, 4, L.maxnreg(_warps(kind, s)), attrs)


# The FLAGS the FlashNormAttention launchers can pass: the attention step's and the whole block's, each with every
# set of norm weights. The attention step's launcher passes staged_stats=STAGE_STATS, a switch only the benchmarks
# (and a GPU test) flip: the other setting is no variant the dispatch launches.
_BOTH = (False, True)
FNA_FLAGS = tuple(fna_flags(w, b, staged_stats=STAGE_STATS) for b in _BOTH for w in _BOTH)
FNB_FLAGS = tuple(fna_flags(w, b, r, block=True) for r in _BOTH for b in _BOTH for w in _BOTH)


def offline_variants() -> list[dict]:
    """The forward: every activation at D = 64 and 128, S = 128 (the register-heaviest S), bf16, in both
    schedules, fp16 once. The backward (dQ, dK/dV): every activation at D = 64 and 128, S = 128, and S = 64 (one
    dK/dV consumer). FlashNormAttention's attention step (as STAGE_STATS has it) and whole block: every
    activation at D = 64 and 128 with each set of norm weights its launcher can pass (bf16 weights, persistent
    schedule) and with all of them as fp32 weights in the per-item schedule."""
    out = [dict(op="gdpa", kind="fwd", d=d, s=128, act=a, dtype="bf16", config=list(c)) for d in HEAD_DIMS
           for a in range(5) for c in (PERSISTENT, PER_ITEM)]
    out += [dict(op="gdpa", kind="fwd", d=128, s=32, act=0, dtype="fp16", config=list(PERSISTENT))]
    out += [dict(op="gdpa", kind=k, d=d, s=s, act=a, dtype="bf16", config=list(DQ_CONFIG)) for k in ("dq", "dkdv")
            for d in HEAD_DIMS for s in (64, 128) for a in range(5)]
    for kind, flag_sets in (("fna", FNA_FLAGS), ("fnb", FNB_FLAGS)):
        out += [dict(op="gdpa", kind=kind, d=d, s=128, act=a, dtype="bf16", config=list(PERSISTENT), w_dtype="bf16",
                     flags=f) for d in HEAD_DIMS for a in range(5) for f in flag_sets]
        out += [dict(op="gdpa", kind=kind, d=d, s=128, act=a, dtype="bf16", config=list(PER_ITEM), w_dtype="fp32",
                     flags=max(flag_sets)) for d in HEAD_DIMS for a in range(5)]
    return out


def compile_variant(v: dict):
    given = {k: v[k] for k in ("w_dtype", "flags") if k in v}
    return compile_offline(v["d"], v["s"], v["act"], v["dtype"], GdpaGluonConfig(*v["config"]), v["kind"], **given)
