"""Regrouped norm backward on the Hopper GEMM core: ``dx = norm_backward(dy @ b + extra)``
(``fusenorm::mm_norm_backward``, ops/mm_norm_backward.py).

Semantics are ``mm_norm_backward_reference``'s: ``dn = dy @ b + extra`` accumulated in fp32, the row
statistics the forward saved (rstd, and for LayerNorm from x the mean), ``x_hat`` either the saved hh
(``src_is_normed``) or rebuilt from x, then per row ``g = dn * w``,
``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`` (RMSNorm: without ``mean(g)``), dx rounded once to
its dtype; dw = sum over rows of ``dn * x_hat`` and db = sum of ``dn``, fp32.

The epilogue (``_bwd_epilogue``) takes the dgrad accumulator tile from the core (gemm_core.py; b read as
row-major [K, N], the next linear's weight, or as W.t()). A row of dn fits one tile (N <= 256, the tile
schedule): ``extra`` and then the saved src come in by TMA through the tile's staging buffer (the first of
them issued before the tile's mainloop, ``_bwd_prologue``), the two row
sums are register shuffles, dx leaves by TMA through the same buffer. dn never leaves the SM. dw and db: the
columns of a CTA's tiles never change (one N tile per row, or the CTA's slot of a cluster), so each warp adds
its rows' column sums over all its tiles into an fp32 scratch row of its own (``epilogues.warp_column_sums``:
no cross-warp pass, no CTA barrier); the launcher sums the [programs, warps, BN] scratch in a fixed order (the
same bits run to run). Rows of 2-8 tiles
run on a cluster, one tile per CTA: each publishes its tile's two row sums to a [M, C] scratch, crosses the
cluster barrier and adds the C slots in slot order (the same sums on every CTA of the row).

Launcher: ``unsupported`` says why an input cannot take this path, ``candidates`` lists configurations,
``BackwardPlan`` launches one (made once per argument signature).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..gemm_config import num_sms
from . import launch as L
from ._compat import (cluster_arrive, cluster_wait, gl, gluon, mbarrier, smem_read_fence, thread_barrier,
                      tma, tma_load)
from .common import (LOAD_REGS, MAX_TILE_N, b_layout, descriptor, device_problem, padded, pow2_tile, refuse_spills,
                     tma_ok)
from .cpu_compile import compile_sm90, descriptor_type, runtime_attrs
from .epilogues import CHUNK, consumer_warps, load_vector, stage_store, tile_index, warp_column_sums
from .gemm_core import gemm_ws, schedule

# The epilogue's FLAGS (gemm_core passes its switches as one integer): a bit per switch of mm_norm_bwd_kernel,
# then the cluster size C. gl.constexpr: the kernels read them as globals.
FLAG_HAS_EXTRA = gl.constexpr(1)
FLAG_HAS_W = gl.constexpr(2)
FLAG_HAS_DB = gl.constexpr(4)
FLAG_IS_RMS = gl.constexpr(8)
FLAG_NORMED = gl.constexpr(16)
FLAG_C_SHIFT = gl.constexpr(5)

# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _issue_load(desc, off_m, off_n, buf, epi_bar):
    mbarrier.expect(epi_bar, desc.block_type.nbytes)
    tma_load(desc, [off_m, off_n], epi_bar, buf)


@gluon.jit
def _bwd_prologue(off_m, off_n, c_bufs, buf0: gl.constexpr, epi_bar, eargs, FLAGS: gl.constexpr):
    """Before the tile's mainloop: the epilogue's first [BM, BN] operand (extra, else the saved src) into the
    staging buffer, once the previous tile's dx has left it, so it lands under the MMAs."""
    tma.store_wait(0)
    if (FLAGS & FLAG_HAS_EXTRA) != 0:
        _issue_load(eargs[1], off_m, off_n, c_bufs.index(buf0), epi_bar)
    else:
        _issue_load(eargs[2], off_m, off_n, c_bufs.index(buf0), epi_bar)


