"""Building blocks of the GEMM core's epilogues (gemm_core.py): what every fused op's epilogue does with the
fp32 accumulator before and after its own math. Each op's epilogue lives in the op's module."""

from __future__ import annotations

from ._compat import fence_async_shared, gl, gluon, tma_store


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
