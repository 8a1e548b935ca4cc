"""The one place that names Gluon's API (triton.experimental.gluon), which moves between triton releases.

Every Hopper kernel module imports Gluon through here. ``GLUON_ERROR`` is None when the API this package
was written against (triton 3.6) is importable, else the reason it is not; then ``available()`` is False and
the ops take their ``tl`` or reference paths (the match report says which ran).
"""

from __future__ import annotations

from typing import Optional

GLUON_ERROR: Optional[str] = None

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Renamed upstream after 3.6 (async_load / async_store). Newer releases keep the 3.6 names only as stubs
    # that raise "... has been removed" at compile time (3.9), so the new names must win where they exist.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # CTA-wide barrier (bar.sync): gl.thread_barrier on 3.6, gl.barrier() (cluster=False) from 3.9 on,
    # where thread_barrier no longer exists.
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    constexpr_function = gluon.constexpr_function
except Exception as e:  # noqa: BLE001 - any failure means: no Gluon path on this triton
    GLUON_ERROR = f"{type(e).__name__}: {e}"
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = tma_load = tma_store = thread_barrier = constexpr_function = None


def available() -> bool:
    """Whether this triton's Gluon has what the Hopper kernels use."""
    return GLUON_ERROR is None


if GLUON_ERROR is None:
    import triton

    @gluon.jit
    def cluster_arrive():
        """Arrive on the hardware cluster barrier (release: this thread's global writes are visible to the
        cluster's threads that then wait). Counts every non-exited thread of every CTA of the cluster."""
        gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned;\nmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
            pack=1,
        )

    @gluon.jit
    def bulk_store_drain():
        """Wait until this thread's TMA stores have completed their writes to global memory (not only read
        their shared memory, which is what ``tma.store_wait`` waits for), so that a later TMA load of the same
        addresses sees them. The caller then synchronizes the CTA: one thread issues the stores."""
        gl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\nmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1,
        )

    # Triton 3.6 keeps shared-memory reads on their side of a warp-level sync; 3.9 merges them across it (every
    # 256-wide regrouped backward then spills 100-900 bytes), so there the fence is a CTA barrier.
    _WARP_FENCE = gl.constexpr(triton.__version__.startswith("3.6."))

    @gluon.jit
    def smem_read_fence():
        """Keep the compiler from merging reads of one shared-memory tile on either side (the values would
        stay live in registers between them), on triton 3.6 without a CTA barrier: a warp-level sync is an
        ordering point for the warp's shared-memory accesses."""
        if _WARP_FENCE:
            gl.inline_asm_elementwise("bar.warp.sync -1;\nmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        else:
            thread_barrier()

    @gluon.jit
    def cluster_wait():
        """Wait for the cluster barrier's current phase (acquire). Each thread alternates arrive / wait."""
        gl.inline_asm_elementwise(
            "barrier.cluster.wait.acquire.aligned;\nmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
            pack=1,
        )
