"""The GEMM mainloop of CTA pairs, for tritons whose Gluon has the multi-CTA API (3.9 here; not 3.6).

Why a second mainloop: at K = N = 1024 the deferred GEMMs on ``gemm_core`` ran 13-26% over cuBLAS, whose
kernel for those shapes runs CTA pairs that load the shared operand once (docs/history/). Here the pair
is one program (``num_ctas=2``): ``c [2 * BM, BN] = A [2 * BM, :] @ B [BN, :]^T``, A sharded over the two
CTAs (each loads its BM rows), B [BN, BK] loaded once by CTA 0 and multicast into both CTAs' shared memory.

- ``ready[s]`` (one barrier per CTA) expects that CTA's A bytes and the whole B;
- ``empty_a[s]`` (per CTA): its consumer released its A slot (its loader overwrites only that);
- ``empty_b[s]``: one barrier for the pair, in CTA 0 (a broadcast CGA layout): both consumers arrive on it and
  only CTA 0's loader waits on it (sm_90a has no multicast arrive, so the release is gathered there).

Consumers, as in ``gemm_core`` (B as an nn.Linear weight, [N, K]): ``NCONS = 1``, one partition of
``num_warps`` warps owns a pair tile at a time ("cooperative"), or ``NCONS = 2``, two 4-warp partitions take
alternate tiles and an order barrier pair serializes their mainloops, so one's epilogue runs under the
other's MMAs ("ping-pong"). An accumulator [2 * BM, BN] is sharded like A, so every row lives in one CTA and
an epilogue's row sums need no exchange. Tiles are walked persistently, row block major, as ``gemm_core``
does. The epilogues are ``gemm_core``'s (the same ``PROLOGUE`` / ``EPILOGUE`` interface, with ``BM`` the pair
tile's 2 * BM rows and the layouts carrying the CTA split); one staging tile per consumer and CTA; no
``STATS`` (row sums of A).
"""

from __future__ import annotations

from typing import Optional

from ._compat import available as gluon_available, constexpr_function, gl, gluon, mbarrier, tma, tma_load
from ._compat import warpgroup_mma, warpgroup_mma_wait


def unavailable() -> Optional[str]:
    """Why this triton cannot compile the pair kernels (None when it can)."""
    if not gluon_available():
        return "no Gluon"
    if not hasattr(mbarrier, "allocate_mbarrier"):
        return "this triton's Gluon has no multi-CTA API (CTA pairs need triton >= 3.9)"
    return None


# Layouts of the pair: A, c (and the accumulator) split along M over the two CTAs, B whole in each.
SPLIT_M = [[1, 0]]
BROADCAST = [[0, 0]]


