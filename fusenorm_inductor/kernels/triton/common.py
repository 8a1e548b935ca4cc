"""Jitted helpers and host-side config rules shared by the fused GEMM + norm kernels.

- ``tile_matmul``: the K loop of one [BLOCK_M, BLOCK_N] output tile of ``a @ b`` with masked pointer loads,
  any strides, fp32 accumulation (the GEMM base; a TMA/persistent base is a later speed issue).
- ``chan_combine``: LayerNorm row statistics from per-N-tile (mean, M2, count) partials.
- host side: ``gemm_config`` (block sizes, warps, single- vs multi-tile path) and ``dot_input_precision``
  (ieee vs tf32 for fp32 inputs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..gemm_config import GemmConfig, num_sms  # noqa: F401 - shared with the Gluon kernels (kernels/hopper)



@triton.jit
def tile_matmul(
    a_ptr,
    b_ptr,
    rows,
    cols,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """acc[i, j] = sum_k a[rows[i], k] * b[k, cols[j]] in fp32; rows/cols out of range give 0.

    ``rows`` and ``cols`` are int64 index vectors (int64 so that row * stride cannot overflow int32).
    """
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < M
    mask_n = cols < N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Masked loads give 0 past K, M and N, so padded rows/columns of acc stay exactly 0.
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def tile_coords(N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pid_m, pid_n, rows, cols) of this program on a 1-D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    tiles. The N tiles of one row block are adjacent in launch order, so they share that row block's
    operand in L2; rows/cols are int64 so that index * stride cannot overflow int32."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_m, pid_n, rows, cols


@triton.jit
def chan_combine(tile_mean, tile_m2, tile_count, N):
    """Row mean and M2 = sum((h - mean)^2) from per-tile partials (Chan et al.'s parallel formula, k-way):
        mean = sum_j n_j * mean_j / N;   M2 = sum_j (M2_j + n_j * (mean_j - mean)^2).

    ``tile_mean``/``tile_m2`` are [BLOCK_M, T] (0 for absent tiles), ``tile_count`` is [T] fp32 (0 for absent
    tiles). Every term is a deviation from a mean, never E[x^2] - E[x]^2, so |mean| >> std stays accurate.
    """
    mean = tl.sum(tile_mean * tile_count[None, :], axis=1) / N
    dev = tile_mean - mean[:, None]
    m2 = tl.sum(tile_m2 + tile_count[None, :] * dev * dev, axis=1)
    return mean, m2


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def dot_input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot``'s input_precision: exact fp32 products unless the user allowed TF32 for CUDA matmuls.

    Only fp32 operands look at it; 16-bit operands always use the tensor cores (pass Triton's default).
    The interpreter (CPU tensors) supports only ieee for fp32.
    """
    if dtype != torch.float32:
        return "tf32"
    if device.type == "cuda" and _cuda_matmul_allows_tf32():
        return "tf32"
    return "ieee"


def _cuda_matmul_allows_tf32() -> bool:
    """What cuBLAS would do for an fp32 matmul: ``allow_tf32``, or the newer ``fp32_precision`` setting
    (torch >= 2.9 raises on reading ``allow_tf32`` once that API was used; "none" defers to the global)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        precision = torch.backends.cuda.matmul.fp32_precision
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", "ieee")
        return precision == "tf32"


def gemm_num_warps(block_m: int, block_n: int) -> int:
    """Warps for a [block_m, block_n] fp32 tile: 32 elements per thread, 4 to 8 warps. The epilogues hold
    several tile-sized arrays at once (h, hh, y or dn, hh, t): 64 per thread spilled (ptxas, sm_90)."""
    return max(4, min(8, block_m * block_n // (32 * 32)))


def pow2_at_least(x: int, lo: int = 16) -> int:
    """The smallest power of two >= max(x, lo) (tl.dot and tl.arange need powers of two, >= 16 for dot)."""
    return max(lo, triton.next_power_of_2(max(1, x)))


# Widest row one program of the pointer-load kernels normalizes in its epilogue (a 64 x 256 fp32 tile at 8
# warps); wider rows take their multi-tile path (GEMM tiles write per-tile row statistics, a second kernel
# normalizes). The TMA kernels have their own rules (mm_norm_kernels.forward_candidates).
MAX_SINGLE_BLOCK_N = 256


def single_tile(n: int) -> bool:
    """Whether a row of width n fits one tile (its power-of-two padding is at most MAX_SINGLE_BLOCK_N)."""
    return max(16, 1 << max(0, n - 1).bit_length()) <= MAX_SINGLE_BLOCK_N


MULTI_BLOCK_N = 128  # N tile of the multi-tile path (128 x 128 tiles, the usual Hopper GEMM tile)
FINALIZE_ELEMS = 4096  # elements per program of the elementwise finalize kernels (8 warps: 16 per thread)
FINALIZE_WARPS = 8


SMEM_BUDGET = 220 * 1024  # of the H100/H200's 227 KiB per block, leaving room for reductions


def tma_config(kind: str, bm: int, bn: int, bk: int, stages: int, warps: int, out_bytes: int, **kw) -> GemmConfig:
    """A TMA config whose pipeline fits shared memory next to the epilogue's layout conversion of one
    [bm, bn] output tile (``out_bytes`` per element: 4 for fp32 outputs): fewer stages, then fewer rows,
    when it would not."""

    def smem(bm, stages):
        return stages * (bm + bn) * bk * 2 + bm * bn * out_bytes

    for rows in (bm, bm // 2) if bm > 64 else (bm,):
        for st in range(stages, 1, -1):
            if smem(rows, st) <= SMEM_BUDGET:
                return GemmConfig(kind, rows, bn, bk, st, warps, **kw)
    return GemmConfig(kind, 64, bn, bk, 2, warps, **kw)


def fixed_candidates(a: torch.Tensor, b: torch.Tensor, n: int, force_block_n: Optional[int], **kw):
    """(candidates, BLOCK_K) shared by both ops' candidate lists: the one pointer-kernel config when TMA
    cannot read the operands, the test hook's forced N tile (``kw`` for it), else None: the caller lists its
    TMA configs with that BLOCK_K."""
    m, k = a.shape
    if tma_layout(a, b) is None:
        bm, bn, bk, warps, _ = gemm_config(m, n, k, a.dtype, a.device, force_block_n)
        return [GemmConfig("ptr", bm, bn, bk, 3, warps)], bk
    bk = min(64, pow2_at_least(k))
    if force_block_n is not None:  # whole rows per tile, or the cooperative kernel over force_block_n tiles
        kind = "row" if n <= force_block_n else "coop"
        return [GemmConfig(kind, 128, force_block_n, bk, 3, 4, **kw)], bk
    return None, bk


def cooperative_grid(device: torch.device, n_tiles: int, progs_per_sm: int) -> int:
    """Persistent programs for the row-exchanging kernels: a multiple of n_tiles, so every program keeps
    one N column and a row block's tiles always run in the same wave (no row block straddles two waves,
    where its first tiles would wait a whole tile for the rest)."""
    progs = num_sms(device) * progs_per_sm
    return max(n_tiles, progs // n_tiles * n_tiles)


# The widest TMA box (and wgmma N) is 256: wider rows take the cooperative kernel. A [128, 256] fp32 tile is
# 128 registers per thread at 8 warps; the probe (benchmarks/probe_gemm_base.py) found 128 x 256 x 64 with
# 3 stages at 0.90-0.98x cuBLAS as a plain GEMM on the H200.
TMA_MAX_BLOCK_N = 256

# Test hook: None = TMA wherever eligible; False = never (the pointer kernels); True = also on CPU tensors
# (the interpreter tests run the TMA kernels through it).
_FORCE_TMA: Optional[bool] = None


def spin_allowed(device: torch.device) -> bool:
    """The spin-exchange kernels wait for other programs, so they need a real GPU (the interpreter runs
    programs one after another) and the user's consent (config.spin_exchange)."""
    from ... import config

    return device.type == "cuda" and config.spin_exchange