@gluon.jit
def _bwd_epilogue(acc, off_m, off_n, pn, c_bufs, buf0: gl.constexpr, epi_bar, it, eargs,
                  FLAGS: gl.constexpr, M, N, layout: gl.constexpr, stats):
    dx_desc = eargs[0]
    extra_desc = eargs[1]
    src_desc = eargs[2]
    w_ptr = eargs[3]
    mean_ptr = eargs[4]
    rstd_ptr = eargs[5]
    dw_ptr = eargs[6]
    db_ptr = eargs[7]
    p1_ptr = eargs[8]
    p2_ptr = eargs[9]
    HAS_EXTRA: gl.constexpr = (FLAGS & FLAG_HAS_EXTRA) != 0
    HAS_W: gl.constexpr = (FLAGS & FLAG_HAS_W) != 0
    HAS_DB: gl.constexpr = (FLAGS & FLAG_HAS_DB) != 0
    IS_RMS: gl.constexpr = (FLAGS & FLAG_IS_RMS) != 0
    NORMED: gl.constexpr = (FLAGS & FLAG_NORMED) != 0  # src is x_hat (the forward's hh), not x
    C: gl.constexpr = FLAGS >> FLAG_C_SHIFT  # CTAs per cluster: the row's tiles (1: the row fits one tile)
    BM: gl.constexpr = c_bufs.type.shape[1]
    BN: gl.constexpr = c_bufs.type.shape[2]
    LOADS: gl.constexpr = 2 if HAS_EXTRA else 1  # epi_bar completions per tile
    loads = it * LOADS
    rows, cols, rmask, cmask = tile_index(off_m, off_n, M, N, BM, BN, layout)
    buf = c_bufs.index(buf0)
    dn = acc
    if HAS_EXTRA:
        # extra came in by _bwd_prologue; src follows it through the same buffer
        mbarrier.wait(epi_bar, loads & 1)
        dn = dn + buf.load(layout).to(gl.float32)
        loads += 1
        thread_barrier()  # every thread has read extra before src lands in the buffer
    # Rows past M: dn is 0 there (TMA zero-fills dy and extra), and rstd is loaded as 0: they add nothing to
    # dw/db and their dx is clipped by the store. Columns past N: dn and w (padded) are 0, so g is 0 there
    # and x_hat's value does not matter.
    rstd = gl.expand_dims(gl.load(rstd_ptr + rows, mask=rmask, other=0.0), 1)
    mean = rstd
    if not NORMED and not IS_RMS:
        mean = gl.expand_dims(gl.load(mean_ptr + rows, mask=rmask, other=0.0), 1)
    if HAS_EXTRA:
        _issue_load(src_desc, off_m, off_n, buf, epi_bar)  # else _bwd_prologue issued it
    # dw / db: column sums per warp, added over all the tiles this consumer computes (a CTA's tiles share
    # their columns: one N tile per row, or the CTA's slot of the cluster) into its own scratch rows:
    # [programs, consumers * W, BN], summed by the launcher
    W: gl.constexpr = consumer_warps(layout)
    NCONS: gl.constexpr = c_bufs.type.shape[0]  # one staging tile per consumer
    CID: gl.constexpr = buf0
    slot = (gl.program_id(0) * NCONS + CID) * (W * BN)
    if NCONS > 1 and CID == 0:
        # a program with one tile leaves the second consumer idle: its rows are zeroed here instead
        _, _, tiles = schedule(M, N, BM, BN, C, 1)
        if it == 0 and tiles < 2:
            if HAS_DB:
                warp_column_sums(gl.zeros_like(dn), db_ptr + slot + W * BN, 0, BM, BN, W)
            if HAS_W:
                warp_column_sums(gl.zeros_like(dn), dw_ptr + slot + W * BN, 0, BM, BN, W)
    if HAS_DB:
        warp_column_sums(dn, db_ptr + slot, it, BM, BN, W)
    mbarrier.wait(epi_bar, loads & 1)
    # x_hat is read from the staging buffer at each of its three uses rather than kept: dn (then g) and x_hat
    # both in registers spilled at 64 x 256 and 128 x 128 tiles (offline compile). smem_read_fence keeps the
    # compiler from merging the reads.
    if HAS_W:
        warp_column_sums(dn * _x_hat(buf, mean, rstd, FLAGS, layout), dw_ptr + slot, it, BM, BN, W)
        dn = dn * load_vector(w_ptr, cols)  # g
        smem_read_fence()
    c1 = gl.sum(dn * _x_hat(buf, mean, rstd, FLAGS, layout), axis=1)
    c2 = c1
    if not IS_RMS:
        c2 = gl.sum(dn, axis=1)
    if C > 1:
        # The row's other tiles are on the cluster's other CTAs: publish this tile's two sums (slot pn of C per
        # row), cross the cluster barrier, read all C back (.cg: past this SM's L1) and add them in slot order.
        gl.store(p1_ptr + rows * C + pn, c1, mask=rmask)
        if not IS_RMS:
            gl.store(p2_ptr + rows * C + pn, c2, mask=rmask)
        cluster_arrive()
        cluster_wait()
        c1 = gl.load(p1_ptr + rows * C, mask=rmask, other=0.0, cache_modifier=".cg")
        for r in gl.static_range(1, C):
            c1 += gl.load(p1_ptr + rows * C + r, mask=rmask, other=0.0, cache_modifier=".cg")
        if not IS_RMS:
            c2 = gl.load(p2_ptr + rows * C, mask=rmask, other=0.0, cache_modifier=".cg")
            for r in gl.static_range(1, C):
                c2 += gl.load(p2_ptr + rows * C + r, mask=rmask, other=0.0, cache_modifier=".cg")
    c1 = gl.expand_dims(c1 / N, 1)
    if not IS_RMS:
        dn = dn - gl.expand_dims(c2 / N, 1)
    smem_read_fence()
    dx = (dn - _x_hat(buf, mean, rstd, FLAGS, layout) * c1) * rstd
    thread_barrier()  # every thread has read src before dx is staged into the buffer
    stage_store(dx, dx_desc, buf, off_m, off_n)


