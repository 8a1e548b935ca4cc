"""Regrouped norm backward: ``dx = norm_backward(dy @ b + extra)`` in one GEMM with the norm's backward in
its epilogue (docs/algorithms.md section 4, "fusion regrouping").

For ``n = norm(x); out = linear(n)``, the data gradient of the linear, ``dn = d_out @ W``, is a GEMM whose
output feeds the norm's backward. Fusing the norm backward into that GEMM's epilogue keeps ``dn`` on chip;
dw and db (the norm's affine gradients) come out of the same kernel. ``extra`` is any other gradient that
reaches the norm's output (a residual branch, other consumers) and is added to ``dy @ b`` first.

Used by the pattern ``dgrad_norm_bwd`` (patterns/dgrad_norm_backward.py).
Reads top-down: custom op ``fusenorm::mm_norm_backward`` (fake) -> reference; the Triton kernels and
launcher live in ``mm_norm_backward_kernels.py``.

Outputs (dx, dw, db): dx [M, N] in ``dx_dtype``; dw, db [N] fp32 (0-size without weight / bias).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validate import check_tensor
from .norm import norm_backward_reference

__all__ = ["mm_norm_backward", "mm_norm_backward_reference"]

_OP = "fusenorm::mm_norm_backward"


def _check(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed) -> None:
    check_tensor(_OP, "dy", dy, ndim=2)
    m, k = dy.shape
    check_tensor(_OP, "b", b, ndim=2, device=dy.device, dtypes=(dy.dtype,))
    if b.shape[0] != k:
        raise ValueError(f"{_OP}: dy is {tuple(dy.shape)} but b is {tuple(b.shape)}: inner dims differ")
    n = b.shape[1]
    check_tensor(_OP, "extra", extra, shape=(m, n), device=dy.device, required=False)
    check_tensor(_OP, "src", src, shape=(m, n), device=dy.device)
    check_tensor(_OP, "weight", weight, shape=(n,), device=dy.device, required=False)
    check_tensor(_OP, "rstd", rstd, shape=(m,), device=dy.device, dtypes=(torch.float32,))
    if not is_rms and not src_is_normed:  # LayerNorm from x needs the mean; hh does not
        check_tensor(_OP, "mean", mean, shape=(m,), device=dy.device, dtypes=(torch.float32,))


def mm_norm_backward_reference(
    dy: Tensor,
    b: Tensor,
    extra: Optional[Tensor],
    src: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    is_rms: bool,
    src_is_normed: bool,
    has_bias: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    dn = dy.float() @ b.float()
    if extra is not None:
        dn = dn + extra.float()
    return norm_backward_reference(
        dn, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype
    )


@torch.library.custom_op(_OP, mutates_args=())
def mm_norm_backward(
    dy: Tensor,
    b: Tensor,
    extra: Optional[Tensor],
    src: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    is_rms: bool,
    src_is_normed: bool,
    has_bias: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """``norm_backward(dy @ b + extra)``; ``src`` is the norm's input (with mean/rstd) or, when
    ``src_is_normed``, the normalized hh."""
    _check(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed)
    return mm_norm_backward_reference(
        dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype
    )


def _cuda(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype):
    from ..kernels.triton.mm_norm_backward import mm_norm_backward_cuda

    # Validated once per argument signature: the launcher caches its plan by what the checks read.
    return mm_norm_backward_cuda(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype,
                                 lambda: _check(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed))


# Registered with the dispatcher directly, as mm_norm's CUDA kernel (ops/mm_norm.py says why).
_LIB = torch.library.Library("fusenorm", "IMPL")
_LIB.impl("mm_norm_backward", _cuda, "CUDA")


@mm_norm_backward.register_fake
def _(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype):
    _check(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed)
    m, n = dy.shape[0], b.shape[1]
    return (
        dy.new_empty((m, n), dtype=dx_dtype),
        dy.new_empty((n,) if weight is not None else (0,), dtype=torch.float32),
        dy.new_empty((n,) if has_bias else (0,), dtype=torch.float32),
    )


def _no_double_backward(ctx, *grads):
    raise RuntimeError(f"{_OP}: double backward is not supported")


mm_norm_backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)