def tma_layout(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """How TMA can read ``a @ b``: "nk" when b = W.T of a row-major W [N, K] (a linear's weight), "kn" when
    b is row-major [K, N]; None when it cannot (then the pointer kernels run).

    Needs 16-bit operands, A [M, K] row-major, row pitches and bases 16-byte aligned, sm_90+. TMA copies
    boxes of a row-major 2-D tensor; out-of-bounds reads are zero-filled, so M, N and K need not be
    multiples of the block."""
    if _FORCE_TMA is False:
        return None
    if a.device.type != "cuda" and not _FORCE_TMA:
        return None
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device)[0] < 9:
        return None
    k, n = b.shape
    size = a.element_size()
    if not (
        a.dtype in (torch.float16, torch.bfloat16)
        and a.stride() == (k, 1)
        and (k * size) % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
    ):
        return None
    if b.stride() == (1, k):
        return "nk"
    if b.stride() == (n, 1) and (n * size) % 16 == 0:
        return "kn"
    return None


def tma_descriptors(a: torch.Tensor, b: torch.Tensor, layout: str, block_m: int, block_n: int, block_k: int):
    """Host-side TMA descriptors of a and b for ``tma_tile`` with the given layout."""
    if layout == "kn":
        b_desc = tensor_descriptor(b, [block_k, block_n])
    else:
        b_desc = tensor_descriptor(b.t(), [block_n, block_k])
    return tensor_descriptor(a, [block_m, block_k]), b_desc


