"""The norms' math in plain torch: the references of the canonical norm ops (ops/norm.py) and of their
backward, over the last dim with fp32 statistics (docs/algorithms.md, "Norms").

Its own module, below ops/ and tuning/: the ops run it as their CPU implementation, and the decisions compile
it as Inductor's unfused side (tuning/baseline.py) without importing the ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["empty_stat", "norm_reference", "norm_backward_reference"]


def empty_stat(x: Tensor) -> Tensor:
    # Custom ops cannot return None: an absent output (RMSNorm's mean, a missing dw/db) is a 0-size tensor.
    return x.new_empty((0,), dtype=torch.float32)


def norm_reference(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-torch norm over the last dim; returns (y, mean, rstd), mean 0-size for RMSNorm."""
    xf = x.float()
    if is_rms:
        mean = empty_stat(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        hh = xf * rstd.unsqueeze(-1)
    else:
        # Two-pass variance (torch.var_mean): accurate when |mean| >> std.
        var, mean = torch.var_mean(xf, dim=-1, unbiased=False)
        rstd = torch.rsqrt(var + eps)
        hh = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = hh
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype), mean, rstd


def norm_backward_reference(
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
    """Gradient of ``norm`` given its input ``src`` (or the normalized ``hh`` when ``src_is_normed``).

    ``mean`` is read only for LayerNorm from ``x`` (None otherwise: RMSNorm, or hh given).

    Returns (dx, dw, db): dw/db in fp32 (0-size when there is no weight/bias); the caller casts them.
    """
    r = rstd.unsqueeze(-1)
    if src_is_normed:
        hh = src.float()
    elif is_rms:
        hh = src.float() * r
    else:
        hh = (src.float() - mean.unsqueeze(-1)) * r
    dyf = dy.float()
    t = dyf * weight.float() if weight is not None else dyf
    c_th = (t * hh).mean(-1, keepdim=True)
    if is_rms:
        dx = r * (t - hh * c_th)
    else:
        dx = r * (t - t.mean(-1, keepdim=True) - hh * c_th)
    rows = tuple(range(dy.dim() - 1))
    dw = (dyf * hh).sum(rows) if weight is not None else empty_stat(dy)
    db = dyf.sum(rows) if has_bias else empty_stat(dy)
    return dx.to(dx_dtype), dw, db
