"""Deferred normalization on the Hopper GEMM core: one GEMM that applies the deferred norm of its input and
writes the partial statistics of its output for the next one (``fusenorm::deferred_mm``).

Semantics are ``applied``'s (ops/deferred_norm.py) on the folded operands (kernels/fold.py): b' = diag(norm
weight) b in a's dtype, bias' (fp32 where a norm bias folds into it, else the linear's own bias) and colsum =
the column sums of the rounded b' (LayerNorm). The core multiplies a @ b' (gemm_core.py, no ``STATS``: the
input's statistics come as partials from its producer); the epilogue (``_deferred_epilogue``), per tile:
1. merges the input's partial statistics ``a_stats`` [Q, M, T_in] of each row (tiles of ``a_tile`` columns of
   a) into (mean, rstd) as ``merge_stats`` does (RMSNorm: the sum of squares; LayerNorm: Chan's merge of
   the tiles' (mean, M2) weighted by their column counts) and applies them to the fp32 accumulator:
       RMSNorm:   acc = rstd * acc
       LayerNorm: acc = rstd * (acc - mean * colsum)
   (the statistics are tiny and read from L2; every N tile of a row block merges them again rather than
   share them: no tile waits for another);
2. adds bias' and the residual (its TMA load was issued before the tile's mainloop, ``_deferred_prologue``,
   through the tile's staging buffer, so the bytes land under the MMAs), the residual scaled per row where
   ``res_rows`` is given (``RES_ROWS``: 1 = scale * r, 3 = scale * (r - center) + shift: a norm's backward
   applied by the GEMM that computes its input gradient), and rounds once to a's dtype: c, TMA-stored
   through the same staging buffer;
3. writes the partial statistics of c *as stored* (the rounded values) in groups of ``OUT_G`` columns for
   the next norm (``partial_stats``): RMSNorm the group's sum of squares, LayerNorm its mean over the valid
   columns and the sum of squared deviations from it (columns >= N left out: two passes within the group,
   exact at |mean| >> std). They are read back from the staging tile c was just stored through, a chunk
   of at most 64 columns at a time (``_group_stats``): in registers, the tile's statistics next to the
   norm's [BN] vectors spilled at 256-wide tiles. A ``stats_regs`` config sums them in registers instead
   (``_register_stats``, REG_STATS: a ping-pong tiles' candidate up to N = 512, where it was faster in
   links; neither form is faster everywhere, so the dispatch times both). Where a group straddles N
   (LayerNorm), the launcher pads the bias with NaN past N and the statistics leave those columns out by
   their value (``nan_pad``).
``OUT_G`` is ``out_tile`` where it divides BN, or BN where the whole row is one tile and one statistics tile
(out_tile >= N): then the single group is the row, masked to N, as ``partial_stats`` counts it.

No row depends on another tile: any N, no clusters, the tile schedule of the core (cooperative or ping-pong
consumers); on tritons whose Gluon has the multi-CTA API also on CTA pairs that load B once for both
(``deferred_pair_kernel``, pair_core.py: the same epilogue, no residual, B [N, K]). Launcher: ``unsupported``
says why an input cannot take this path, ``candidates`` lists the configurations to time, ``DeferredPlan``
compiles one and launches it with the per-call fast path (launch.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..gemm_config import num_sms
from . import launch as L
from ._compat import constexpr_function, gl, gluon, mbarrier, smem_read_fence, thread_barrier, tma, tma_load
from . import pair_core
from .common import (
    LOAD_REGS,
    MAX_TILE_N,
    MMA_REGS,
    b_layout,
    descriptor,
    fit_config,
    operand_problem,
    padded,
    pow2_tile,
    refuse_spills,
    storage_problem,
    tma_ok,
)
from .cpu_compile import compile_sm90, descriptor_type, runtime_attrs
from .epilogues import column_chunk_layout, load_vector, stage_store, tile_index
from .gemm_core import gemm_ws
from .pair_core import pair_ws

# The epilogue's FLAGS (gemm_core passes its switches as one integer): a bit per switch of deferred_mm_kernel,
# the two norm codes (0 none, 1 RMSNorm, 2 LayerNorm) in two bits each, then the statistics group width
# OUT_G. gl.constexpr: the kernels read them as globals.
FLAG_HAS_BIAS = gl.constexpr(1)
FLAG_HAS_RES = gl.constexpr(2)
FLAG_A_SHIFT = gl.constexpr(2)  # a_norm: bits 2-3
FLAG_OUT_SHIFT = gl.constexpr(4)  # out_norm: bits 4-5
FLAG_NORM_MASK = gl.constexpr(3)
# N is a multiple of OUT_G: no group straddles N. Else (LayerNorm's output statistics) the launcher pads the
# bias with NaN past N, which the statistics mask by value (``_group_stats``).
FLAG_EVEN_N = gl.constexpr(64)
FLAG_ROWS_SHIFT = gl.constexpr(7)  # RES_ROWS (0, 1 or 3 per-row vectors of the residual's terms): bits 7-8
# The output statistics summed in registers from the values as stored (``stats_regs`` configs), not read back
# from the staging tile (``_register_stats``): bit 9
FLAG_REG_STATS = gl.constexpr(512)
FLAG_G_SHIFT = gl.constexpr(10)

NONE, RMS, LN = 0, 1, 2  # the norm codes of ops/deferred_norm.py
# The narrowest statistics group: the narrowest wgmma-layout chunk the statistics read (8 columns).
MIN_OUT_G = 8
# The input's partial statistics read per load in ``_input_norm`` (8 tiles: a row of K <= 1024 in one load, a
# few registers a thread next to the accumulator).
STAT_CHUNK = gl.constexpr(8)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _deferred_prologue(off_m, off_n, c_bufs, buf0: gl.constexpr, epi_bar, eargs, FLAGS: gl.constexpr):
    """Before the tile's mainloop: the residual tile into the staging buffer, once the previous tile's c has
    left it, so its bytes land under the MMAs."""
    if (FLAGS & FLAG_HAS_RES) != 0:
        res_desc = eargs[1]
        tma.store_wait(0)
        mbarrier.expect(epi_bar, res_desc.block_type.nbytes)
        tma_load(res_desc, [off_m, off_n], epi_bar, c_bufs.index(buf0))


@gluon.jit
def _pin(x):
    """x, computed here: an opaque copy the compiler keeps in program order with the waits around it."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _wall(epi_bar, it, HAS_RES: gl.constexpr):
    """A point the compiler moves no load across (an mbarrier wait). With a residual, the wait its TMA load
    needs anyway (issued by ``_deferred_prologue``, one per tile: the phase is the tile count's parity);
    without, a wait for the phase before phase 0, which a fresh mbarrier counts as completed (epi_bar then
    completes no phase): it returns at once."""
    if HAS_RES:
        mbarrier.wait(epi_bar, it & 1)
    else:
        mbarrier.wait(epi_bar, 1)