@triton.jit
def tma_tile(a_desc, b_desc, off_m, off_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, B_KN: tl.constexpr):
    """acc = A[off_m : off_m + BLOCK_M, :] @ B[:, off_n : off_n + BLOCK_N] in fp32, TMA-fed; B is read from
    a [K, N] descriptor (B_KN) or from the [N, K] descriptor of its transpose."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        a = a_desc.load([off_m, ki * BLOCK_K])
        if B_KN:
            acc = tl.dot(a, b_desc.load([ki * BLOCK_K, off_n]), acc)
        else:
            acc = tl.dot(a, b_desc.load([off_n, ki * BLOCK_K]).T, acc)
    return acc


def tma_store_ok(t: torch.Tensor) -> bool:
    """Whether a 2-D output the launcher allocated can be written by TMA stores: row-major, 16-byte row
    pitch and base (the kernels still need a TMA config, which implies sm_90+ or the interpreter hook)."""
    return (
        t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0 and t.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


# Kernel specializations (a key naming kernel, config and flags) whose TMA-store staging tile did not fit
# shared memory: they keep pointer stores from then on.
_NO_TMA_STORE: set = set()


def launch_with_tma_store(key: tuple, out: torch.Tensor, launch, allowed: bool = True) -> None:
    """``launch(True)`` (the output leaves through TMA stores) where ``out`` allows it (``tma_store_ok``),
    ``allowed`` and this specialization's staging tile fits, else ``launch(False)``. Whether it fits next to
    the pipeline depends on the epilogue the compiler builds: it tells us with OutOfResources before anything
    runs, and the key is remembered."""
    if allowed and tma_store_ok(out) and key not in _NO_TMA_STORE:
        try:
            launch(True)
            return
        except OutOfResources:
            _NO_TMA_STORE.add(key)
    launch(False)


def tensor_descriptor(t: torch.Tensor, block_shape: list[int]):
    """A host-side TMA descriptor (no device allocator needed, unlike tl.make_tensor_descriptor)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block_shape)


def gemm_config(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, force_block_n: Optional[int]
):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, single_tile) for the GEMM kernels: a heuristic, no autotune.

    Single tile when the padded row fits one tile (``single_tile``), else N tiles of MULTI_BLOCK_N.
    ``force_block_n`` (a test hook, a power of two >= 16) fixes the N tile: N > force_block_n goes multi-tile.
    """
    if force_block_n is not None:
        block_n, single = force_block_n, n <= force_block_n
    else:
        single = single_tile(n)
        block_n = pow2_at_least(n) if single else MULTI_BLOCK_N
    # 128-row tiles; 64 for 256-wide ones (register budget) or when 128-row tiles would leave SMs idle.
    block_m = 64 if block_n >= 256 else 128
    if block_m == 128 and triton.cdiv(m, 128) * triton.cdiv(n, block_n) < num_sms(device):
        block_m = 64
    block_m = min(block_m, pow2_at_least(m))
    # fp32 operands take twice the shared memory per element: halve BLOCK_K.
    block_k = min(32 if dtype == torch.float32 else 64, pow2_at_least(k))
    return block_m, block_n, block_k, gemm_num_warps(block_m, block_n), single


def finalize_block_m(m: int, block_n: int) -> int:
    """Rows per program of a finalize kernel: about FINALIZE_ELEMS elements, a power of two, <= pow2(M)."""
    return min(max(2, FINALIZE_ELEMS // block_n), pow2_at_least(m, lo=2))


@triton.jit
def copy_kernel(src, dst, numel, BLOCK: tl.constexpr):
    """dst[:numel] = src[:numel]: what the copy-bandwidth probe times (tuning/measure.py), the speed at which
    Inductor's norm kernels, which read and write each element once, run."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
