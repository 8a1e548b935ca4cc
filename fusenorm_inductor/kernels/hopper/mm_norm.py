"""Post-norm forward on the Hopper GEMM core: ``y = norm(a @ b + bias + residual)`` (``fusenorm::mm_norm``).

Semantics are ``mm_norm_reference``'s (ops/mm_norm.py): fp32 accumulation, bias and residual added in fp32,
fp32 statistics, y rounded once to its dtype, hh (the normalized row before the affine, written when
``save_normed``) once to the pre-norm dtype; mean (LayerNorm) and rstd [M] fp32 for the backward. The
pre-norm tensor is never written.

The epilogue (``_mm_norm_epilogue``) takes the accumulator tile from the core (gemm_core.py):
- whole row in the tile (N <= 256, schedule C = 1): statistics in registers, two-pass for LayerNorm (the
  centred sum of squares, accurate at |mean| >> std), normalize, affine, TMA-store y (and hh);
- rows over C tiles (C > 1, the cluster schedule): each CTA reduces its own tile (RMSNorm: sum of squares;
  LayerNorm: the tile mean and centred M2), writes the per-row partials to a small fp32 scratch [M, C],
  crosses the hardware cluster barrier, reads the C partials of its rows back from L2 and combines them
  (LayerNorm: Chan's pairwise formula, exact in any order), then normalizes its own registers. Nothing but
  the partials leaves the SMs before the output;
- rows of more than 8 tiles (up to 8 x 4 = 32, N <= 8192; ``cluster_shape``): each CTA computes SPAN tiles of
  the row block one after the other. All but its last are "parked" in y (h, or for LayerNorm h minus the
  tile mean, rounded once to y's dtype, as the unfused path rounds h) after publishing their partials; at
  the last one the cluster exchanges, and the parked tiles come back through the staging tile (TMA, mostly
  from L2), are normalized and stored. The parked rounding is one of the 16-bit tolerances the tests allow
  for multi-tile rows.
``NORM = False`` makes it the plain epilogue (y = a @ b + bias + residual): the benchmark's GEMM base.

Launcher: ``unsupported`` says why an input cannot take this path (the dispatch then keeps the ``tl`` or
reference path and the report says so); ``candidates`` lists the configurations worth timing for a shape;
``mm_norm_gluon`` runs one into the caller's output buffers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..gemm_config import num_sms
from . import launch as L
from ._compat import (
    bulk_store_drain,
    cluster_arrive,
    cluster_wait,
    constexpr_function,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma,
    tma_load,
)
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
from .epilogues import load_vector, stage_store, tile_index
from .gemm_core import gemm_ws, no_prologue

# It runs GemmConfigs (kernels/triton/common.py) of kinds "gl_coop", "gl_pp" and "gl_cluster" (cluster size
# cdiv(N, block_n)).

# The epilogue's FLAGS (gemm_core passes its switches as one integer): a bit per switch of mm_norm_kernel, then
# the cluster size C (4 bits) and SPAN. gl.constexpr: the kernels read them as globals.
FLAG_HAS_BIAS = gl.constexpr(1)
FLAG_HAS_RES = gl.constexpr(2)
FLAG_HAS_W = gl.constexpr(4)
FLAG_HAS_NB = gl.constexpr(8)
FLAG_IS_RMS = gl.constexpr(16)
FLAG_SAVE_NORMED = gl.constexpr(32)
FLAG_NORM = gl.constexpr(64)
FLAG_EVEN_N = gl.constexpr(128)
FLAG_SERIAL = gl.constexpr(256)  # hh and y share one staging tile (SAVE_NORMED with NUM_OUT = 1)
FLAG_C_SHIFT = gl.constexpr(9)
FLAG_C_MASK = gl.constexpr(15)
FLAG_SPAN_SHIFT = gl.constexpr(13)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _tile_partial(h, cmask, N, pn, BN: gl.constexpr, IS_RMS: gl.constexpr, EVEN_N: gl.constexpr):
    """This tile's share of its rows' statistics: (x, s1, s2). RMSNorm: x = h, s1 = sum of squares;
    LayerNorm: x = h - tile mean (centred: keeps its precision at |mean| >> std), s1 = tile mean, s2 = M2."""
    if IS_RMS:
        return h, gl.sum(h * h, axis=1), gl.sum(h * h, axis=1)
    else:
        n_here = gl.minimum(N - pn * BN, BN).to(gl.float32)
        t_mean = gl.sum(h, axis=1) / n_here
        d = h - gl.expand_dims(t_mean, 1)
        if not EVEN_N:
            d = gl.where(gl.expand_dims(cmask, 0), d, 0.0)
        return d, t_mean, gl.sum(d * d, axis=1)


@gluon.jit
def _row_stats(rows, rmask, N, p1_ptr, p2_ptr, eps, BN: gl.constexpr, P: gl.constexpr, IS_RMS: gl.constexpr):
    """(mean, rstd) of rows from the P per-tile partials the cluster published (after its barrier; ``.cg``:
    past this SM's L1, which may hold stale lines). LayerNorm merges (count, mean, M2) pairwise (Chan et
    al.), exact in any order; tile r has min(N - r * BN, BN) columns."""
    slot = rows * P
    if IS_RMS:
        ss = gl.load(p1_ptr + slot, mask=rmask, other=0.0, cache_modifier=".cg")
        for r in range(1, P):
            ss += gl.load(p1_ptr + slot + r, mask=rmask, other=0.0, cache_modifier=".cg")
        rstd = gl.rsqrt(ss / N + eps)
        return rstd, rstd
    else:
        cnt = gl.minimum(N, BN).to(gl.float32)
        mean = gl.load(p1_ptr + slot, mask=rmask, other=0.0, cache_modifier=".cg")
        m2 = gl.load(p2_ptr + slot, mask=rmask, other=0.0, cache_modifier=".cg")
        for r in range(1, P):  # not unrolled: all P partials' loads in flight at once took registers
            n_r = gl.minimum(N - r * BN, BN).to(gl.float32)
            mean_r = gl.load(p1_ptr + slot + r, mask=rmask, other=0.0, cache_modifier=".cg")
            m2_r = gl.load(p2_ptr + slot + r, mask=rmask, other=0.0, cache_modifier=".cg")
            tot = cnt + n_r
            delta = mean_r - mean
            mean = mean + delta * (n_r / tot)
            m2 = m2 + m2_r + delta * delta * (cnt * n_r / tot)
            cnt = tot
        return mean, gl.rsqrt(m2 / N + eps)


@gluon.jit
def _store_normed(hh, cols, off_m, off_n, c_bufs, buf0: gl.constexpr, y_desc, hh_desc, w_ptr, nb_ptr,
                  FLAGS: gl.constexpr):
    """Write hh (save_normed) and y = hh * w + nb of one tile through the staging tiles, whose previous
    stores the caller has waited for. hh leaves before y is formed: the two [BM, BN] tiles are never live
    at once (registers)."""
    HAS_W: gl.constexpr = (FLAGS & FLAG_HAS_W) != 0
    HAS_NB: gl.constexpr = (FLAGS & FLAG_HAS_NB) != 0
    SAVE_NORMED: gl.constexpr = (FLAGS & FLAG_SAVE_NORMED) != 0
    SERIAL: gl.constexpr = (FLAGS & FLAG_SERIAL) != 0  # hh and y share one staging tile (NUM_OUT = 1)
    if SAVE_NORMED:
        if SERIAL:
            stage_store(hh, hh_desc, c_bufs.index(buf0), off_m, off_n)
            tma.store_wait(0)  # hh has left the tile before y is staged into it
        else:
            stage_store(hh, hh_desc, c_bufs.index(buf0 + 1), off_m, off_n)
    if HAS_W:
        hh = hh * load_vector(w_ptr, cols)
    if HAS_NB:
        hh = hh + load_vector(nb_ptr, cols)
    stage_store(hh, y_desc, c_bufs.index(buf0), off_m, off_n)


@constexpr_function
def _fixup_layout(BN, layout):
    """A blocked layout of a [BM, BN] tile over the consumer's warps: 8 adjacent columns per thread."""
    tpw_n = min(32, BN // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [layout.warps_per_cta[0], 1], [1, 0])


@gluon.jit
def _last_tile(x, s1, rows, rmask, cols, off_m, off_n, pn, c_bufs, buf0: gl.constexpr, epi_bar, loads, y_desc,
               hh_desc, w_ptr, nb_ptr, mean_ptr, rstd_ptr, p1_ptr, p2_ptr, eps, M, N, FLAGS: gl.constexpr,
               layout: gl.constexpr):
    """A CTA's last tile of a row block in the cluster schedule (its partials published): cluster barrier,
    row statistics, then this tile and the SPAN - 1 tiles parked in y before it, normalized and stored."""
    IS_RMS: gl.constexpr = (FLAGS & FLAG_IS_RMS) != 0
    C: gl.constexpr = (FLAGS >> FLAG_C_SHIFT) & FLAG_C_MASK
    SPAN: gl.constexpr = FLAGS >> FLAG_SPAN_SHIFT
    P: gl.constexpr = C * SPAN
    BN: gl.constexpr = c_bufs.type.shape[2]
    cluster_arrive()
    tma.store_wait(0)  # this CTA's previous stores drain while its peers arrive
    cluster_wait()
    mean, rstd = _row_stats(rows, rmask, N, p1_ptr, p2_ptr, eps, BN, P, IS_RMS)
    first = rmask & (pn == SPAN - 1)  # one CTA of a cluster writes the row statistics
    gl.store(rstd_ptr + rows, rstd, mask=first)
    if IS_RMS:
        hh = x * gl.expand_dims(rstd, 1)
    else:
        gl.store(mean_ptr + rows, mean, mask=first)
        # h - mean = (h - tile mean) + (tile mean - mean)
        hh = (x + gl.expand_dims(s1 - mean, 1)) * gl.expand_dims(rstd, 1)
    _store_normed(hh, cols, off_m, off_n, c_bufs, buf0, y_desc, hh_desc, w_ptr, nb_ptr, FLAGS)
    # The parked tiles: reload each from y through the staging tile, normalize, store. In a blocked layout,
    # where each thread holds 8 adjacent columns: the wgmma layout spreads a thread over BN / 4 columns, and
    # the norm weight and bias in it took the registers the tile needed (spills).
    BM: gl.constexpr = c_bufs.type.shape[1]
    fix: gl.constexpr = _fixup_layout(BN, layout)
    f_rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, fix))
    f_rmask = f_rows < M
    f_cols = gl.arange(0, BN, layout=gl.SliceLayout(0, fix))
    rstd = gl.convert_layout(rstd, gl.SliceLayout(1, fix))
    if not IS_RMS:
        mean = gl.convert_layout(mean, gl.SliceLayout(1, fix))
    for s in gl.static_range(SPAN - 1):
        q = pn - (SPAN - 1) + s
        buf = c_bufs.index(buf0)
        tma.store_wait(0)
        bulk_store_drain()  # the parked tile's store has reached global memory
        thread_barrier()
        mbarrier.expect(epi_bar, y_desc.block_type.nbytes)
        tma_load(y_desc, [off_m, q * BN], epi_bar, buf)
        mbarrier.wait(epi_bar, loads & 1)
        loads += 1
        xq = buf.load(fix).to(gl.float32)
        thread_barrier()  # every thread has read the tile before it is staged again
        if IS_RMS:
            hq = xq * gl.expand_dims(rstd, 1)
        else:
            mq = gl.load(p1_ptr + f_rows * P + q, mask=f_rmask, other=0.0, cache_modifier=".cg")
            hq = (xq + gl.expand_dims(mq - mean, 1)) * gl.expand_dims(rstd, 1)
        _store_normed(hq, q * BN + f_cols, off_m, q * BN, c_bufs, buf0, y_desc, hh_desc, w_ptr, nb_ptr, FLAGS)