@gluon.jit
def _tile_weights(t, K, a_tile):
    """The column counts of statistics tiles t of a row of K columns (0 for a tile past the row's end)."""
    return gl.maximum(gl.minimum(a_tile, K - t * a_tile), 0).to(gl.float32)


@gluon.jit
def _input_norm(acc, cols, rows, rmask, colsum_ptr, a_stats_ptr, M, K, a_tile, eps, A_NORM: gl.constexpr,
                layout: gl.constexpr):
    """acc with the deferred norm of a's rows applied, from their partial statistics (``merge_stats``).
    The partials are read STAT_CHUNK tiles per load, [BM, STAT_CHUNK] in the rows' own threads (the
    accumulator's layout narrowed), and reduced across the row's lanes: one load's latency per chunk where a
    load per tile left the tile's epilogue waiting on them one after another, longer than a ping-pong
    partner's mainloop at K = 1024."""
    TC: gl.constexpr = STAT_CHUNK
    cl: gl.constexpr = column_chunk_layout(layout, TC)
    kf = K.to(gl.float32)
    t_in = gl.cdiv(K, a_tile)
    r2 = gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(1, cl)), 1)
    m2d = gl.expand_dims(gl.convert_layout(rmask, gl.SliceLayout(1, cl)), 1)
    tc = gl.expand_dims(gl.arange(0, TC, layout=gl.SliceLayout(0, cl)), 0)
    base = a_stats_ptr + r2 * t_in
    zero = gl.zeros([acc.shape[0]], gl.float32, layout=gl.SliceLayout(1, cl))
    if A_NORM == 1:
        ss = zero
        for t0 in range(0, t_in, TC):
            ss += gl.sum(gl.load(base + t0 + tc, mask=m2d & (t0 + tc < t_in), other=0.0), axis=1)
        rstd = gl.rsqrt(ss / kf + eps)
        acc = acc * gl.expand_dims(gl.convert_layout(rstd, gl.SliceLayout(1, layout)), 1)
    else:
        # Chan's merge as merge_stats: the weighted mean first, then the tiles' M2 and the spread of their
        # means around it (a tile past t_in weighs 0)
        q = M * t_in  # LayerNorm's second statistic: M2 of each tile
        wsum = zero
        m2 = zero
        for t0 in range(0, t_in, TC):
            t = t0 + tc
            ok = m2d & (t < t_in)
            wsum += gl.sum(gl.load(base + t, mask=ok, other=0.0) * _tile_weights(t, K, a_tile), axis=1)
            m2 += gl.sum(gl.load(base + q + t, mask=ok, other=0.0), axis=1)
        mean = wsum / kf
        spread = zero
        for t0 in range(0, t_in, TC):
            t = t0 + tc
            d = gl.load(base + t, mask=m2d & (t < t_in), other=0.0) - gl.expand_dims(mean, 1)
            spread += gl.sum(d * d * _tile_weights(t, K, a_tile), axis=1)
        rstd = gl.convert_layout(gl.rsqrt((m2 + spread) / kf + eps), gl.SliceLayout(1, layout))
        mean = gl.convert_layout(mean, gl.SliceLayout(1, layout))
        acc = (acc - gl.expand_dims(mean, 1) * load_vector(colsum_ptr, cols)) * gl.expand_dims(rstd, 1)
    return acc


@gluon.jit
def _row_residual(r, rows, rmask, res_rows_ptr, M, RES_ROWS: gl.constexpr):
    """The residual tile r (fp32) with its per-row terms applied: scale * r (RES_ROWS 1) or scale * (r - center)
    + shift (3), the vectors read from ``res_rows`` [RES_ROWS, M] in the accumulator's row layout."""
    scale = gl.load(res_rows_ptr + rows, mask=rmask, other=0.0)
    if RES_ROWS == 3:
        center = gl.load(res_rows_ptr + M + rows, mask=rmask, other=0.0)
        shift = gl.load(res_rows_ptr + 2 * M + rows, mask=rmask, other=0.0)
        return (r - gl.expand_dims(center, 1)) * gl.expand_dims(scale, 1) + gl.expand_dims(shift, 1)
    return r * gl.expand_dims(scale, 1)