@gluon.jit
def _x_hat(buf, mean, rstd, FLAGS: gl.constexpr, layout: gl.constexpr):
    """The normalized row tile from the staging buffer: hh as saved, or rebuilt from x and the statistics."""
    IS_RMS: gl.constexpr = (FLAGS & FLAG_IS_RMS) != 0
    NORMED: gl.constexpr = (FLAGS & FLAG_NORMED) != 0
    x = buf.load(layout).to(gl.float32)
    if NORMED:
        return x
    elif IS_RMS:
        return x * rstd
    else:
        return (x - mean) * rstd


@gluon.jit
def mm_norm_bwd_kernel(a_desc, b_desc, dx_desc, extra_desc, src_desc, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr,
                       p1_ptr, p2_ptr, M, N, K,
                       HAS_EXTRA: gl.constexpr, HAS_W: gl.constexpr, HAS_DB: gl.constexpr, IS_RMS: gl.constexpr,
                       NORMED: gl.constexpr, NUM_STAGES: gl.constexpr, C: gl.constexpr, NCONS: gl.constexpr,
                       B_KN: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
                       num_warps: gl.constexpr):
    eargs = (dx_desc, extra_desc, src_desc, w_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, p1_ptr, p2_ptr)
    FLAGS: gl.constexpr = (HAS_EXTRA * FLAG_HAS_EXTRA + HAS_W * FLAG_HAS_W + HAS_DB * FLAG_HAS_DB + IS_RMS * FLAG_IS_RMS
                           + NORMED * FLAG_NORMED + (C << FLAG_C_SHIFT))
    gemm_ws(a_desc, b_desc, dx_desc, M, N, K, _bwd_prologue, _bwd_epilogue, eargs, FLAGS, 0, 1, C > 1, NUM_STAGES, C, 1, NCONS, B_KN,
            LOAD_WARPS, LOAD_REGS, MMA_REGS, num_warps)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def unsupported(dy, b, extra, src, weight, mean, rstd, dx_dtype) -> Optional[str]:
    """Why these inputs cannot run on this path (None when they can); checks what fake tensors carry, and
    the alignment of real storage."""
    why = device_problem(dy)
    if why is not None:
        return why
    m, k = dy.shape
    n = b.shape[1]
    if _cluster(n) is None:
        return (f"N={n}: rows over more than {max(L.CLUSTER_SIZES)} tiles of {MAX_TILE_N} columns (one per CTA of "
                f"a cluster) are not on this path yet")
    if k % 8 or n % 8:
        return f"K={k} or N={n} not a multiple of 8 (TMA rows must be 16-byte aligned)"
    if dy.stride() != (k, 1):
        return "dy is not row-major contiguous"
    if b_layout(dy, b) is None:
        return "b is neither W.t() of a row-major W nor row-major"
    if dx_dtype != dy.dtype:
        return f"dx dtype {dx_dtype} differs from the operands'"
    for name, t in (("extra", extra), ("src", src)):
        if t is not None and (t.dtype != dy.dtype or t.stride() != (n, 1)):
            return f"{name} not row-major in the operands' dtype"
    if weight is not None and weight.stride(0) != 1:
        return "weight not contiguous"
    if not isinstance(dy, torch._subclasses.FakeTensor):
        for name, t in (("dy", dy), ("b", b.t() if b_layout(dy, b) == "nk" else b), ("extra", extra), ("src", src)):
            if t is not None and not tma_ok(t):
                return f"{name}'s storage is not 16-byte aligned"
    return None


