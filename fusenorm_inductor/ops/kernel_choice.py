"""What kernel a fused op runs for a shape, in words, for the match report (no triton import here)."""

from __future__ import annotations

import torch


def _device_kernel(t: torch.Tensor, op: str) -> str:
    if t.device.type != "cuda":
        return f"fusenorm::{op} ({t.device.type}: plain-torch reference)"
    return f"fusenorm::{op} (cuda: Triton)"


def describe_mm_norm(a: torch.Tensor, n: int, is_rms: bool) -> str:
    return _device_kernel(a, "mm_norm")


def describe_mm_norm_backward(dy: torch.Tensor, n: int, is_rms: bool) -> str:
    return _device_kernel(dy, "mm_norm_backward")