@gluon.jit
def _chunk_sum(buf, col, x_mean, FIRST: gl.constexpr, OUT_NORM: gl.constexpr, EVEN_N: gl.constexpr,
               cl: gl.constexpr):
    """Row sums over CH columns of c from the staging tile (from column ``col`` of the tile): RMSNorm's
    squares; LayerNorm's values (FIRST) or squared deviations from ``x_mean``. Past N, c is NaN where a group
    straddles N (not EVEN_N: the launcher's NaN-padded bias), which marks those columns by value: a mask from
    column indices kept the indices live in registers across every tile (the compiler hoists them out of
    the tile loop)."""
    CH: gl.constexpr = cl.instr_shape[1]
    x = buf.slice(col, CH, dim=1).load(cl).to(gl.float32)
    if OUT_NORM == 1:
        return gl.sum(x * x, axis=1)  # past N, c is 0 (zero-filled operands, zero-padded vectors)
    elif FIRST:
        if not EVEN_N:
            x = gl.where(x == x, x, 0.0)
        return gl.sum(x, axis=1)
    else:
        d = x - gl.expand_dims(x_mean, 1)
        if not EVEN_N:
            d = gl.where(d == d, d, 0.0)
        return gl.sum(d * d, axis=1)


@gluon.jit
def _group_stats(buf, off_m, off_n, M, N, t_out, stats_ptr, G: gl.constexpr, OUT_NORM: gl.constexpr,
                 EVEN_N: gl.constexpr, layout: gl.constexpr):
    """Store the output statistics of the tile's groups of G columns, read back from the staging tile where c
    was stored (the values as stored, a's dtype) in chunks of at most 64 columns: a few registers per chunk,
    none of them live while the accumulator is (in registers, the whole tile's statistics next to the
    norm's vectors spilled). LayerNorm reads each group twice: its mean, then the deviations from it."""
    BM: gl.constexpr = buf.type.shape[0]
    BN: gl.constexpr = buf.type.shape[1]
    CH: gl.constexpr = G if G < 64 else 64
    cl: gl.constexpr = column_chunk_layout(layout, CH)
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, cl))
    rmask = rows < M
    zero = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, cl))
    for g in gl.static_range(BN // G):
        c0 = off_n + g * G
        t = c0 // G
        ok = rmask & (t < t_out)  # a group wholly past N has no statistics tile
        p = stats_ptr + rows * t_out + t
        s = zero
        for j in gl.static_range(G // CH):
            s += _chunk_sum(buf, g * G + j * CH, zero, True, OUT_NORM, EVEN_N, cl)
        if OUT_NORM == 1:
            gl.store(p, s, mask=ok)
        else:
            mean = s / gl.minimum(N - c0, G).to(gl.float32)  # zeros past N add nothing: the valid columns'
            # read the group again rather than keep it: the compiler merges the two passes' reads otherwise,
            # and a 128-wide group live in registers spilled
            smem_read_fence()
            m2 = zero
            for j in gl.static_range(G // CH):
                m2 += _chunk_sum(buf, g * G + j * CH, mean, False, OUT_NORM, EVEN_N, cl)
            gl.store(p, mean, mask=ok)
            gl.store(p + M * t_out, m2, mask=ok)


@gluon.jit
def _register_stats(h, off_m, off_n, M, N, t_out, stats_ptr, G: gl.constexpr, OUT_NORM: gl.constexpr,
                    EVEN_N: gl.constexpr, dtype: gl.constexpr):
    """``_group_stats`` from registers: h (fp32, before rounding) rounded to the stored dtype, viewed as
    [BM, BN / G, G] (a reshape, no data moved) and reduced over its groups. Past N the values are 0 (RMSNorm)
    or NaN (LayerNorm, not EVEN_N: the NaN-padded bias), left out by value."""
    BM: gl.constexpr = h.shape[0]
    T: gl.constexpr = h.shape[1] // G
    x = gl.reshape(h.to(dtype).to(gl.float32), [BM, T, G])
    if OUT_NORM == 1:
        s = gl.sum(x * x, axis=2)
    else:
        if EVEN_N:
            s = gl.sum(x, axis=2) / G
        else:
            s = gl.sum(gl.where(x == x, x, 0.0), axis=2)
    sl: gl.constexpr = s.type.layout
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, sl))
    t = off_n // G + gl.arange(0, T, layout=gl.SliceLayout(0, sl))  # a group wholly past N has no tile
    p = stats_ptr + gl.expand_dims(rows, 1) * t_out + gl.expand_dims(t, 0)
    ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(t < t_out, 0)
    if OUT_NORM == 2:
        if not EVEN_N:
            s = s / gl.expand_dims(gl.minimum(N - t * G, G).to(gl.float32), 0)
        d = x - gl.expand_dims(s, 2)
        if not EVEN_N:
            d = gl.where(d == d, d, 0.0)
        gl.store(p + M * t_out, gl.sum(d * d, axis=2), mask=ok)
    gl.store(p, s, mask=ok)


@gluon.jit
def _deferred_epilogue(acc, off_m, off_n, pn, c_bufs, buf0: gl.constexpr, epi_bar, it, eargs,
                       FLAGS: gl.constexpr, M, N, layout: gl.constexpr, stats):
    c_desc = eargs[0]
    bias_ptr = eargs[2]
    colsum_ptr = eargs[3]
    a_stats_ptr = eargs[4]
    stats_ptr = eargs[5]
    K = eargs[6]
    a_tile = eargs[7]
    t_out = eargs[8]
    eps = eargs[9]
    res_rows_ptr = eargs[10]
    HAS_BIAS: gl.constexpr = (FLAGS & FLAG_HAS_BIAS) != 0
    HAS_RES: gl.constexpr = (FLAGS & FLAG_HAS_RES) != 0
    A_NORM: gl.constexpr = (FLAGS >> FLAG_A_SHIFT) & FLAG_NORM_MASK
    OUT_NORM: gl.constexpr = (FLAGS >> FLAG_OUT_SHIFT) & FLAG_NORM_MASK
    EVEN_N: gl.constexpr = (FLAGS & FLAG_EVEN_N) != 0
    RES_ROWS: gl.constexpr = (FLAGS >> FLAG_ROWS_SHIFT) & 3
    REG_STATS: gl.constexpr = (FLAGS & FLAG_REG_STATS) != 0
    G: gl.constexpr = FLAGS >> FLAG_G_SHIFT
    BM: gl.constexpr = c_bufs.type.shape[1]
    BN: gl.constexpr = c_bufs.type.shape[2]
    rows, cols, rmask, cmask = tile_index(off_m, off_n, M, N, BM, BN, layout)
    h = acc
    if A_NORM != 0:
        h = _input_norm(h, cols, rows, rmask, colsum_ptr, a_stats_ptr, M, K, a_tile, eps, A_NORM, layout)
    buf = c_bufs.index(buf0)
    if not HAS_RES:
        tma.store_wait(0)  # the staging tile's previous store has left (with a residual the prologue waited)
    # The compiler issues loads as early as it can and computes as late as it can: the bias's loads went up
    # next to colsum's, or the norm's math down past them, and a 256-wide tile's accumulator with both [BN]
    # vectors in registers spilled. So the norm is done (pinned) before a wait, and the bias loaded after it.
    if A_NORM != 0:
        h = _pin(h)
    _wall(epi_bar, it, HAS_RES)
    if HAS_BIAS:
        h = h + load_vector(bias_ptr, cols)
    if HAS_RES:
        r = buf.load(layout).to(gl.float32)
        if RES_ROWS != 0:
            r = _row_residual(r, rows, rmask, res_rows_ptr, M, RES_ROWS)
        h = h + r
        thread_barrier()  # every thread has read the residual before any stages c into the buffer
    # c as stored; the statistics are of these values (read back from the staging tile), so a consumer
    # normalizes exactly what it reads
    stage_store(h, c_desc, buf, off_m, off_n)
    if OUT_NORM != 0:
        if REG_STATS:
            _register_stats(h, off_m, off_n, M, N, t_out, stats_ptr, G, OUT_NORM, EVEN_N, c_desc.dtype)
        else:
            _group_stats(buf, off_m, off_n, M, N, t_out, stats_ptr, G, OUT_NORM, EVEN_N, layout)
            thread_barrier()  # every thread has read the tile before the next tile's residual or c lands in it


@gluon.jit
def deferred_mm_kernel(a_desc, b_desc, c_desc, res_desc, bias_ptr, colsum_ptr, a_stats_ptr, stats_ptr, res_rows_ptr,
                       M, N, K, a_tile, t_out, eps,
                       HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, A_NORM: gl.constexpr, OUT_NORM: gl.constexpr,
                       OUT_G: gl.constexpr, EVEN_N: gl.constexpr, RES_ROWS: gl.constexpr, REG_STATS: gl.constexpr,
                       NUM_STAGES: gl.constexpr, NCONS: gl.constexpr,
                       B_KN: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    eargs = (c_desc, res_desc, bias_ptr, colsum_ptr, a_stats_ptr, stats_ptr, K, a_tile, t_out, eps, res_rows_ptr)
    FLAGS: gl.constexpr = _flags(HAS_BIAS, HAS_RES, A_NORM, OUT_NORM, OUT_G, EVEN_N, RES_ROWS, REG_STATS)
    gemm_ws(a_desc, b_desc, c_desc, M, N, K, _deferred_prologue, _deferred_epilogue, eargs, FLAGS, 0, 1, False,
            NUM_STAGES, 1, 1, NCONS, B_KN, 1, LOAD_REGS, MMA_REGS, num_warps)


@gluon.jit
def deferred_pair_kernel(a_desc, b_desc, c_desc, res_desc, bias_ptr, colsum_ptr, a_stats_ptr, stats_ptr,
                         res_rows_ptr, M, N, K, a_tile, t_out, eps,
                         HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, A_NORM: gl.constexpr, OUT_NORM: gl.constexpr,
                         OUT_G: gl.constexpr, EVEN_N: gl.constexpr, RES_ROWS: gl.constexpr, REG_STATS: gl.constexpr,
                         NUM_STAGES: gl.constexpr, NCONS: gl.constexpr,
                         B_KN: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``deferred_mm_kernel`` on CTA pairs sharing B (pair_core.py; no residual, B [N, K]), the same parameters.
    A kernel of its own: triton 3.6's JIT resolves every function a kernel names, and pair_core names API that
    3.6 lacks."""
    eargs = (c_desc, res_desc, bias_ptr, colsum_ptr, a_stats_ptr, stats_ptr, K, a_tile, t_out, eps, res_rows_ptr)
    FLAGS: gl.constexpr = _flags(HAS_BIAS, HAS_RES, A_NORM, OUT_NORM, OUT_G, EVEN_N, RES_ROWS, REG_STATS)
    pair_ws(a_desc, b_desc, c_desc, M, N, K, _deferred_prologue, _deferred_epilogue, eargs, FLAGS, NUM_STAGES, NCONS,
            LOAD_REGS, MMA_REGS, num_warps)


@constexpr_function
def _flags(HAS_BIAS, HAS_RES, A_NORM, OUT_NORM, OUT_G, EVEN_N, RES_ROWS, REG_STATS):
    """The epilogue's FLAGS integer of the kernels' switches (the FLAG_* bits; here plain ints, their values)."""
    return (HAS_BIAS * FLAG_HAS_BIAS.value + HAS_RES * FLAG_HAS_RES.value + (A_NORM << FLAG_A_SHIFT.value)
            + (OUT_NORM << FLAG_OUT_SHIFT.value) + EVEN_N * FLAG_EVEN_N.value + (RES_ROWS << FLAG_ROWS_SHIFT.value)
            + REG_STATS * FLAG_REG_STATS.value + (OUT_G << FLAG_G_SHIFT.value))


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def out_group(block_n: int, n: int, out_norm: int, out_tile: int) -> Optional[int]:
    """The statistics group width of a tile of block_n columns (``OUT_G``; 0 without output statistics), or
    None where the tile cannot produce out_tile-wide statistics: out_tile must divide the tile (a power of
    two, at least ``MIN_OUT_G``), or cover the whole row where one tile holds it."""
    if out_norm == NONE:
        return 0
    if n <= block_n and out_tile >= n:
        return block_n  # one statistics tile, the row: the tile masked to N
    if out_tile >= MIN_OUT_G and block_n % out_tile == 0:
        return out_tile
    return None


STATS_REGS_TILE = 128  # the statistics tile with a ``stats_regs`` candidate (the graph passes' tile)
STATS_REGS_MAX_N = 512  # and the widest N (measured faster there only)


def candidates(a: Tensor, b: Tensor, out_tile: int, residual: bool = False, res_rows: bool = False) -> list:
    """Configurations worth timing, best guess first: the GEMM core's fastest plain ones (the epilogue is
    light and no row spans tiles; mm_norm.plain_candidates), the tile at most the next power of two of N
    wide. One staging tile per consumer, shared by the residual and c. ``out_tile`` (0: no output
    statistics) keeps the configurations whose tiles it splits (``out_group``). Rows wider than 128 also
    get the CTA-pair tile (``pair_core``) where this triton has it, B is an nn.Linear weight ([N, K]) and
    there is no residual (``residual``, ``res_rows``: whether the call has them)."""
    k = a.shape[1]
    n = b.shape[1]
    bk = 64 if k >= 64 else 32
    if n > 128:
        out = [fit_config("gl_coop", 128, MAX_TILE_N, bk, 4, 8, 1), fit_config("gl_pp", 128, 128, bk, 5, 4, 2),
               fit_config("gl_coop", 128, 128, bk, 6, 4, 1)]
        if (bk == 64 and not residual and not res_rows and b_layout(a, b) == "nk"
                and pair_core.unavailable() is None):
            out[:0] = [fit_config(PAIR_KIND, 128, MAX_TILE_N, bk, 4, 8, 1),
                       fit_config(PAIR_PP_KIND, 128, 128, bk, 5, 4, 2)]
    else:
        bn = pow2_tile(n)
        out = [fit_config("gl_pp", 128, bn, bk, 6, 4, 2), fit_config("gl_coop", 128, bn, bk, 6, 4, 1)]
    norm = RMS if out_tile else NONE
    out = [c for c in out if c is not None and out_group(c.block_n, n, norm, out_tile) is not None]
    # The output statistics summed in registers: faster in the ping-pong tiles' links up to N = 512, within
    # noise or slower elsewhere and on the 256-wide tiles (docs/history/performance-log.md), so timed as a candidate of
    # its own (one more compile per site) only there, for the passes' statistics tile of 128 where N is a
    # multiple of it: narrower groups, or LayerNorm's masking where a group straddles N, spill in it
    regs = [c._replace(stats_regs=True) for c in out
            if c.kind in PING_PONG_KINDS and out_tile == STATS_REGS_TILE and n % out_tile == 0
            and n <= STATS_REGS_MAX_N]
    return out + regs


def unsupported(a: Tensor, b: Tensor, residual: Optional[Tensor], out_norm: int, out_tile: int) -> Optional[str]:
    """Why ``deferred_mm_gluon`` cannot take a [M, K], b (or b') [K, N], the residual and these output
    statistics (None when it can)."""
    why = operand_problem(a, b, None)
    if why is not None:
        return why
    m, n = a.shape[0], b.shape[1]
    if residual is not None:
        if residual.dtype != a.dtype or tuple(residual.shape) != (m, n) or residual.stride(1) != 1:
            return "residual not [M, N] in the operands' dtype with unit column stride"
        if not isinstance(residual, torch._subclasses.FakeTensor) and not tma_ok(residual):
            return "residual's storage is not 16-byte aligned"
    if out_norm != NONE and not candidates(a, b, out_tile):
        return (f"out_tile={out_tile}: statistics tiles must be a power of two from {MIN_OUT_G} to "
                f"{MAX_TILE_N} columns (or cover the row where N <= {MAX_TILE_N})")
    return storage_problem(a, b)


# CTA-pair tiles (block_m rows per CTA, 2 * block_m per pair): one consumer, or two in ping-pong
PAIR_KIND, PAIR_PP_KIND = "gl_pair", "gl_pair_pp"
PAIR_KINDS = (PAIR_KIND, PAIR_PP_KIND)
PING_PONG_KINDS = ("gl_pp", PAIR_PP_KIND)  # two consumers of 4 warps (launch_shape)


class Launch(NamedTuple):
    ncons: int
    num_warps: int
    maxnreg: int
    ctas: int  # CTAs per program (2: a pair, ``pair_core``)


def launch_shape(config) -> Launch:
    ncons = 2 if config.kind in PING_PONG_KINDS else 1
    warps = 4 if ncons == 2 else config.warps
    ctas = 2 if config.kind in PAIR_KINDS else 1
    return Launch(ncons, warps, L.maxnreg(L.padded_warps(1) + warps * ncons), ctas)


def _kernel(shape: Launch):
    return deferred_pair_kernel if shape.ctas > 1 else deferred_mm_kernel


def _blocks(config, shape: Launch, kn: bool) -> tuple:
    """TMA boxes of a, b, c and the residual (whole program tiles: a pair's are 2 * block_m rows)."""
    bm, bn, bk = config.block_m * shape.ctas, config.block_n, config.block_k
    return [bm, bk], [bk, bn] if kn else [bn, bk], [bm, bn], [bm, bn]


def _splits(shape: Launch) -> tuple:
    """The CTA split of each descriptor's box (``_blocks``): None on one CTA; a pair splits a, c and the
    residual along M and loads b whole into both."""
    if shape.ctas == 1:
        return (None,) * 4
    return pair_core.SPLIT_M, pair_core.BROADCAST, pair_core.SPLIT_M, pair_core.SPLIT_M


def _constexprs(config, shape: Launch, n: int, b_kn: bool, *, bias: bool, residual: bool, a_norm: int,
                out_norm: int, out_tile: int, res_rows: int = 0) -> dict:
    if shape.ctas > 1 and (residual or res_rows or b_kn):
        raise ValueError(f"{config.label()}: a CTA pair takes no residual and B as [N, K] only")
    g = out_group(config.block_n, n, out_norm, out_tile)
    if g is None:
        raise ValueError(f"{config.label()}: out_tile={out_tile} does not split its tiles (N={n})")
    # EVEN_N only matters to LayerNorm's statistics: kept False elsewhere (one specialization fewer); where
    # it is False there, the bias is the NaN-padded one (``nan_pad``), present even without a bias
    even = out_norm == LN and n % g == 0
    return dict(HAS_BIAS=bias or nan_pad(config, n, out_norm, out_tile), HAS_RES=residual, A_NORM=a_norm,
                OUT_NORM=out_norm, OUT_G=g, EVEN_N=even, RES_ROWS=res_rows,
                REG_STATS=config.stats_regs and out_norm != NONE, NUM_STAGES=config.stages,
                NCONS=shape.ncons, B_KN=b_kn, LOAD_REGS=LOAD_REGS, MMA_REGS=MMA_REGS)


_PARAMS = ("a_desc", "b_desc", "c_desc", "res_desc", "bias_ptr", "colsum_ptr", "a_stats_ptr", "stats_ptr",
           "res_rows_ptr", "M", "N", "K", "a_tile", "t_out", "eps", "HAS_BIAS", "HAS_RES", "A_NORM", "OUT_NORM",
           "OUT_G", "EVEN_N", "RES_ROWS", "REG_STATS", "NUM_STAGES", "NCONS", "B_KN", "LOAD_REGS", "MMA_REGS",
           "num_warps")
_N_RUNTIME = 15
_N_DESC = 4


def nan_pad(config, n: int, out_norm: int, out_tile: int) -> bool:
    """Whether the bias vector the kernel reads is padded with NaN past N (else with zeros): LayerNorm's
    output statistics where a group straddles N, which find its columns past N by their NaN."""
    return out_norm == LN and n % out_group(config.block_n, n, out_norm, out_tile) != 0


def _nan_padded(v: Tensor, bn: int) -> Tensor:
    return torch.nn.functional.pad(v, (0, -v.shape[0] % bn), value=float("nan"))


def _t_out(n: int, out_norm: int, out_tile: int) -> int:
    """Statistics tiles per row (the stats' row stride); 1 without statistics (never read)."""
    return -(-n // out_tile) if out_norm != NONE else 1


class DeferredPlan:
    """One launch configuration of ``deferred_mm_kernel`` for one argument signature: the compiled kernel, its
    grid and compile-time arguments, and the fast launcher. Calling it launches on new tensors of the same
    shapes, strides and dtypes (absent ones absent again). Raises ``common.SpillError`` when the
    specialization spills (never launched)."""

    def __init__(self, a, b_fold, bias_fold, colsum, residual, a_stats, a_eps, a_norm, a_tile, out_norm, out_tile,
                 c, stats, config, res_rows=None) -> None:
        m, k = a.shape
        n = b_fold.shape[1]
        self.config, self.a_norm, self.out_norm = config, int(a_norm), int(out_norm)
        self.res_rows = res_rows.shape[0] if res_rows is not None else 0
        self.a_tile = int(a_tile) if a_norm != NONE else 1
        self.t_out = _t_out(n, out_norm, out_tile)
        self.eps = float(a_eps) if a_norm != NONE else 0.0
        self.shape = shape = launch_shape(config)
        self.kn = b_layout(a, b_fold) == "kn"
        self.blocks, self.splits = _blocks(config, shape, self.kn), _splits(shape)
        bm, bn = self.blocks[2]
        consts = _constexprs(config, shape, n, self.kn, bias=bias_fold is not None, residual=residual is not None,
                             a_norm=self.a_norm, out_norm=self.out_norm, out_tile=out_tile, res_rows=self.res_rows)
        self.nan = nan_pad(config, n, self.out_norm, out_tile)
        # without a bias, the NaN padding comes on zeros: made once (the plan's N is fixed)
        self.nan_zeros = _nan_padded(torch.zeros(n, dtype=torch.float32, device=a.device), bn) if self.nan else None
        self.consts = tuple(consts[p] for p in _PARAMS[_N_RUNTIME:-1])
        args = self._runtime(a, b_fold, bias_fold, colsum, residual, a_stats, c, stats, res_rows, descriptors=True)
        pair = {"num_ctas": shape.ctas} if shape.ctas > 1 else {}
        compiled = L.compiled_kernel(_kernel(shape), args + self.consts, shape.ctas, num_warps=shape.num_warps,
                                     maxnreg=shape.maxnreg, **pair)
        refuse_spills(compiled, config.label())
        self.compiled = compiled
        self.fast = L.fast_launcher(compiled, _N_DESC, shape.num_warps, a.device)
        # persistent programs (a cluster's CTAs are one program), at most one per tile; clusters as many as
        # can be resident at once (GPCs of uneven size leave SMs a cluster of four cannot use: one cluster
        # more than fit would run its whole share of tiles as a second wave)
        tiles = -(-m // bm) * -(-n // bn)
        self.grid = (L.cluster_grid(compiled, shape.ctas, tiles, a.device) if shape.ctas > 1
                     else min(tiles, num_sms(a.device)))

    def _runtime(self, a, b_fold, bias_fold, colsum, residual, a_stats, c, stats, res_rows, descriptors: bool
                 ) -> tuple:
        m, k = a.shape
        n = b_fold.shape[1]
        bn = self.config.block_n
        # absent tensors: c stands in (never read: the flags say so)
        descs = (a, b_fold if self.kn else b_fold.t(), c, residual if residual is not None else c)
        if descriptors:
            descs = tuple(descriptor(t, blk, split) for t, blk, split in zip(descs, self.blocks, self.splits))
        if self.nan:
            bias_fold = _nan_padded(bias_fold.contiguous(), bn) if bias_fold is not None else self.nan_zeros
        else:
            bias_fold = padded(bias_fold.contiguous(), bn) if bias_fold is not None else c
        colsum = padded(colsum.contiguous(), bn) if self.a_norm == LN else c
        a_stats = a_stats.contiguous() if self.a_norm != NONE else c
        stats = stats if self.out_norm != NONE else c
        res_rows = res_rows.contiguous() if self.res_rows else c
        return descs + (bias_fold, colsum, a_stats, stats, res_rows, m, n, k, self.a_tile, self.t_out, self.eps)

    def __call__(self, a, b_fold, bias_fold, colsum, residual, a_stats, c, stats, res_rows=None) -> None:
        if self.fast is not None:
            args = self._runtime(a, b_fold, bias_fold, colsum, residual, a_stats, c, stats, res_rows,
                                 descriptors=False)
            self.fast(self.grid, args[:_N_DESC], args[_N_DESC:] + self.consts)
            return
        args = self._runtime(a, b_fold, bias_fold, colsum, residual, a_stats, c, stats, res_rows, descriptors=True)
        L.run(self.compiled, self.grid, args + self.consts, self.shape.num_warps)


def deferred_mm_gluon(a, b_fold, bias_fold, colsum, residual, a_stats, a_eps, a_norm, a_tile, out_norm, out_tile, c,
                      stats, config, res_rows=None) -> DeferredPlan:
    """Write (c, stats) of ``applied`` (kernels/deferred.py) with ``config`` (one of ``candidates``) on the
    folded operands into the given buffers (c [M, N] in a's dtype, stats [Q, M, T_out] fp32, 0-size without
    output statistics); ``res_rows``: the residual's per-row terms [1 or 3, M] fp32. Returns the plan, which
    launches the same again on new tensors of the same signature."""
    plan = DeferredPlan(a, b_fold, bias_fold, colsum, residual, a_stats, a_eps, a_norm, a_tile, out_norm, out_tile,
                        c, stats, config, res_rows)
    plan(a, b_fold, bias_fold, colsum, residual, a_stats, c, stats, res_rows)
    return plan


# ----------------------------------------------------------------------------------------------------------
# Offline compile (CPU tests, CI)
# ----------------------------------------------------------------------------------------------------------


def compile_offline(config, n: int, k: int, *, a_norm: int, out_norm: int, out_tile: int = 0, bias: bool,
                    bias_fp32: bool = False, residual: bool, res_rows: int = 0, b_kn: bool = False, m: int = 1024,
                    a_tile: int = 128):
    """Compile the kernel ``deferred_mm_gluon`` would launch for this config and flags, for sm_90a, on the
    CPU, with the launcher's argument types (absent tensors are c, bf16) and the JIT's specialization of these
    sizes. ``bias_fp32``: bias' is fp32 where a norm bias folds into it, else the linear's own bias (bf16)."""
    shape = launch_shape(config)
    t_out = _t_out(n, out_norm, out_tile)
    descs = [descriptor_type(blk, split=split) for blk, split in zip(_blocks(config, shape, b_kn), _splits(shape))]
    values = dict(a_desc=descs[0], b_desc=descs[1], c_desc=descs[2], res_desc=descs[3],
                  bias_ptr="*fp32" if (bias and bias_fp32) or (not bias and nan_pad(config, n, out_norm, out_tile))
                  else "*bf16",
                  colsum_ptr="*fp32" if a_norm == LN else "*bf16", a_stats_ptr="*fp32" if a_norm else "*bf16",
                  stats_ptr="*fp32" if out_norm else "*bf16", res_rows_ptr="*fp32" if res_rows else "*bf16",
                  M="i32", N="i32", K="i32", a_tile="i32",
                  t_out="i32", eps="fp32")
    constexprs = _constexprs(config, shape, n, b_kn, bias=bias, residual=residual, a_norm=a_norm,
                             out_norm=out_norm, out_tile=out_tile, res_rows=res_rows)
    constexprs["num_warps"] = shape.num_warps
    signature = {p: values.get(p, "constexpr") for p in _PARAMS}
    attrs = runtime_attrs(signature, dict(M=m, N=n, K=k, a_tile=a_tile if a_norm else 1, t_out=t_out))
    return compile_sm90(_kernel(shape), signature, constexprs, shape.num_warps, shape.maxnreg, attrs, shape.ctas)


OFFLINE_NS = (64, 256, 1000, 4096)  # one tile; two 128 / one 256 tiles; ragged; many tiles
OFFLINE_KS = (40, 256, 1000)  # K = 40: BK 32
OFFLINE_OUT_TILES = (32, 128, 256)
PAIR_ONLY_FLAGS = ("prod_ln_tower", "chain_ln_tower", "chain_rms_tower")
# the chain's ends and middle: a producer (a plain GEMM writing statistics, with bias and residual), a consumer
# (the norm applied, nothing written: bias' fp32 from a folded norm bias), a link (both), and the plain GEMM
OFFLINE_FLAGS = {
    "prod_rms": dict(a_norm=NONE, out_norm=RMS, bias=True, residual=True),
    "prod_ln": dict(a_norm=NONE, out_norm=LN, bias=True, residual=True),
    "cons_rms": dict(a_norm=RMS, out_norm=NONE, bias=True, residual=False),
    "cons_ln": dict(a_norm=LN, out_norm=NONE, bias=True, bias_fp32=True, residual=True),
    "chain_rms": dict(a_norm=RMS, out_norm=RMS, bias=False, residual=True),
    "chain_ln": dict(a_norm=LN, out_norm=LN, bias=True, bias_fp32=True, residual=True),
    "plain": dict(a_norm=NONE, out_norm=NONE, bias=True, residual=False),
    # without a residual the epilogue's wall is another wait (``_wall``); without a bias, LayerNorm's output
    # statistics still read the NaN-padded vector where a group straddles N
    "cons_ln_nores": dict(a_norm=LN, out_norm=NONE, bias=True, bias_fp32=True, residual=False),
    "chain_ln_bare": dict(a_norm=LN, out_norm=LN, bias=False, residual=False),
    # an MLP tower's (Linear -> norm) blocks, no residual: what the CTA-pair tile takes (pair_core); compiled
    # for the pair only (on one CTA they are cons_ln_nores's and chain_ln_bare's code paths)
    "prod_ln_tower": dict(a_norm=NONE, out_norm=LN, bias=True, residual=False),
    "chain_ln_tower": dict(a_norm=LN, out_norm=LN, bias=True, bias_fp32=True, residual=False),
    "chain_rms_tower": dict(a_norm=RMS, out_norm=RMS, bias=True, residual=False),
    # a norm's input gradient: the GEMM of the consumers' gradients, the norm's backward in the residual's
    # per-row terms (RMSNorm: a scale; LayerNorm: scale, center, shift)
    "dgrad_rms": dict(a_norm=NONE, out_norm=NONE, bias=False, residual=True, res_rows=1),
    "dgrad_ln": dict(a_norm=NONE, out_norm=NONE, bias=False, residual=True, res_rows=3),
    # its folded weights as Inductor lays them out: either orientation (b_kn: W' row-major [K, N])
    "dgrad_ln_kn": dict(a_norm=NONE, out_norm=NONE, bias=False, residual=True, res_rows=3, b_kn=True),
}


def offline_variants() -> list[dict]:
    """Every distinct specialization ``candidates`` produces over a grid of N, K and out_tile, per flag set."""
    seen = {}
    for n in OFFLINE_NS:
        for k in OFFLINE_KS:
            a = torch.empty((1024, k), device="meta", dtype=torch.bfloat16)
            for name, flags in OFFLINE_FLAGS.items():
                kn = flags.get("b_kn", False)
                # b as the launch sees it: row-major [K, N], or an nn.Linear weight [N, K] transposed
                b = torch.empty((k, n) if kn else (n, k), device="meta", dtype=torch.bfloat16)
                b = b if kn else b.t()
                for out_tile in OFFLINE_OUT_TILES if flags["out_norm"] else (0,):
                    for cfg in candidates(a, b, out_tile, flags["residual"], flags.get("res_rows", 0) > 0):
                        shape = launch_shape(cfg)
                        if name in PAIR_ONLY_FLAGS and shape.ctas == 1:
                            continue
                        consts = _constexprs(cfg, shape, n, kn, out_tile=out_tile,
                                             **{f: v for f, v in flags.items() if f not in ("bias_fp32", "b_kn")})
                        seen.setdefault((cfg, name, consts["OUT_G"], consts["EVEN_N"]),
                                        dict(op="deferred_mm", config=list(cfg), n=n, k=k, flags=name,
                                             out_tile=out_tile, save_normed=False, gemm_only=False, b_kn=kn))
    return list(seen.values())


def compile_variant(v: dict):
    from ..gemm_config import GemmConfig

    flags = {f: x for f, x in OFFLINE_FLAGS[v["flags"]].items() if f != "b_kn"}
    return compile_offline(GemmConfig(*v["config"]), v["n"], v["k"], out_tile=v["out_tile"], b_kn=v["b_kn"], **flags)
