"""The canonical norm ops: one LayerNorm/RMSNorm op for every way users write a norm.

fusenorm's pre-grad pass rewrites ``F.layer_norm``, ``F.rms_norm``/``torch.rms_norm`` and the hand-written
LLaMA RMSNorm into ``fusenorm::norm``. Being opaque custom ops, they reach the joint graph whole (not
decomposed into ``var_mean``/``rsqrt``/... which look different per device and torch version), so the
joint-graph patterns match one node. Norms that find no GEMM partner are decomposed back into aten ops by
the joint pass (``decomposition()`` below), so Inductor generates its usual code for them.

Math (over the last dim, statistics in fp32; docs/algorithms.md "Norms"):
    LayerNorm: mean = E[x], rstd = 1/sqrt(Var[x] + eps), hh = (x - mean) * rstd, y = hh * w + b
    RMSNorm:   rstd = 1/sqrt(E[x^2] + eps),          hh = x * rstd,          y = hh * w
    backward:  t = dy * w; dx = rstd * (t - E[t] - hh * E[t * hh])   (RMSNorm: no E[t] term)
               dw = sum_rows(dy * hh); db = sum_rows(dy)

``norm_backward`` takes either the norm's input ``x`` (with mean/rstd) or the normalized ``hh`` itself
(``src_is_normed``): fused forward kernels save ``hh`` (or ``y`` when there is no affine) instead of the
pre-norm tensor, which they never write.

The references (norm_math.py, re-exported here) are the ops' CPU implementation and the tests' oracle. On CUDA
the canonical ops run the same torch code (eager use only: in compiled graphs they are either fused or
decomposed).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..norm_math import norm_backward_reference, norm_reference

__all__ = ["norm", "norm_backward", "norm_reference", "norm_backward_reference", "decomposition"]


# ----------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fusenorm::norm", mutates_args=())
def norm(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm (``is_rms=False``) or RMSNorm over the last dim, fp32 statistics, output in ``out_dtype``
    (default ``x.dtype``). Returns (y, mean, rstd); mean is 0-size for RMSNorm."""
    return norm_reference(x, weight, bias, eps, is_rms, out_dtype)


@norm.register_fake
def _(x, weight, bias, eps, is_rms, out_dtype=None):
    stat_shape = x.shape[:-1]
    mean = x.new_empty((0,) if is_rms else stat_shape, dtype=torch.float32)
    return (
        x.new_empty(x.shape, dtype=out_dtype or x.dtype),
        mean,
        x.new_empty(stat_shape, dtype=torch.float32),
    )


def _norm_setup_context(ctx, inputs, output):
    x, weight, bias, eps, is_rms, out_dtype = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.is_rms = is_rms
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_backward(
        dy, x, weight, None if ctx.is_rms else mean, rstd, ctx.is_rms, False, ctx.has_bias, x.dtype
    )
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(ctx.bias_dtype) if ctx.has_bias else None
    return dx, dw, db, None, None, None


norm.register_autograd(_norm_backward, setup_context=_norm_setup_context)


@torch.library.custom_op("fusenorm::norm_backward", mutates_args=())
def norm_backward(
    dy: Tensor,
    src: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    is_rms: bool,
    src_is_normed: bool,
    has_bias: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``fusenorm::norm``; see ``norm_backward_reference``."""
    return norm_backward_reference(
        dy, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype
    )


@norm_backward.register_fake
def _(dy, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype):
    n = dy.shape[-1]
    return (
        dy.new_empty(dy.shape, dtype=dx_dtype),
        dy.new_empty((n,) if weight is not None else (0,), dtype=torch.float32),
        dy.new_empty((n,) if has_bias else (0,), dtype=torch.float32),
    )


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "fusenorm: double backward through a norm is not supported; compile without fusenorm "
        "(or set fusenorm_inductor.config.enabled = False) for higher-order gradients"
    )


norm_backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def decomposition(op):
    """The plain-torch function that the joint pass inlines for a canonical op left unfused."""
    return {
        torch.ops.fusenorm.norm.default: norm_reference,
        torch.ops.fusenorm.norm_backward.default: norm_backward_reference,
    }.get(op)
