"""Launching the Gluon kernels: compiled-kernel lookup, thread-block clusters, register budgets.

Clusters from Gluon on triton 3.6: the kernel is compiled as usual (num_ctas = 1, ordinary layouts) and its
compiled form is told to launch in clusters of C CTAs by setting the cluster size in its packed launch
metadata; triton's launcher then calls cuLaunchKernelEx with clusterDim = (C, 1, 1) and gridDim.x = grid * C
(it sets the non-portable-size attribute for C = 16 itself). Every launch goes through ``launch`` here, which
asks the JIT for the compiled kernel of these exact arguments (``warmup``: the specialization the JIT would
pick) and runs that object, so a kernel can never be launched without its cluster size.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch

# Cluster sizes the hardware launches portably. 16 (non-portable) also launches, but the H200 probe ran the
# GEMM of 16-CTA clusters at 1.6x cuBLAS time (fewer resident clusters): never a win, so not offered.
CLUSTER_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)

SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KiB)
_BARRIER_BYTES = 256  # the mbarriers, rounded up


def padded_warps(warps: int) -> int:
    """Warp-specialized partitions are padded to whole warpgroups."""
    return -(-warps // 4) * 4


def maxnreg(total_warps: int) -> int:
    """The per-thread register cap that lets total_warps warps fit the SM's 64K registers (a multiple of 8,
    at most 240: setmaxnreg later moves registers from the loader to the consumers)."""
    return min(240, (65536 // (32 * total_warps)) // 8 * 8)


def smem_bytes(bm: int, bn: int, bk: int, stages: int, staging_tiles: int, elem: int = 2) -> int:
    return stages * (bm + bn) * bk * elem + staging_tiles * bm * bn * elem + _BARRIER_BYTES


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]


_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


_ACTIVE_CLUSTERS: dict = {}


def max_active_clusters(compiled, cluster: int, device: torch.device) -> int:
    """How many clusters of this kernel can be resident at once (cuOccupancyMaxActiveClusters, asked once
    per kernel and cluster size); the SM count over the cluster size when the driver cannot say."""
    key = (compiled.function, cluster, device)
    if key not in _ACTIVE_CLUSTERS:
        _ACTIVE_CLUSTERS[key] = _query_active_clusters(compiled, cluster, device)
    return _ACTIVE_CLUSTERS[key]


def _query_active_clusters(compiled, cluster: int, device: torch.device) -> int:
    from ..gemm_config import num_sms

    fallback = max(1, num_sms(device) // cluster)
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        attr = _LaunchAttribute()
        attr.id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
        cfg = _LaunchConfig()
        cfg.grid[:] = [cluster * 64, 1, 1]
        cfg.block[:] = [32 * compiled.metadata.num_warps, 1, 1]
        cfg.shared = compiled.metadata.shared
        cfg.attrs = ctypes.pointer(attr)
        cfg.num_attrs = 1
        out = ctypes.c_int(0)
        err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(out), ctypes.c_void_p(compiled.function),
                                               ctypes.byref(cfg))
        return out.value if err == 0 and out.value > 0 else fallback
    except Exception:  # noqa: BLE001 - an occupancy query is advice, never a failure
        return fallback


def _set_cluster(compiled, cluster: int) -> None:
    compiled._init_handles()
    warps, _, shared = compiled.packed_metadata
    compiled.packed_metadata = (warps, cluster, shared)


def compiled_kernel(kernel, args: tuple, cluster: int, **options):
    """The JIT's compiled kernel for these arguments (compiling on first use), set to launch in clusters."""
    compiled = kernel.warmup(*args, grid=(1,), **options)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    if compiled.packed_metadata[1] != cluster:
        _set_cluster(compiled, cluster)
    else:
        compiled._init_handles()
    return compiled


def run(compiled, grid: int, args: tuple, num_warps: int) -> None:
    """Launch ``compiled`` (from ``compiled_kernel``; its last parameter is ``num_warps``) on ``grid``
    programs (clusters, when it was set to launch in them) on the current stream."""
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, num_warps)