@gluon.jit
def _mm_norm_epilogue(acc, off_m, off_n, pn, c_bufs, buf0: gl.constexpr, epi_bar, it, eargs,
                      FLAGS: gl.constexpr, M, N, layout: gl.constexpr, stats):
    y_desc = eargs[0]
    hh_desc = eargs[1]
    bias_ptr = eargs[2]
    res_desc = eargs[3]
    w_ptr = eargs[4]
    nb_ptr = eargs[5]
    mean_ptr = eargs[6]
    rstd_ptr = eargs[7]
    p1_ptr = eargs[8]
    p2_ptr = eargs[9]
    eps = eargs[10]
    HAS_BIAS: gl.constexpr = (FLAGS & FLAG_HAS_BIAS) != 0
    HAS_RES: gl.constexpr = (FLAGS & FLAG_HAS_RES) != 0
    IS_RMS: gl.constexpr = (FLAGS & FLAG_IS_RMS) != 0
    NORM: gl.constexpr = (FLAGS & FLAG_NORM) != 0
    EVEN_N: gl.constexpr = (FLAGS & FLAG_EVEN_N) != 0
    C: gl.constexpr = (FLAGS >> FLAG_C_SHIFT) & FLAG_C_MASK
    SPAN: gl.constexpr = FLAGS >> FLAG_SPAN_SHIFT  # tiles per CTA per row block (cluster schedule)
    P: gl.constexpr = C * SPAN  # tiles per row: partials per row
    BM: gl.constexpr = c_bufs.type.shape[1]
    BN: gl.constexpr = c_bufs.type.shape[2]
    # epi_bar completes once per TMA load through a staging tile: the residual of every tile, and the SPAN - 1
    # parked tiles reloaded at a row block's last tile. Completions before this tile:
    RES_LOADS: gl.constexpr = 1 if HAS_RES else 0
    PER_ROW_BLOCK: gl.constexpr = SPAN * RES_LOADS + ((SPAN - 1) if NORM else 0)
    t = it % SPAN
    loads = (it // SPAN) * PER_ROW_BLOCK + t * RES_LOADS
    rows, cols, rmask, cmask = tile_index(off_m, off_n, M, N, BM, BN, layout)
    h = acc
    if HAS_BIAS:
        h = h + load_vector(bias_ptr, cols)
    if HAS_RES:
        # through y's staging tile by TMA (zero-filled out of bounds), once its previous store has left
        buf = c_bufs.index(buf0)
        tma.store_wait(0)
        mbarrier.expect(epi_bar, res_desc.block_type.nbytes)
        tma_load(res_desc, [off_m, off_n], epi_bar, buf)
        mbarrier.wait(epi_bar, loads & 1)
        loads += 1
        h = h + buf.load(layout).to(gl.float32)
        thread_barrier()  # every thread has read the tile before any stages y into it
    if NORM:
        if C == 1:
            if IS_RMS:
                rstd = gl.rsqrt(gl.sum(h * h, axis=1) / N + eps)
                hh = h * gl.expand_dims(rstd, 1)
            else:
                mean = gl.sum(h, axis=1) / N
                d = h - gl.expand_dims(mean, 1)
                if not EVEN_N:
                    d = gl.where(gl.expand_dims(cmask, 0), d, 0.0)
                rstd = gl.rsqrt(gl.sum(d * d, axis=1) / N + eps)
                hh = d * gl.expand_dims(rstd, 1)
                gl.store(mean_ptr + rows, mean, mask=rmask)
            gl.store(rstd_ptr + rows, rstd, mask=rmask)
            tma.store_wait(0)  # the staging tiles' previous stores
            _store_normed(hh, cols, off_m, off_n, c_bufs, buf0, y_desc, hh_desc, w_ptr, nb_ptr, FLAGS)
        else:
            # publish this tile's partials (slot pn of P per row)
            x, s1, s2 = _tile_partial(h, cmask, N, pn, BN, IS_RMS, EVEN_N)
            gl.store(p1_ptr + rows * P + pn, s1, mask=rmask)
            if not IS_RMS:
                gl.store(p2_ptr + rows * P + pn, s2, mask=rmask)
            park = False
            if SPAN > 1:
                park = t < SPAN - 1
            if park:
                # not the row block's last tile of this CTA: park x in y (rounded to y's dtype; LayerNorm's
                # is centred on the tile mean) until the row statistics are known
                tma.store_wait(0)
                stage_store(x, y_desc, c_bufs.index(buf0), off_m, off_n)
            else:
                _last_tile(x, s1, rows, rmask, cols, off_m, off_n, pn, c_bufs, buf0, epi_bar, loads, y_desc, hh_desc,
                           w_ptr, nb_ptr, mean_ptr, rstd_ptr, p1_ptr, p2_ptr, eps, M, N, FLAGS, layout)
    else:
        tma.store_wait(0)
        stage_store(h, y_desc, c_bufs.index(buf0), off_m, off_n)


@gluon.jit
def mm_norm_kernel(a_desc, b_desc, y_desc, hh_desc, res_desc, bias_ptr, w_ptr, nb_ptr, mean_ptr, rstd_ptr, p1_ptr,
                   p2_ptr, M, N, K, eps,
                   HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, HAS_W: gl.constexpr, HAS_NB: gl.constexpr,
                   IS_RMS: gl.constexpr, SAVE_NORMED: gl.constexpr, NORM: gl.constexpr, EVEN_N: gl.constexpr,
                   NUM_OUT: gl.constexpr,
                   SYNC: gl.constexpr, NUM_STAGES: gl.constexpr, C: gl.constexpr, SPAN: gl.constexpr,
                   NCONS: gl.constexpr,
                   B_KN: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
                   num_warps: gl.constexpr):
    eargs = (y_desc, hh_desc, bias_ptr, res_desc, w_ptr, nb_ptr, mean_ptr, rstd_ptr, p1_ptr, p2_ptr, eps)
    FLAGS: gl.constexpr = (HAS_BIAS * FLAG_HAS_BIAS + HAS_RES * FLAG_HAS_RES + HAS_W * FLAG_HAS_W
                           + HAS_NB * FLAG_HAS_NB + IS_RMS * FLAG_IS_RMS + SAVE_NORMED * FLAG_SAVE_NORMED
                           + NORM * FLAG_NORM + EVEN_N * FLAG_EVEN_N + (SAVE_NORMED and NUM_OUT == 1) * FLAG_SERIAL
                           + (C << FLAG_C_SHIFT) + (SPAN << FLAG_SPAN_SHIFT))
    gemm_ws(a_desc, b_desc, y_desc, M, N, K, no_prologue, _mm_norm_epilogue, eargs, FLAGS, 0, NUM_OUT, SYNC, NUM_STAGES, C, SPAN, NCONS,
            B_KN,
            LOAD_WARPS, LOAD_REGS, MMA_REGS, num_warps)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def unsupported(a, b, bias, residual, weight, norm_bias, out_dtype, save_normed) -> Optional[str]:
    """Why these inputs cannot run on this path (None when they can). Checks only what fake tensors carry
    besides alignment of real storage."""
    why = operand_problem(a, b, out_dtype)
    if why is not None:
        return why
    n = b.shape[1]
    if residual is not None and (residual.dtype != a.dtype or residual.stride(1) != 1):
        return "residual not in the operands' dtype with unit column stride"
    if residual is not None and not isinstance(residual, torch._subclasses.FakeTensor) and not tma_ok(residual):
        return "residual's storage is not 16-byte aligned"
    if bias is not None and bias.stride(0) != 1:
        return "bias not contiguous"
    for name, t in (("weight", weight), ("norm_bias", norm_bias)):
        if t is not None and t.stride(0) != 1:
            return f"{name} not contiguous"
    if cluster_size(n) is None:
        return (f"N={n}: not split evenly over a cluster of at most 8 CTAs of up to {MAX_SPAN} tiles of "
                f"{MAX_TILE_N} columns each")
    return storage_problem(a, b)


MAX_SPAN = 4  # N tiles per CTA per row block: rows up to 8 x 4 x 256 = 8192 wide


def cluster_shape(n: int, bn: int = MAX_TILE_N) -> Optional[tuple[int, int]]:
    """(CTAs per cluster, N tiles per CTA) for rows of n columns in tiles of bn: (1, 1) when a row fits one
    tile; rows of up to 8 tiles take one tile per CTA of a cluster; wider rows the fewest tiles per CTA (at
    most MAX_SPAN) that split them evenly over a cluster of at most 8 (None when none does)."""
    if n <= MAX_TILE_N and bn >= pow2_tile(n):
        return 1, 1
    tiles = -(-n // bn)
    for span in range(-(-tiles // max(L.CLUSTER_SIZES)), MAX_SPAN + 1):
        if tiles % span == 0 and tiles // span in L.CLUSTER_SIZES:
            return tiles // span, span
    return None


def cluster_size(n: int, bn: int = MAX_TILE_N) -> Optional[int]:
    """CTAs per cluster for rows of n columns in tiles of bn (1 when a row fits one tile)."""
    shape = cluster_shape(n, bn)
    return shape[0] if shape is not None else None


def candidates(a: Tensor, b: Tensor, save_normed: bool) -> list:
    """Configurations worth timing for this shape, best guess first (short: each is timed once per shape).
    From the H200 probe (docs/history/design-history.md): ping-pong 128-row tiles up to N = 128; at N = 256 the 128x256
    cooperative tile wins at large K and the 64-row ones at small K; wider rows take 128x256 tiles in clusters
    (128x128 tiles were never the best, 16-CTA clusters ran their GEMM at 1.6x cuBLAS time)."""
    k = a.shape[1]
    n = b.shape[1]
    bk = 64 if k >= 64 else 32

    def fit(kind, bm, bn, stages, warps):
        ncons = 2 if kind == "gl_pp" else 1
        cfg = fit_config(kind, bm, bn, bk, stages, warps, 2 * ncons if save_normed else ncons)
        if save_normed and (cfg is None or cfg.stages < 3):
            cfg = fit_config(kind, bm, bn, bk, stages, warps, ncons)  # hh and y take turns in one staging tile
        return cfg

    if n <= MAX_TILE_N:
        bn = pow2_tile(n)
        if bn <= 128:
            out = [fit("gl_pp", 128, bn, 6, 4), fit("gl_coop", 128, bn, 6, 4)]
        else:
            out = [fit("gl_coop", 128, bn, 4, 8), fit("gl_pp", 64, bn, 4, 4), fit("gl_coop", 64, bn, 4, 4)]
    elif cluster_size(n, MAX_TILE_N) is not None:
        out = [fit("gl_cluster", 128, MAX_TILE_N, 4, 8), fit("gl_cluster", 64, MAX_TILE_N, 4, 4)]
    else:
        out = []
    return [c for c in out if c is not None and c.stages >= 2]


def plain_candidates(n: int, k: int) -> list:
    """The core's configurations for a plain GEMM (``gemm_only``) of n columns on the tile schedule, where no
    row statistics tie a row's tiles together: what the benchmark times against cuBLAS as "the GEMM core".
    The 128x256 cooperative tile ran at cuBLAS speed from K = 1024 up; the 128x128 tiles won at K = 256
    (docs/history/design-history.md, third round)."""
    bk = 64 if k >= 64 else 32
    out = [fit_config("gl_coop", 128, 256, bk, 3, 8, 1)] if n > 128 else []
    out += [fit_config("gl_pp", 128, 128, bk, 5, 4, 2), fit_config("gl_coop", 128, 128, bk, 6, 4, 1)]
    return [c for c in out if c is not None]


class Launch(NamedTuple):
    """What a config and the op's flags fix about the kernel: its compile-time shape and launch options."""

    cluster: int  # CTAs per cluster (1: the tile schedule)
    span: int  # N tiles each CTA of a cluster computes per row block
    ncons: int  # consumer partitions (2: ping-pong)
    norm: bool  # the norm epilogue (False: the plain GEMM base)
    sync: bool  # the epilogue crosses the cluster barrier
    save: bool  # hh is written
    num_out: int  # staging tiles per consumer: 2 when hh has its own, 1 when hh and y take turns in one
    load_warps: int
    num_warps: int  # of each consumer partition
    maxnreg: int


def launch_shape(config, n: int, save_normed: bool, gemm_only: bool) -> Launch:
    cluster, span = (cluster_shape(n, config.block_n) or (None, None)) if config.kind == "gl_cluster" else (1, 1)
    ncons = 2 if config.kind == "gl_pp" else 1
    norm = not gemm_only
    sync = norm and cluster is not None and cluster > 1
    load_warps = 4 if sync else 1  # a cluster barrier needs every thread: no padding warps (gemm_core)
    warps = 4 if ncons == 2 else config.warps
    save = save_normed and norm
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    num_out = 2 if save and L.smem_bytes(bm, bn, bk, config.stages, 2 * ncons) <= L.SMEM_LIMIT else 1
    return Launch(cluster, span, ncons, norm, sync, save, num_out, load_warps, warps,
                  L.maxnreg(L.padded_warps(load_warps) + warps * ncons))


_RUNTIME = ("a_desc", "b_desc", "y_desc", "hh_desc", "res_desc", "bias_ptr", "w_ptr", "nb_ptr", "mean_ptr",
            "rstd_ptr", "p1_ptr", "p2_ptr", "M", "N", "K", "eps")  # the kernel's leading, non-constexpr parameters


def _operands(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd, p1, p2, config, shape: Launch,
              kn: Optional[bool] = None) -> tuple[tuple, tuple]:
    """The call's values of ``_RUNTIME``: the five tensors behind the TMA descriptors, then the rest. ``kn``:
    whether b is row-major (``b_layout``), when the caller knows it already."""
    m, k = a.shape
    n = b.shape[1]
    any_ = y  # stands in for absent optional pointers (never read: the flags say so)
    bias, weight, norm_bias = (padded(t, config.block_n) for t in (bias, weight, norm_bias))
    kn = b_layout(a, b) == "kn" if kn is None else kn
    descs = (a, b if kn else b.t(), y, hh if shape.save else y, residual if residual is not None else y)
    rest = (bias if bias is not None else any_, weight if weight is not None else any_,
            norm_bias if norm_bias is not None else any_, mean if mean.numel() else rstd, rstd, p1, p2,
            m, n, k, float(eps))
    return descs, rest


def runtime_args(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd, p1, p2, config,
                 shape: Launch) -> tuple:
    """The kernel's parameters that change from call to call (``_RUNTIME``): descriptors, pointers, sizes."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    descs, rest = _operands(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd, p1, p2, config, shape)
    kn = b_layout(a, b) == "kn"
    blocks = ([bm, bk], [bk, bn] if kn else [bn, bk], [bm, bn], [bm, bn], [bm, bn])
    return tuple(descriptor(t, blk) for t, blk in zip(descs, blocks)) + rest


def kernel_args(a, b, bias, residual, weight, norm_bias, eps, is_rms, y, hh, mean, rstd, p1, p2, config,
                shape: Launch) -> tuple:
    """Every parameter of ``mm_norm_kernel`` in order but the last (``num_warps``, a launch option)."""
    args = runtime_args(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd, p1, p2, config, shape)
    consts = _constexprs(config, shape, b.shape[1], b_layout(a, b) == "kn", bias=bias is not None,
                         residual=residual is not None, has_w=weight is not None, has_nb=norm_bias is not None,
                         is_rms=bool(is_rms))
    return args + tuple(consts[p] for p in _PARAMS[len(args):-1])


def _constexprs(config, shape: Launch, n: int, b_kn: bool, *, bias: bool, residual: bool, has_w: bool,
                has_nb: bool, is_rms: bool) -> dict:
    """The kernel's compile-time parameters (all but num_warps), for the launcher and the offline compile."""
    return dict(
        HAS_BIAS=bias, HAS_RES=residual, HAS_W=has_w, HAS_NB=has_nb, IS_RMS=is_rms, SAVE_NORMED=shape.save,
        NORM=shape.norm, EVEN_N=n % config.block_n == 0, NUM_OUT=shape.num_out, SYNC=shape.sync,
        NUM_STAGES=config.stages, C=shape.cluster, SPAN=shape.span, NCONS=shape.ncons, B_KN=b_kn,
        LOAD_WARPS=shape.load_warps, LOAD_REGS=LOAD_REGS, MMA_REGS=MMA_REGS,
    )


class ForwardPlan:
    """One launch configuration of ``mm_norm_kernel``, made once per argument signature: the compiled kernel
    (looked up through the JIT, set to launch in clusters), its grid and its compile-time arguments. Calling
    it launches on new buffers of the same shapes, strides, dtypes and alignment with no per-call work but
    the TMA descriptors and the launch (the fused op's host cost: ops/mm_norm.py caches plans per signature).
    Raises ``SpillError`` when the specialization spills (never launched)."""

    def __init__(self, a, b, bias, residual, weight, norm_bias, eps, is_rms, save_normed, y, hh, mean, rstd, config,
                 gemm_only: bool, alloc) -> None:
        m, n = a.shape[0], b.shape[1]
        self.config, self.is_rms = config, bool(is_rms)
        self.shape = shape = launch_shape(config, n, save_normed, gemm_only)
        c = shape.cluster
        if c is None:
            raise ValueError(f"{config.label()}: N={n} needs an unsupported cluster size")
        self.alloc = alloc
        p1, p2 = self._partials(m, rstd)
        args = kernel_args(a, b, bias, residual, weight, norm_bias, eps, is_rms, y, hh, mean, rstd, p1, p2, config,
                           shape)
        self.consts = args[len(_RUNTIME):]
        compiled = L.compiled_kernel(mm_norm_kernel, args, c, num_warps=shape.num_warps, maxnreg=shape.maxnreg)
        # A few epilogue specializations spill on triton 3.6 (test_gluon_compile.py lists which); they are
        # never launched (unless the probe benchmark sets common.ALLOW_SPILLS): the caller falls back to the tl
        # kernels.
        refuse_spills(compiled, config.label(), obeys_allow_spills=True)
        self.compiled = compiled
        self.fast = L.fast_launcher(compiled, 5, shape.num_warps, a.device)
        self.kn = b_layout(a, b) == "kn"  # fixed by the plan's signature: not derived again per call
        row_blocks = -(-m // config.block_m)
        if c == 1:
            self.grid = min(row_blocks * -(-n // config.block_n), num_sms(a.device))
        else:
            self.grid = L.cluster_grid(compiled, c, row_blocks, a.device)

    def _partials(self, m: int, rstd: Tensor) -> tuple[Tensor, Tensor]:
        if not self.shape.sync:
            return rstd, rstd
        cols = self.shape.cluster * self.shape.span
        p1 = self.alloc((m, cols), torch.float32)
        return p1, (self.alloc((m, cols), torch.float32) if not self.is_rms else p1)

    def __call__(self, a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd) -> None:
        p1, p2 = self._partials(a.shape[0], rstd)
        if self.fast is not None:
            descs, rest = _operands(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd, p1, p2,
                                    self.config, self.shape, self.kn)
            self.fast(self.grid, descs, rest + self.consts)
            return
        args = runtime_args(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd, p1, p2, self.config,
                            self.shape)
        L.run(self.compiled, self.grid, args + self.consts, self.shape.num_warps)


def mm_norm_gluon(a, b, bias, residual, weight, norm_bias, eps, is_rms, save_normed, y, hh, mean, rstd, config,
                  gemm_only: bool, alloc) -> ForwardPlan:
    """Write (y, hh, mean, rstd) of ``mm_norm_reference`` with ``config`` (one of ``candidates``) into the
    given buffers; ``alloc(shape, dtype)`` makes the partials scratch of the cluster path. Returns the plan,
    which launches the same again on new buffers."""
    plan = ForwardPlan(a, b, bias, residual, weight, norm_bias, eps, is_rms, save_normed, y, hh, mean, rstd, config,
                       gemm_only, alloc)
    plan(a, b, bias, residual, weight, norm_bias, eps, y, hh, mean, rstd)
    return plan


# ----------------------------------------------------------------------------------------------------------
# Offline compile (CPU tests, CI): every specialization the dispatch can launch, without a GPU
# ----------------------------------------------------------------------------------------------------------

_PARAMS = (
    "a_desc", "b_desc", "y_desc", "hh_desc", "res_desc", "bias_ptr", "w_ptr", "nb_ptr", "mean_ptr", "rstd_ptr",
    "p1_ptr", "p2_ptr", "M", "N", "K", "eps", "HAS_BIAS", "HAS_RES", "HAS_W", "HAS_NB", "IS_RMS",
    "SAVE_NORMED", "NORM", "EVEN_N", "NUM_OUT", "SYNC", "NUM_STAGES", "C", "SPAN", "NCONS", "B_KN", "LOAD_WARPS", "LOAD_REGS",
    "MMA_REGS", "num_warps",
)


def compile_offline(config, n: int, k: int, *, is_rms: bool, affine: bool, bias: bool, residual: bool,
                    save_normed: bool, gemm_only: bool = False, b_kn: bool = False, w_fp32: bool = False,
                    m: int = 1024):
    """Compile the kernel ``mm_norm_gluon`` would launch for this config and flags, for sm_90a, on the CPU
    (``cpu_compile.compile_sm90``; bf16 operands, no GPU needed), with the JIT's specialization of these sizes
    (``cpu_compile.runtime_attrs``). ``w_fp32``: the norm's weight and bias in fp32 (autocast keeps parameters
    fp32). Returns its ``cpu_compile.Compiled``."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    shape = launch_shape(config, n, save_normed, gemm_only)
    values = dict(
        a_desc=descriptor_type([bm, bk]), b_desc=descriptor_type([bk, bn] if b_kn else [bn, bk]),
        y_desc=descriptor_type([bm, bn]), hh_desc=descriptor_type([bm, bn]), res_desc=descriptor_type([bm, bn]),
        bias_ptr="*bf16", w_ptr="*fp32" if w_fp32 else "*bf16", nb_ptr="*fp32" if w_fp32 else "*bf16",
        mean_ptr="*fp32", rstd_ptr="*fp32",
        p1_ptr="*fp32", p2_ptr="*fp32", M="i32", N="i32", K="i32", eps="fp32",
    )
    constexprs = _constexprs(config, shape, n, b_kn, bias=bias, residual=residual, has_w=affine,
                             has_nb=affine and not is_rms, is_rms=is_rms)
    constexprs["num_warps"] = shape.num_warps
    signature = {p: values.get(p, "constexpr") for p in _PARAMS}
    attrs = runtime_attrs(signature, dict(M=m, N=n, K=k))
    return compile_sm90(mm_norm_kernel, signature, constexprs, shape.num_warps, shape.maxnreg, attrs)


OFFLINE_NS = (40, 64, 96, 128, 200, 256, 320, 512, 1000, 1024, 2048, 3000, 4096, 8192)
OFFLINE_KS = (40, 512)
OFFLINE_FLAGS = {
    # the most registers and shared memory: LayerNorm with every input and hh saved
    "ln_full": dict(is_rms=False, affine=True, bias=True, residual=True, w_fp32=True),
    "rms_full": dict(is_rms=True, affine=True, bias=True, residual=True, w_fp32=True),
    "ln_bare": dict(is_rms=False, affine=False, bias=False, residual=False),
}


def offline_variants() -> list[dict]:
    """Every distinct specialization ``candidates`` produces over a grid of N, K and save_normed, with the
    epilogue's heaviest and lightest flag sets, plus the plain-epilogue GEMM base (B row-major): what the
    CPU compile test builds."""
    seen = {}
    for n in OFFLINE_NS:
        for k in OFFLINE_KS:
            a = torch.empty((1024, k), device="meta", dtype=torch.bfloat16)
            b = torch.empty((k, n), device="meta", dtype=torch.bfloat16)
            for save in (False, True):
                for cfg in candidates(a, b, save):
                    c = cluster_shape(n, cfg.block_n) if cfg.kind == "gl_cluster" else (1, 1)
                    seen.setdefault((cfg, c, n % cfg.block_n == 0, save), (cfg, n, save))
    out = []
    for cfg in dict.fromkeys(c for n in (256, 1024) for c in plain_candidates(n, 512)):
        out.append(dict(config=list(cfg), n=1024, flags="ln_bare", save_normed=False, gemm_only=True, b_kn=False))
    for cfg, n, save in seen.values():
        for name, flags in OFFLINE_FLAGS.items():
            out.append(dict(config=list(cfg), n=n, flags=name, save_normed=save and flags["affine"], gemm_only=False,
                            b_kn=False))
        if not save:
            out.append(dict(config=list(cfg), n=n, flags="ln_bare", save_normed=False, gemm_only=True, b_kn=True))
    return out


def compile_variant(v: dict):
    from ..gemm_config import GemmConfig

    return compile_offline(GemmConfig(*v["config"]), v["n"], 512, save_normed=v["save_normed"],
                           gemm_only=v["gemm_only"], b_kn=v["b_kn"], **OFFLINE_FLAGS[v["flags"]])
