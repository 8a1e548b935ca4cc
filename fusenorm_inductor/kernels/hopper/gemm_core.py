"""The one GEMM mainloop of the sm_90 kernels: persistent, warp-specialized, TMA-fed, async wgmma.

``acc[BM, BN] = A[off_m:, :] @ B[:, off_n:]`` (fp32), A [M, K] row-major, B given either as its transpose
[N, K] (an nn.Linear weight, ``B_KN=False``) or row-major [K, N] (``B_KN=True``). Out-of-bounds TMA reads
are zero-filled, so M, N and K need not be multiples of the tile.

Partitions (``gl.warp_specialize``):
- loader (1 warp; 4 in cluster schedules that synchronize, see below): walks the same schedule as the
  consumers and keeps a ring of ``NUM_STAGES`` (A, B) stages full, one mbarrier pair per stage (``ready``:
  the TMA bytes landed, ``empty``: the consumer's wgmma that read it retired);
- consumers: ``NCONS = 1`` ("cooperative": one partition of ``num_warps`` warps, 1 or 2 warpgroups, owns a
  tile at a time) or ``NCONS = 2`` ("ping-pong": two 4-warp partitions take alternate tiles; an order
  barrier pair serializes their mainloops, so one's epilogue runs under the other's MMAs).

Before a tile's mainloop each consumer calls ``PROLOGUE(off_m, off_n, c_bufs, buf0, epi_bar, eargs, FLAGS)``
(``no_prologue`` when the epilogue needs none): an epilogue that reads a [BM, BN] operand issues its TMA load
there, so the bytes land under the tile's MMAs instead of after them. Each consumer hands its finished fp32
accumulator, in the wgmma register layout, to ``EPILOGUE``:
``EPILOGUE(acc, off_m, off_n, pn, c_bufs, buf0, epi_bar, it, eargs, FLAGS, M, N, layout, stats)`` (``pn``: the N
tile index, ``it``: the consumer's tile count, ``stats``: the tile's row sums of A, see ``STATS``), a ``gluon.jit``
function
passed as a constexpr with its runtime arguments in the tuple ``eargs`` and its compile-time switches in the
integer ``FLAGS`` (a bit mask: constexprs inside a tuple do not stay constexpr across ``warp_specialize``; each
op's module names its bits ``FLAG_*``). ``c_bufs`` holds ``NUM_OUT`` shared-memory staging tiles per consumer
(from index ``buf0``) for TMA stores, and TMA loads of [BM, BN] operands of the epilogue
(a residual) through them, with the consumer's own mbarrier ``epi_bar`` (the epilogue derives each wait's
phase from ``it`` and its own fixed count of loads per tile): a tile's worth of pointers in the wgmma layout costs more registers than the accumulator. The fused ops (post-norm forward, plain GEMM, ...)
are epilogues of this core, not mainloops of their own.

Row sums of A (``STATS``, for pre-norm: a norm over A's rows applied in the epilogue, docs/algorithms.md): with
``STATS`` = 1 (RMSNorm) the consumer adds each row's sum of squares of every A stage it multiplies, read from the
stage in shared memory while the stage's wgmma runs; with 2 (LayerNorm) the row sums of a - p and (a - p)^2,
shifted by p = the row's mean over the first K tile (one-pass sums of a and a^2 cancel at |mean| >> std), 3
the same where K is not a multiple of BK (the zero-filled columns past K masked). ``stats`` = (p, s1, s2) in
the accumulator's row layout. A stage is released by one thread's arrive, so with ``STATS`` the consumer's
threads meet at a barrier first: every one has read the stage. ``STATS`` = 0 reads nothing (``stats`` is
zeros the compiler drops).

Schedules (``C``, ``SPAN``): ``C = SPAN = 1`` walks the [M/BM, N/BN] tiles persistently, row block major
(consecutive programs share an A row block in L2). ``C = 1, SPAN > 1`` (the row-block schedule) gives each
program whole row blocks, their ``SPAN`` N tiles one after the other: with ``STATS`` the consumer (one,
cooperative) sums A's rows at the first tile of a row block only and keeps the sums for the others.
``C > 1`` is the cluster schedule for rows wider than a
tile: the kernel is launched in clusters of C CTAs (``launch.py``); cluster ``pid // C`` walks row blocks,
CTA ``rank = pid % C`` computes the ``SPAN`` consecutive N tiles ``rank * SPAN + t`` (t = 0 .. SPAN-1) of each,
one after the other, so a row block's C * SPAN tiles run at the same time on the cluster's SMs and an
epilogue can exchange row statistics with ``cluster_arrive`` / ``cluster_wait`` (``SYNC``) at its last one
(``it % SPAN == SPAN - 1``). The hardware cluster barrier counts every thread, so with ``SYNC`` the loader
arrives once per row block too (and has 4 warps: a 1-warp partition is padded to a warpgroup whose idle
warps would never arrive).
"""