def candidates(dy: Tensor, b: Tensor) -> list:
    """Configurations worth timing, best guess first. The epilogue holds dn in registers and rereads x_hat
    from shared memory, so a warpgroup takes 64 rows of up to 256 columns or 128 rows of up to 128; the
    8-warp cooperative tiles (two warpgroups on one 128-row tile, the forward core's fastest at large K)
    take 128 x 256 and 128 x 128."""
    k = dy.shape[1]
    n = b.shape[1]
    bk = 64 if k >= 64 else 32
    bn = pow2_tile(n)
    if n > MAX_TILE_N:
        out = [_fit_bwd("gl_cluster", 128, MAX_TILE_N, bk, 4, 8), _fit_bwd("gl_cluster", 64, MAX_TILE_N, bk, 4, 4)]
    elif bn <= 128:
        out = [_fit_bwd("gl_pp", 128, bn, bk, 6, 4), _fit_bwd("gl_coop", 128, bn, bk, 6, 8),
               _fit_bwd("gl_coop", 128, bn, bk, 6, 4), _fit_bwd("gl_pp", 64, bn, bk, 6, 4)]
    else:
        out = [_fit_bwd("gl_coop", 128, bn, bk, 4, 8), _fit_bwd("gl_pp", 64, bn, bk, 4, 4),
               _fit_bwd("gl_coop", 64, bn, bk, 4, 4)]
    return [c for c in out if c is not None and c.stages >= 2]


# Registers per consumer thread: the most two 4-warp consumers and a 4-warp loader partition at LOAD_REGS
# can take (the forward's 232 left the ping-pong backward epilogue spilling).
BWD_MMA_REGS = 240

# Shared memory the epilogue takes besides the core's stages and staging tiles: the column sums' warp-local
# conversions, one epilogues.CHUNK per consumer, two consumers at most (ptxas reports no more than this).
_REDUCE_BYTES = 2 * CHUNK.value