@constexpr_function
def pair_acc_layout(BN, num_warps):
    """The accumulator's layout: wgmma's (warps stacked along M, the instruction as wide as the tile), the
    pair tile sharded over the two CTAs along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16],
                                     cga_layout=SPLIT_M)


@gluon.jit
def _tiles(M, N, BM2: gl.constexpr, BN: gl.constexpr):
    return gl.cdiv(M, BM2) * gl.cdiv(N, BN)


@gluon.jit
def _coords(t, N, BN: gl.constexpr):
    """(row block, N tile) of pair tile t: row block major."""
    n_tiles = gl.cdiv(N, BN)
    pm = t // n_tiles
    return pm, t - pm * n_tiles


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty_a, empty_b, M, N, K):
    BM2: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    S: gl.constexpr = a_bufs.type.shape[0]
    k_tiles = gl.cdiv(K, BK)
    c = 0
    for t in range(gl.program_id(0), _tiles(M, N, BM2, BN), gl.num_programs(0)):
        pm, pn = _coords(t, N, BN)
        for kk in range(k_tiles):
            s = c % S
            phase = ((c // S) & 1) ^ 1  # a fresh barrier has completed the phase before phase 0
            mbarrier.wait(empty_a.index(s), phase)
            mbarrier.wait(empty_b.index(s), phase)  # CTA 0 only: both consumers released B's slot
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.nbytes_per_cta + b_desc.nbytes_per_cta)
            tma_load(a_desc, [pm * BM2, kk * BK], bar, a_bufs.index(s))
            tma_load(b_desc, [pn * BN, kk * BK], bar, b_bufs.index(s), multicast=True)
            c += 1


@gluon.jit
def pair_mainloop(a_bufs, b_bufs, ready, empty_a, empty_b, c, K, layout: gl.constexpr):
    """One pair tile's accumulator over K from the stages the loader fills, each stage released as soon as its
    wgmma retired; returns (acc, the stage counter after it)."""
    BM2: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    S: gl.constexpr = a_bufs.type.shape[0]
    # a fresh accumulator per tile (the first wgmma ignores it): a loop-carried one would stay live through
    # the epilogue
    acc = gl.zeros([BM2, BN], gl.float32, layout)
    for kk in range(gl.cdiv(K, BK)):
        s = c % S
        mbarrier.wait(ready.index(s), (c // S) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        prev = (c + S - 1) % S  # the previous step's wgmma retired: its stage is free in this CTA
        mbarrier.arrive(empty_a.index(prev), pred=kk > 0)
        mbarrier.arrive(empty_b.index(prev), pred=kk > 0)
        c += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    last = (c + S - 1) % S
    mbarrier.arrive(empty_a.index(last))
    mbarrier.arrive(empty_b.index(last))
    return acc, c


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty_a, empty_b, order, c_bufs, epi_bar, M, N, K, PROLOGUE: gl.constexpr,
              EPILOGUE: gl.constexpr, eargs, FLAGS: gl.constexpr, CID: gl.constexpr, NCONS: gl.constexpr,
              WARPS: gl.constexpr):
    BM2: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = pair_acc_layout(BN, WARPS)
    rl: gl.constexpr = gl.SliceLayout(1, layout)
    none = (gl.zeros([BM2], gl.float32, layout=rl), gl.zeros([BM2], gl.float32, layout=rl),
            gl.zeros([BM2], gl.float32, layout=rl))  # no STATS: gemm_core's row sums of A, never read
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    k_tiles = gl.cdiv(K, BK)
    j = 0
    for t in range(pid + CID * nprog, _tiles(M, N, BM2, BN), NCONS * nprog):
        pm, pn = _coords(t, N, BN)
        # before the MMA turn (ping-pong): the epilogue's operand has the other consumer's mainloop to land too
        PROLOGUE(pm * BM2, pn * BN, c_bufs, CID, epi_bar.index(CID), eargs, FLAGS)
        if NCONS > 1:
            # take the MMA turn: consumer 0 first, then strictly alternating
            mbarrier.wait(order.index(CID), (j + 1 - CID) & 1)
        # the loader fills the program's tiles in order, k_tiles stages each
        acc, _ = pair_mainloop(a_bufs, b_bufs, ready, empty_a, empty_b, ((t - pid) // nprog) * k_tiles, K, layout)
        if NCONS > 1:
            mbarrier.arrive(order.index(1 - CID))
        EPILOGUE(acc, pm * BM2, pn * BN, pn, c_bufs, CID, epi_bar.index(CID), j, eargs, FLAGS, M, N, layout, none)
        j += 1
    tma.store_wait(0)


@gluon.jit
def pair_buffers(a_desc, b_desc, c_desc, STAGES: gl.constexpr, NUM_OUT: gl.constexpr):
    """The pair kernel's shared memory: STAGES of A and B, NUM_OUT staging tiles of c, the stages' barriers
    (``ready`` and ``empty_a`` per CTA, ``empty_b`` for the pair in CTA 0) and an epilogue barrier per
    staging tile."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [NUM_OUT] + c_desc.block_type.shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout([[0]]))
    epi_bar = mbarrier.allocate_mbarrier(batch=NUM_OUT)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty_a.index(i), count=1)
        mbarrier.init(empty_b.index(i), count=1)
    for i in gl.static_range(NUM_OUT):
        mbarrier.init(epi_bar.index(i), count=1)
    return a_bufs, b_bufs, c_bufs, ready, empty_a, empty_b, epi_bar


@gluon.jit
def pair_ws(a_desc, b_desc, out_desc, M, N, K, PROLOGUE: gl.constexpr, EPILOGUE: gl.constexpr, eargs,
            FLAGS: gl.constexpr, NUM_STAGES: gl.constexpr, NCONS: gl.constexpr, LOAD_REGS: gl.constexpr,
            MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Allocate the ring and the staging tiles and run the partitions (module docstring). ``out_desc``: the
    staging tiles' shape, dtype and layout ([2 * BM, BN], split over the pair)."""
    a_bufs, b_bufs, c_bufs, ready, empty_a, empty_b, epi_bar = pair_buffers(a_desc, b_desc, out_desc, NUM_STAGES,
                                                                            NCONS)
    order = mbarrier.allocate_mbarrier(batch=2)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    # Partition arguments written out in each call, as gemm_core does (constexprs must stay compile-time).
    if NCONS == 1:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty_a, empty_b, order, c_bufs, epi_bar, M, N, K, PROLOGUE,
                         EPILOGUE, eargs, FLAGS, 0, 1, num_warps)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty_a, empty_b, M, N, K)),
        ], [1], [LOAD_REGS])
    else:
        gl.static_assert(num_warps == 4, "ping-pong consumers are one warpgroup each")
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty_a, empty_b, order, c_bufs, epi_bar, M, N, K, PROLOGUE,
                         EPILOGUE, eargs, FLAGS, 0, 2, 4)),
            (_consumer, (a_bufs, b_bufs, ready, empty_a, empty_b, order, c_bufs, epi_bar, M, N, K, PROLOGUE,
                         EPILOGUE, eargs, FLAGS, 1, 2, 4)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty_a, empty_b, M, N, K)),
        ], [4, 1], [MMA_REGS, LOAD_REGS])