def cluster_grid(compiled, cluster: int, work: int, device: torch.device) -> int:
    """Clusters to launch for ``work`` row blocks: all that fit at once (persistent), at most one per block."""
    return max(1, min(work, max_active_clusters(compiled, cluster, device)))


# ---- the per-call fast path (host cost) ----------------------------------------------------------------------

_DESC_CACHE_MAX = 1024  # encoded descriptors kept per launcher


class _Desc(NamedTuple):  # what triton's make_tensordesc_arg reads of a host descriptor
    base: torch.Tensor
    shape: list
    strides: list
    padding: str


class FastLauncher:
    """Launches a compiled kernel whose first ``n_desc`` parameters are TMA descriptors with no per-call
    Python but a dict lookup per descriptor: the encoded CUtensorMap of each parameter is kept by data
    pointer (the caching allocator hands a step the same addresses again), and the launcher's C entry point
    is called directly on the raw CUDA stream. One launcher serves one launch plan, whose callers pass
    tensors of one shape, stride and dtype per parameter (the plan's key fixes them), so the pointer is all
    that changes a map. Made by ``fast_launcher``, which returns None where this triton's launcher is not
    the one this was written against (the caller then launches through ``run``)."""

    def __init__(self, compiled, c_launch, metas: list, num_warps: int, device: torch.device) -> None:
        from triton.backends.nvidia import driver

        self._encode = driver.make_tensordesc_arg
        self.c_launch, self.metas, self.num_warps = c_launch, metas, num_warps
        run = compiled.run
        self.head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                     compiled.packed_metadata, None, None, None)
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.cache: list[dict] = [{} for _ in metas]  # per descriptor parameter: data_ptr -> expanded arguments
        self.signature: list = [None] * len(metas)  # per parameter: (shape, strides, dtype) of its first tensor

    def _encoded(self, i: int, t: torch.Tensor) -> list:
        sig = (t.shape, t.stride(), t.dtype)
        if self.signature[i] is None:
            self.signature[i] = sig
        elif self.signature[i] != sig:  # a caller broke the one-signature contract: never launch a stale map
            raise ValueError(f"FastLauncher: parameter {i} got {sig}, the plan was made for {self.signature[i]}")
        cache = self.cache[i]
        if len(cache) >= _DESC_CACHE_MAX:
            cache.clear()
        e = cache[t.data_ptr()] = self._encode(_Desc(t, list(t.shape), list(t.stride()), "zero"), self.metas[i])
        return e

    def __call__(self, grid: int, descs: tuple, rest: tuple) -> None:
        expanded = []
        for i, t in enumerate(descs):
            e = self.cache[i].get(t.data_ptr())
            expanded += e if e is not None else self._encoded(i, t)
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        self.c_launch(grid, 1, 1, stream, *self.head, *expanded, *rest, self.num_warps)


def fast_launcher(compiled, n_desc: int, num_warps: int, device: torch.device) -> Optional[FastLauncher]:
    """A ``FastLauncher`` for ``compiled`` (from ``compiled_kernel``), or None where this triton's launcher
    differs from triton 3.6's (a Python wrapper over a C ``launch`` that expands host TMA descriptors into
    (CUtensorMap, shape, strides)), or the kernel needs scratch memory."""
    try:
        from triton.backends.nvidia import driver

        run = compiled.run
        wrapper = run.launch
        cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__ or ())))
        c_launch, metas, indices = cells["launcher"], cells["tensordesc_meta"], cells["tensordesc_indices"]
        ok = (isinstance(run, driver.CudaLauncher) and set(indices) == set(range(n_desc)) and metas
              and all(isinstance(m, dict) for m in metas) and not run.global_scratch_size
              and not run.profile_scratch_size and callable(getattr(driver, "make_tensordesc_arg", None)))
        return FastLauncher(compiled, c_launch, list(metas), num_warps, device) if ok else None
    except Exception:  # noqa: BLE001 - another triton: launch through run()
        return None
