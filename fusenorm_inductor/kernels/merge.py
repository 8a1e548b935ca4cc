"""The deferred norm's statistics merged into the two per-row vectors a consumer's epilogue applies, in one
kernel launch: for a GEMM library whose epilogue reads per-row vectors (the quack backend, backends/quack.py),
not the partials themselves as the Gluon kernel does.

From the partial statistics [Q, M, T] (kernels/deferred.py's layout) of rows of n columns:
    s = rstd,         t = mean * rstd      (LayerNorm, Chan's merge of the tiles' (mean, M2))
    s = rstd,         t absent             (RMSNorm)
so that rstd * (acc - mean * colsum) = s * acc - t * colsum. ``row_scales_reference`` is the same in plain
torch (kernels/deferred.merge_stats): the CPU path and the tests' oracle.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .deferred import LN, RMS, merge_stats

__all__ = ["row_scales", "row_scales_reference"]


def row_scales_reference(stats: Tensor, n: int, tile: int, eps: float, norm: int) -> tuple[Tensor, Optional[Tensor]]:
    """(s, t) fp32 [M] (t None for RMSNorm) in plain torch."""
    mean, rstd = merge_stats(stats, n, tile, eps, norm)
    return rstd, (mean * rstd if norm == LN else None)


@triton.jit
def _row_scales_kernel(stats_ptr, s_ptr, t_ptr, m, n, n_tiles, tile, eps, plane,
                       IS_LN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_T)
    rmask = rows < m
    mask = rmask[:, None] & (cols[None, :] < n_tiles)
    offs = rows[:, None] * n_tiles + cols[None, :]
    p0 = tl.load(stats_ptr + offs, mask=mask, other=0.0)
    if IS_LN:
        # Chan's merge: each tile's mean weighed by its column count, the spread of the tile means added to M2
        w = tl.minimum(n - cols * tile, tile).to(tl.float32)
        w = tl.where(cols < n_tiles, w, 0.0)
        m2_t = tl.load(stats_ptr + plane + offs, mask=mask, other=0.0)
        mean = tl.sum(p0 * w[None, :], axis=1) / n
        d = p0 - mean[:, None]
        m2 = tl.sum(m2_t, axis=1) + tl.sum(d * d * w[None, :], axis=1)
        rstd = 1.0 / tl.sqrt(m2 / n + eps)
        tl.store(s_ptr + rows, rstd, mask=rmask)
        tl.store(t_ptr + rows, mean * rstd, mask=rmask)
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(p0, axis=1) / n + eps)
        tl.store(s_ptr + rows, rstd, mask=rmask)


def row_scales(stats: Tensor, n: int, tile: int, eps: float, norm: int, alloc=None,
               compiled: Optional[list] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(s, t) of ``row_scales_reference`` from contiguous fp32 statistics on the GPU, one launch. ``alloc(shape,
    dtype, device)`` makes the outputs (torch.empty by default); ``compiled``: a one-element list holding the
    compiled kernel for this signature (launched directly, without the JIT's per-call argument binding), or
    an empty list that this call fills."""
    if stats.device.type != "cuda":
        return row_scales_reference(stats, n, tile, eps, norm)
    if norm not in (RMS, LN):
        raise ValueError(f"row_scales: norm must be 1 (RMSNorm) or 2 (LayerNorm), got {norm!r}")
    alloc = alloc or (lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))
    stats = stats.contiguous()
    m, n_tiles = stats.shape[1], stats.shape[2]
    s = alloc((m,), torch.float32, stats.device)
    t = alloc((m,), torch.float32, stats.device) if norm == LN else None
    block_t = triton.next_power_of_2(max(n_tiles, 1))
    block_m = max(16, min(256, 4096 // block_t))
    grid = triton.cdiv(m, block_m)
    args = (stats, s, t if t is not None else s, m, n, n_tiles, tile, float(eps), m * n_tiles)
    consts = dict(IS_LN=norm == LN, BLOCK_M=block_m, BLOCK_T=block_t)
    if compiled:
        k = compiled[0]
        stream = torch._C._cuda_getCurrentRawStream(stats.device.index if stats.device.index is not None
                                                    else torch.cuda.current_device())
        k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *consts.values())
        return s, t
    _row_scales_kernel[(grid,)](*args, **consts, num_warps=4)
    if compiled is not None:
        k = _row_scales_kernel.warmup(*args, **consts, num_warps=4, grid=(grid,))
        k = k.result() if hasattr(k, "result") else k
        k._init_handles()
        compiled.append(k)
    return s, t
