"""Jitted helpers and host-side config rules shared by the fused GEMM + norm kernels.

- ``tile_matmul``: the K loop of one [BLOCK_M, BLOCK_N] output tile of ``a @ b`` with masked pointer loads,
  any strides, fp32 accumulation (the GEMM base; a TMA/persistent base is a later speed issue).
- ``chan_combine``: LayerNorm row statistics from per-N-tile (mean, M2, count) partials.
- host side: ``gemm_config`` (block sizes, warps, single- vs multi-tile path) and ``dot_input_precision``
  (ieee vs tf32 for fp32 inputs).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .kernel_choice import single_tile


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


MULTI_BLOCK_N = 128  # N tile of the multi-tile path (128 x 128 tiles, the usual Hopper GEMM tile)
FINALIZE_ELEMS = 4096  # elements per program of the elementwise finalize kernels (8 warps: 16 per thread)
FINALIZE_WARPS = 8


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few persistent programs, so the persistent loops are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


# (BLOCK_M, BLOCK_K, num_stages, num_warps) of the TMA single-tile kernels: the best 128 x 256 x 64 config
# of benchmarks/probe_gemm_base.py on the H200 (0.90-0.98x cuBLAS as a plain GEMM).
TMA_SINGLE_CONFIG = (128, 64, 3, 8)

# Test hook: None = TMA wherever eligible; False = never (the pointer kernels); True = also on CPU tensors
# (the interpreter tests run the TMA kernels through it).
_FORCE_TMA: Optional[bool] = None


def tma_eligible(a: torch.Tensor, b: torch.Tensor, block_n: int) -> bool:
    """A [M, K] row-major and b = W.T with W [N, K] row-major, 16-bit, rows 16-byte aligned, on sm_90+.

    TMA copies boxes of a row-major 2-D tensor whose row pitch and base are 16-byte aligned; out-of-bounds
    reads are zero-filled, so M, N and K need not be multiples of the block."""
    if _FORCE_TMA is False or block_n > 256:
        return False
    if a.device.type != "cuda" and not _FORCE_TMA:
        return False
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    k = a.shape[1]
    return (
        a.dtype in (torch.float16, torch.bfloat16)
        and a.stride() == (k, 1)
        and b.stride() == (1, k)
        and (k * a.element_size()) % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
    )


def tensor_descriptor(t: torch.Tensor, block_shape: list[int]):
    """A host-side TMA descriptor (no device allocator needed, unlike tl.make_tensor_descriptor)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block_shape)


def gemm_config(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, force_block_n: Optional[int]
):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, single_tile) for the GEMM kernels: a heuristic, no autotune.

    Single tile when the padded row fits one tile (kernel_choice.single_tile), else N tiles of MULTI_BLOCK_N.
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
