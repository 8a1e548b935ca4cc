"""Building blocks of the GEMM core's epilogues (gemm_core.py): what every fused op's epilogue does with the
fp32 accumulator before and after its own math. Each op's epilogue lives in the op's module."""

from __future__ import annotations

from ._compat import constexpr_function, fence_async_shared, gl, gluon, tma_store


@gluon.jit
def tile_index(off_m, off_n, M, N, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """Row and column indices of the tile in the accumulator's layout, and their in-bounds masks."""
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    return rows, cols, rows < M, cols < N


@gluon.jit
def load_vector(ptr, cols):
    """A per-column parameter (GEMM bias, norm weight or bias) as an fp32 row to broadcast over the tile. The
    vector covers whole tiles (the launcher pads it): no column mask, whose predicates over the BN / 4 columns
    each thread holds would cost registers."""
    return gl.expand_dims(gl.load(ptr + cols).to(gl.float32), 0)


@gluon.jit
def stage_store(x, desc, buf, off_m, off_n):
    """Round x to the descriptor's dtype into the staging tile and TMA-store it (rows and columns beyond the
    tensor are clipped by TMA). The caller has waited (``tma.store_wait``) for the tile's previous store.
    Plain st.global from the wgmma layout is much slower (it vectorizes to 32 bits)."""
    buf.store(x.to(desc.dtype))
    fence_async_shared()
    tma_store(desc, [off_m, off_n], buf)


# ----------------------------------------------------------------------------------------------------------
# Column sums kept per warp
# ----------------------------------------------------------------------------------------------------------
# A column sum over a wgmma tile with gl.sum(axis=0) is an all-reduce: three butterfly shuffle levels over
# every column a thread holds, then a CTA barrier and a cross-warp pass through shared memory, and its result
# is replicated over the eight lanes that share a column. A weight gradient only needs the sum in the end, so
# warp_column_sums reduces each warp's rows and stops there: the two rows a thread holds per 16 are added in
# registers, a warp-local layout conversion (shared memory, no CTA barrier) moves the warp's eight row
# groups from lanes into registers, where they are added, and each lane is left owning distinct columns. The
# partial sums are added into a per-warp row of a scratch buffer that only this thread reads and writes,
# across all the tiles of the same columns the consumer computes; the launcher adds the rows in a fixed order.


CHUNK = gl.constexpr(4096)


@constexpr_function
def consumer_warps(layout):
    """Warps of the consumer that owns an accumulator in the wgmma layout (``gemm_core.mma_layout``)."""
    return layout.warps_per_cta[0]


@constexpr_function
def column_chunk_layout(layout, width):
    """The accumulator's wgmma layout narrowed to ``width`` columns (its warps and CTA split kept): how an
    epilogue reads a chunk of the staging tile back in the rows' own threads."""
    return gl.NVMMADistributedLayout(version=layout.version, warps_per_cta=layout.warps_per_cta,
                                     instr_shape=[16, width, 16], cga_layout=layout.cga_layout)


@constexpr_function
def _lanes_on_columns(BN, W):
    """The [W, 8, BN] layout in which each lane owns distinct columns: warps on dim 0; lanes 0-1 on column
    bits 1-2 (as in the wgmma layout), lanes 2-4 on column bits 3 and up while BN has them (else on dim 1,
    left to a shuffle); registers on column bit 0, the rest of dim 1 and the higher column bits."""
    col_bits = BN.bit_length() - 1
    lane = [[0, 0, 2], [0, 0, 4]]
    reg = [[0, 0, 1]]
    used = 3
    for i in range(3):
        if used < col_bits:
            lane.append([0, 0, 1 << used])
            reg.append([0, 1 << i, 0])
            used += 1
        else:
            lane.append([0, 1 << i, 0])
    while used < col_bits:
        reg.append([0, 0, 1 << used])
        used += 1
    warp = [[1 << i, 0, 0] for i in range(W.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[W, 8, BN])


@gluon.jit
def _add_columns(t, ptr, ROW: gl.constexpr, it, BM: gl.constexpr, BN: gl.constexpr, W: gl.constexpr,
                 S: gl.constexpr):
    """Column sums of t [BM, BN] in S chunks of columns, one after the other: each chunk's conversion takes
    less shared memory, and only one chunk's partial sums are live at a time (registers). Each lane's sums
    go to ptr[w * ROW + column]: stored on the consumer's first tile (it = 0), else added."""
    if S == 1:
        R: gl.constexpr = BM // (16 * W)
        # rows are rep * 16W + warp * 16 + half * 8 + lane // 4: the rep and half dims live in registers
        t3 = gl.sum(gl.sum(gl.reshape(t, [R, W, 2, 8, BN]), axis=2), axis=0)
        s = gl.sum(gl.convert_layout(t3, _lanes_on_columns(BN, W)), axis=1)
        sl: gl.constexpr = s.type.layout
        w = gl.arange(0, W, layout=gl.SliceLayout(1, sl))
        c = gl.arange(0, BN, layout=gl.SliceLayout(0, sl))
        p = ptr + gl.expand_dims(w, 1) * ROW + gl.expand_dims(c, 0)
        # a masked load rather than a branch on the first tile: a branch kept every chunk's sums live (spills)
        prev = gl.load(p, mask=gl.full(s.shape, it, gl.int32, sl) > 0, other=0.0)
        gl.store(p, prev + s)
    else:
        # the highest column bit is a register bit of the wgmma layout: split it off without data movement
        lo, hi = gl.split(gl.permute(gl.reshape(t, [BM, 2, BN // 2]), (0, 2, 1)))
        _add_columns(lo, ptr, ROW, it, BM, BN // 2, W, S // 2)
        _add_columns(hi, ptr + BN // 2, ROW, it, BM, BN // 2, W, S // 2)


@gluon.jit
def warp_column_sums(t, ptr, it, BM: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
    """Add the column sums of ``t`` [BM, BN] (wgmma layout of a W-warp consumer), one per warp of its rows,
    into ``ptr[w * BN + column]`` (W rows of BN fp32 owned by this consumer); on the consumer's first tile
    (``it`` = 0) store them instead."""
    gl.static_assert(BM % (16 * W) == 0, "whole 16-row slabs per warp")
    # chunks of at most CHUNK bytes of fp32 through the conversion's shared memory
    S: gl.constexpr = (W * 8 * BN * 4 + CHUNK - 1) // CHUNK
    _add_columns(t, ptr, BN, it, BM, BN, W, S)