from __future__ import annotations

from ._compat import (
    thread_barrier,
    cluster_arrive,
    cluster_wait,
    constexpr_function,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@constexpr_function
def mma_layout(BM, BN, num_warps):
    """The wgmma accumulator layout: warps stacked along M (16 rows each), the widest instruction N that
    divides BN. One row of the tile lives in a quad of one warp, so row sums are shuffles."""
    m_reps = (BM + 15) // 16
    n_reps = (num_warps + m_reps - 1) // m_reps
    widest = max(BN // n_reps, 8)
    n = 256
    while n > widest or BN % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@constexpr_function
def _tile_n(b_block, B_KN):
    """BN from B's TMA box: [BK, BN] when B is row-major [K, N], else [BN, BK]."""
    return b_block[1] if B_KN else b_block[0]


@gluon.jit
def schedule(M, N, BM: gl.constexpr, BN: gl.constexpr, C: gl.constexpr, SPAN: gl.constexpr):
    """(first work item, stride, tiles) of this program: items are tiles (C = 1) or row blocks (C > 1), and
    the program computes ``tiles`` tiles (SPAN per row block)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if C == 1 and SPAN == 1:
        first = pid
        step = nprog
        items = gl.cdiv(M, BM) * gl.cdiv(N, BN)
    else:
        first = pid // C
        step = nprog // C
        items = gl.cdiv(M, BM)
    return first, step, (gl.maximum(items - first + step - 1, 0) // step) * SPAN


@gluon.jit
def coords(first, step, i, N, BN: gl.constexpr, C: gl.constexpr, SPAN: gl.constexpr):
    """(row block, N tile) of the program's i-th tile."""
    if C == 1 and SPAN == 1:
        item = first + i * step
        n_tiles = gl.cdiv(N, BN)
        pm = item // n_tiles
        return pm, item - pm * n_tiles
    else:
        return first + (i // SPAN) * step, (gl.program_id(0) % C) * SPAN + i % SPAN


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, C: gl.constexpr, SPAN: gl.constexpr,
            SYNC: gl.constexpr, B_KN: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = _tile_n(b_desc.block_type.shape, B_KN)
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    first, step, tiles = schedule(M, N, BM, BN, C, SPAN)
    k_tiles = gl.cdiv(K, BK)
    c = 0
    j = 0
    for i in range(tiles):
        pm, pn = coords(first, step, i, N, BN, C, SPAN)
        for kk in range(k_tiles):
            s = c % NUM_STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0: the first lap passes
            mbarrier.wait(empty.index(s), ((c // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [pm * BM, kk * BK], bar, a_bufs.index(s))
            if B_KN:
                tma_load(b_desc, [kk * BK, pn * BN], bar, b_bufs.index(s))
            else:
                tma_load(b_desc, [pn * BN, kk * BK], bar, b_bufs.index(s))
            c += 1
        if SYNC:
            # one arrival per row block, as the consumers' epilogue makes; PTX wants arrive / wait alternating
            if i % SPAN == SPAN - 1:
                if j > 0:
                    cluster_wait()
                cluster_arrive()
                j += 1
    if SYNC:
        if j > 0:
            cluster_wait()


@gluon.jit
def no_prologue(off_m, off_n, c_bufs, buf0: gl.constexpr, epi_bar, eargs, FLAGS: gl.constexpr):
    pass


@constexpr_function
def stats_layout(BK, num_warps):
    """An A stage [BM, BK] as the row sums read it: 8 consecutive K elements (16 bytes) per thread, a row's
    BK / 8 threads in one warp (no cross-warp reduction)."""
    tpw_k = min(32, BK // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


@gluon.jit
def _thread_sums(t, BM: gl.constexpr, BK: gl.constexpr):
    """t [BM, BK] (layout ``stats_layout``) summed over each thread's 8 consecutive elements only: [BM, BK / 8]
    partials, one per thread and row, added up across threads once per tile (no shuffles per K step)."""
    return gl.sum(gl.reshape(t, [BM, BK // 8, 8]), axis=2)


@gluon.jit
def _add_row_sums(x, kk, K, shift, p1, p2, BM: gl.constexpr, BK: gl.constexpr, STATS: gl.constexpr,
                  sl: gl.constexpr):
    """Add one A stage x [BM, BK] (fp32, layout sl) to the per-thread partial row sums p1, p2 (module
    docstring, ``STATS``)."""
    if STATS == 1:
        p2 += _thread_sums(x * x, BM, BK)
    else:
        if kk == 0:
            shift = gl.sum(x, axis=1) / gl.minimum(K, BK).to(gl.float32)
        d = x - gl.expand_dims(shift, 1)
        if STATS == 3:
            k_ok = kk * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, sl)) < K
            d = gl.where(gl.expand_dims(k_ok, 0), d, 0.0)
        p1 += _thread_sums(d, BM, BK)
        p2 += _thread_sums(d * d, BM, BK)
    return shift, p1, p2


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, c0, k_tiles, acc, K, fresh, B_KN: gl.constexpr, STATS: gl.constexpr,
              WARPS: gl.constexpr):
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    sl: gl.constexpr = stats_layout(BK, WARPS)
    shift = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, sl))
    zero = gl.zeros([BM, BK], gl.float32, layout=sl)
    p1 = _thread_sums(zero, BM, BK)
    p2 = _thread_sums(zero, BM, BK)
    for kk in range(k_tiles):
        c = c0 + kk
        s = c % NUM_STAGES
        mbarrier.wait(ready.index(s), (c // NUM_STAGES) & 1)
        if B_KN:
            b = b_bufs.index(s)
        else:
            b = b_bufs.index(s).permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=kk > 0, is_async=True)
        if STATS != 0:
            if fresh:  # the row block's first tile (always, but in the row-block schedule)
                # the CUDA cores read the stage the tensor cores are reading
                x = a_bufs.index(s).load(sl).to(gl.float32)
                shift, p1, p2 = _add_row_sums(x, kk, K, shift, p1, p2, BM, BK, STATS, sl)
        # at most one wgmma in flight: the previous step's stage is free again
        acc = warpgroup_mma_wait(1, deps=(acc,))
        if STATS != 0:
            if fresh:
                thread_barrier()  # every thread's read of that stage is done: one thread's arrive releases it
        mbarrier.arrive(empty.index((c + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
    return acc, (shift, gl.sum(p1, axis=1), gl.sum(p2, axis=1))


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, order, c_bufs, epi_bar, M, N, K, PROLOGUE: gl.constexpr,
              EPILOGUE: gl.constexpr, eargs,
              FLAGS: gl.constexpr, C: gl.constexpr, SPAN: gl.constexpr, CID: gl.constexpr, NCONS: gl.constexpr, NUM_OUT: gl.constexpr, B_KN: gl.constexpr,
              STATS: gl.constexpr, WARPS: gl.constexpr):
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = c_bufs.type.shape[2]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = mma_layout(BM, BN, WARPS)
    first, step, tiles = schedule(M, N, BM, BN, C, SPAN)
    k_tiles = gl.cdiv(K, BK)
    rl: gl.constexpr = gl.SliceLayout(1, layout)
    # the row sums of A (STATS), kept across a row block's tiles in the row-block schedule
    stats = (gl.zeros([BM], gl.float32, layout=rl), gl.zeros([BM], gl.float32, layout=rl),
             gl.zeros([BM], gl.float32, layout=rl))
    KEEP: gl.constexpr = STATS != 0 and C == 1 and SPAN > 1
    gl.static_assert(not KEEP or NCONS == 1, "row sums kept across tiles need one consumer")
    j = 0
    for i in range(CID, tiles, NCONS):
        pm, pn = coords(first, step, i, N, BN, C, SPAN)
        c0 = i * k_tiles
        # before the MMA turn (ping-pong): the epilogue's operand has the other consumer's mainloop to land too
        PROLOGUE(pm * BM, pn * BN, c_bufs, CID * NUM_OUT, epi_bar.index(CID), eargs, FLAGS)
        # a fresh accumulator per tile: a loop-carried one would stay live through the epilogue, doubling
        # its registers there (the first wgmma ignores it: use_acc=False)
        acc = gl.zeros([BM, BN], gl.float32, layout=layout)
        if NCONS > 1:
            # take the MMA turn: consumer 0 first, then strictly alternating
            mbarrier.wait(order.index(CID), (j + 1 - CID) & 1)
        fresh = True
        if KEEP:
            fresh = i % SPAN == 0
        acc, sums = _mainloop(a_bufs, b_bufs, ready, empty, c0, k_tiles, acc, K, fresh, B_KN, STATS, WARPS)
        if NCONS > 1:
            mbarrier.arrive(order.index(1 - CID))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if STATS != 0:
            thread_barrier()
        mbarrier.arrive(empty.index((c0 + k_tiles - 1) % NUM_STAGES))
        if fresh:
            stats = (gl.convert_layout(sums[0], rl), gl.convert_layout(sums[1], rl), gl.convert_layout(sums[2], rl))
        EPILOGUE(acc, pm * BM, pn * BN, pn, c_bufs, CID * NUM_OUT, epi_bar.index(CID), j, eargs, FLAGS, M, N, layout,
                 stats)
        j += 1
    tma.store_wait(0)


@gluon.jit
def gemm_ws(a_desc, b_desc, out_desc, M, N, K, PROLOGUE: gl.constexpr, EPILOGUE: gl.constexpr, eargs,
            FLAGS: gl.constexpr, STATS: gl.constexpr,
            NUM_OUT: gl.constexpr,
            SYNC: gl.constexpr, NUM_STAGES: gl.constexpr, C: gl.constexpr, SPAN: gl.constexpr,
            NCONS: gl.constexpr, B_KN: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
            num_warps: gl.constexpr):
    """Allocate the ring and staging tiles and run the partitions (module docstring). ``out_desc`` gives the
    staging tiles' shape, dtype and layout: [BM, BN] of the epilogue's TMA-stored outputs."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [NCONS * NUM_OUT] + out_desc.block_type.shape,
                                       out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
        mbarrier.init(epi_bar.index(i), count=1)
    # Partition arguments are written out in each call: a tuple held in a variable turns its constexprs
    # into runtime values on the way to a worker partition (triton 3.6), and the loader's C, SYNC and B_KN
    # must stay compile-time (they pick the schedule and B's box).
    if NCONS == 1:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, order, c_bufs, epi_bar, M, N, K, PROLOGUE, EPILOGUE, eargs, FLAGS, C, SPAN, 0, 1, NUM_OUT,
                         B_KN, STATS, num_warps)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, C, SPAN, SYNC, B_KN)),
        ], [LOAD_WARPS], [LOAD_REGS])
    else:
        gl.static_assert(num_warps == 4, "ping-pong consumers are one warpgroup each")
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, order, c_bufs, epi_bar, M, N, K, PROLOGUE, EPILOGUE, eargs, FLAGS, C, SPAN, 0, 2, NUM_OUT,
                         B_KN, STATS, 4)),
            (_consumer, (a_bufs, b_bufs, ready, empty, order, c_bufs, epi_bar, M, N, K, PROLOGUE, EPILOGUE, eargs, FLAGS, C, SPAN, 1, 2, NUM_OUT,
                         B_KN, STATS, 4)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, C, SPAN, SYNC, B_KN)),
        ], [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
