"""Which kernel path a fused op takes for a shape (shared by the launchers and the match report; no triton
import here, so the report works on machines without triton)."""

from __future__ import annotations

import torch

# Widest row one program of the pointer-load kernels normalizes in its epilogue (a 64 x 256 fp32 tile at 8
# warps); wider rows take their multi-tile path (GEMM tiles write per-tile row statistics, a second kernel
# normalizes). The TMA kernels have their own rules (mm_norm_kernels.forward_candidates).
MAX_SINGLE_BLOCK_N = 256


def single_tile(n: int) -> bool:
    """Whether a row of width n fits one tile (its power-of-two padding is at most MAX_SINGLE_BLOCK_N)."""
    return max(16, 1 << max(0, n - 1).bit_length()) <= MAX_SINGLE_BLOCK_N


def _describe(t: torch.Tensor, op: str) -> str:
    if t.device.type != "cuda":
        return f"fusenorm::{op} ({t.device.type}: plain-torch reference)"
    return f"fusenorm::{op} (cuda: Triton)"


def describe_mm_norm(a: torch.Tensor, n: int, is_rms: bool) -> str:
    """The report's kernel column; the patterns append the tuned configuration and the measured times."""
    return _describe(a, "mm_norm")


def describe_mm_norm_backward(dy: torch.Tensor, n: int, is_rms: bool) -> str:
    return _describe(dy, "mm_norm_backward")