def _fit_bwd(kind: str, bm: int, bn: int, bk: int, stages: int, warps: int):
    """The config with the most stages (down to 2) that fits shared memory with one staging tile per
    consumer and the column sums' scratch; None when none does."""
    from ..gemm_config import GemmConfig

    staging = 2 if kind == "gl_pp" else 1
    for st in range(stages, 1, -1):
        if L.smem_bytes(bm, bn, bk, st, staging) + _REDUCE_BYTES <= L.SMEM_LIMIT:
            return GemmConfig(kind, bm, bn, bk, st, warps)
    return None


def _cluster(n: int, bn: int = MAX_TILE_N):
    """CTAs per cluster for rows of n columns, one tile of bn each (1 when a row fits one tile; None beyond
    the largest cluster)."""
    tiles = -(-n // bn)
    return tiles if tiles in L.CLUSTER_SIZES else None


class Launch(NamedTuple):
    cluster: int  # CTAs per cluster (1: the tile schedule)
    ncons: int  # consumer partitions (2: ping-pong)
    load_warps: int
    num_warps: int  # of each consumer partition
    maxnreg: int


def launch_shape(config, n: int) -> Launch:
    cluster = _cluster(n, config.block_n) if config.kind == "gl_cluster" else 1
    ncons = 2 if config.kind == "gl_pp" else 1
    warps = 4 if ncons == 2 else config.warps
    load_warps = 4 if cluster and cluster > 1 else 1  # a cluster barrier needs every thread (gemm_core)
    return Launch(cluster, ncons, load_warps, warps, L.maxnreg(L.padded_warps(load_warps) + warps * ncons))


_RUNTIME = ("a_desc", "b_desc", "dx_desc", "extra_desc", "src_desc", "w_ptr", "mean_ptr", "rstd_ptr", "dw_ptr",
            "db_ptr", "p1_ptr", "p2_ptr", "M", "N", "K")
_PARAMS = _RUNTIME + ("HAS_EXTRA", "HAS_W", "HAS_DB", "IS_RMS", "NORMED", "NUM_STAGES", "C", "NCONS", "B_KN",
                      "LOAD_WARPS", "LOAD_REGS", "MMA_REGS", "num_warps")


def _constexprs(config, shape: Launch, b_kn: bool, *, extra: bool, has_w: bool, has_db: bool, is_rms: bool,
                normed: bool) -> dict:
    return dict(HAS_EXTRA=extra, HAS_W=has_w, HAS_DB=has_db, IS_RMS=is_rms, NORMED=normed,
                NUM_STAGES=config.stages, C=shape.cluster, NCONS=shape.ncons, B_KN=b_kn, LOAD_WARPS=shape.load_warps,
                LOAD_REGS=LOAD_REGS, MMA_REGS=BWD_MMA_REGS)


def _operands(dy, b, extra, src, weight, mean, rstd, dx, dw_part, db_part, p1, p2, kn: bool, bn: int
              ) -> tuple[tuple, tuple]:
    """The call's values of ``_RUNTIME``: the five tensors behind the TMA descriptors, then the rest."""
    m, k = dy.shape
    n = b.shape[1]
    descs = (dy, b if kn else b.t(), dx, extra if extra is not None else dx, src)
    weight = padded(weight, bn)
    rest = (weight if weight is not None else rstd, mean if mean is not None and mean.numel() else rstd, rstd,
            dw_part, db_part, p1, p2, m, n, k)
    return descs, rest


class BackwardPlan:
    """One launch configuration of ``mm_norm_bwd_kernel``, made once per argument signature (as
    mm_norm.ForwardPlan): the compiled kernel, its grid and compile-time arguments; calling it launches on
    new buffers of the same shapes, strides, dtypes and alignment. Raises ``common.SpillError`` when the
    specialization spills (never launched)."""

    def __init__(self, dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, config, alloc, dx):
        m, n = dy.shape[0], b.shape[1]
        self.config, self.alloc = config, alloc
        self.has_w, self.has_db, self.is_rms = weight is not None, bool(has_bias), bool(is_rms)
        self.shape = shape = launch_shape(config, n)
        c = shape.cluster
        if c is None:
            raise ValueError(f"{config.label()}: N={n} needs an unsupported cluster size")
        self.kn = b_layout(dy, b) == "kn"
        self.row_blocks = -(-m // config.block_m)
        self.grid = self.programs = 1  # the compile only needs the scratch pointers; the real grid follows
        descs, rest = _operands(dy, b, extra, src, weight, mean, rstd, dx, *self._scratch(m), self.kn,
                                config.block_n)
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        self.blocks = ([bm, bk], [bk, bn] if self.kn else [bn, bk], [bm, bn], [bm, bn], [bm, bn])
        args = tuple(descriptor(t, blk) for t, blk in zip(descs, self.blocks)) + rest
        consts = _constexprs(config, shape, self.kn, extra=extra is not None, has_w=self.has_w, has_db=self.has_db,
                             is_rms=self.is_rms, normed=bool(src_is_normed))
        self.consts = tuple(consts[p] for p in _PARAMS[len(_RUNTIME):-1])
        compiled = L.compiled_kernel(mm_norm_bwd_kernel, args + self.consts, c, num_warps=shape.num_warps,
                                     maxnreg=shape.maxnreg)
        refuse_spills(compiled, config.label(), obeys_allow_spills=True)
        self.compiled = compiled
        self.fast = L.fast_launcher(compiled, 5, shape.num_warps, dy.device)
        if c == 1:
            self.grid = min(self.row_blocks, num_sms(dy.device))
        else:
            self.grid = L.cluster_grid(compiled, c, self.row_blocks, dy.device)
        self.programs = self.grid * c  # the grid counts clusters (launch.py)

    def _scratch(self, m: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(dw, db) column sums, one row per warp of each consumer of each program ([programs * consumers *
        warps, BN], every element written by the kernel), and the cluster's per-tile row sums (p1, p2): fresh
        buffers per launch (a stand-in where the kernel reads none)."""
        rows = self.programs * self.shape.ncons * self.shape.num_warps
        dw = self.alloc((rows, self.config.block_n), torch.float32) if self.has_w else None
        db = self.alloc((rows, self.config.block_n), torch.float32) if self.has_db else None
        p1 = p2 = None
        if self.shape.cluster > 1:
            p1 = self.alloc((m, self.shape.cluster), torch.float32)
            p2 = self.alloc((m, self.shape.cluster), torch.float32) if not self.is_rms else p1
        any_ = next((t for t in (dw, db, p1) if t is not None), None)
        if any_ is None:
            any_ = self.alloc((1,), torch.float32)
        return tuple(t if t is not None else any_ for t in (dw, db, p1, p2))

    def __call__(self, dy, b, extra, src, weight, mean, rstd, dx) -> tuple[Tensor, Tensor]:
        """Launch into dx; returns (dw, db) [N] fp32 (0-size when absent)."""
        dw_part, db_part, p1, p2 = self._scratch(dy.shape[0])
        descs, rest = _operands(dy, b, extra, src, weight, mean, rstd, dx, dw_part, db_part, p1, p2, self.kn,
                                self.config.block_n)
        if self.fast is not None:
            self.fast(self.grid, descs, rest + self.consts)
        else:
            args = tuple(descriptor(t, blk) for t, blk in zip(descs, self.blocks)) + rest
            L.run(self.compiled, self.grid, args + self.consts, self.shape.num_warps)
        # over programs and warps in a fixed order: the same bits run to run; program p of a cluster holds
        # the cluster's N tile p % C
        n, c = b.shape[1], self.shape.cluster
        dw = _columns(dw_part, self.programs, c, n) if self.has_w else dy.new_empty((0,), dtype=torch.float32)
        db = _columns(db_part, self.programs, c, n) if self.has_db else dy.new_empty((0,), dtype=torch.float32)
        return dw, db


def _columns(part: Tensor, programs: int, c: int, n: int) -> Tensor:
    """[N] fp32 from the per-warp column sums [programs * warps, BN] of programs in clusters of c (fewest
    tensor ops where c = 1: each costs host time per call)."""
    bn = part.shape[1]
    out = part.sum(0) if c == 1 else part.view(programs // c, c, -1, bn).sum((0, 2)).reshape(-1)
    return out if out.shape[0] == n else out[:n]


# ----------------------------------------------------------------------------------------------------------
# Offline compile (CPU tests, CI)
# ----------------------------------------------------------------------------------------------------------


def compile_offline(config, n: int, k: int, *, is_rms: bool, affine: bool, extra: bool, normed: bool,
                    w_fp32: bool = False, b_kn: bool = True, m: int = 1024):
    """Compile the kernel ``BackwardPlan`` would launch for this config and flags, for sm_90a, on the CPU, with
    the JIT's specialization of these sizes (``cpu_compile.runtime_attrs``). ``w_fp32``: the norm's weight in
    fp32 (autocast keeps parameters fp32), which takes more registers than a bf16 one."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    shape = launch_shape(config, n)
    values = dict(
        a_desc=descriptor_type([bm, bk]), b_desc=descriptor_type([bk, bn] if b_kn else [bn, bk]),
        dx_desc=descriptor_type([bm, bn]), extra_desc=descriptor_type([bm, bn]), src_desc=descriptor_type([bm, bn]),
        w_ptr="*fp32" if w_fp32 else "*bf16", mean_ptr="*fp32", rstd_ptr="*fp32", dw_ptr="*fp32", db_ptr="*fp32", p1_ptr="*fp32",
        p2_ptr="*fp32", M="i32", N="i32", K="i32",
    )
    constexprs = _constexprs(config, shape, b_kn, extra=extra, has_w=affine, has_db=affine and not is_rms,
                             is_rms=is_rms, normed=normed)
    constexprs["num_warps"] = shape.num_warps
    signature = {p: values.get(p, "constexpr") for p in _PARAMS}
    attrs = runtime_attrs(signature, dict(M=m, N=n, K=k))
    return compile_sm90(mm_norm_bwd_kernel, signature, constexprs, shape.num_warps, shape.maxnreg, attrs)


OFFLINE_NS = (40, 64, 128, 200, 256, 320, 1000, 2048)
OFFLINE_FLAGS = {
    # the most registers: LayerNorm from x with extra and an fp32 weight and bias
    "ln_full": dict(is_rms=False, affine=True, extra=True, normed=False, w_fp32=True),
    "ln_normed": dict(is_rms=False, affine=True, extra=False, normed=True),
    "rms_full": dict(is_rms=True, affine=True, extra=True, normed=False, w_fp32=True),
    "ln_bare": dict(is_rms=False, affine=False, extra=False, normed=False),
}


def offline_variants() -> list[dict]:
    """Every distinct configuration ``candidates`` produces over a grid of N, with the epilogue's flag sets;
    N divisible by 16 and not, where a configuration serves both (the JIT specializes on it)."""
    seen = {}
    for n in OFFLINE_NS:
        for k in (40, 512):
            dy = torch.empty((1024, k), device="meta", dtype=torch.bfloat16)
            b = torch.empty((k, n), device="meta", dtype=torch.bfloat16)
            for cfg in candidates(dy, b):
                seen.setdefault((cfg, launch_shape(cfg, n).cluster, n % 16 == 0), n)
    return [dict(op="mm_norm_backward", config=list(cfg), n=n, flags=f, save_normed=False, gemm_only=False,
                 b_kn=True) for (cfg, _, _), n in seen.items() for f in OFFLINE_FLAGS]


def compile_variant(v: dict):
    from ..gemm_config import GemmConfig

    return compile_offline(GemmConfig(*v["config"]), v["n"], 512, **OFFLINE_FLAGS[v["flags"]])
