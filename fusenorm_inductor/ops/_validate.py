"""Input checks shared by the fused ops: clear errors naming the argument, raised before any kernel runs."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    op: str,
    name: str,
    t: Optional[Tensor],
    *,
    shape: Optional[Sequence[int]] = None,
    ndim: Optional[int] = None,
    device: Optional[torch.device] = None,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    required: bool = True,
) -> None:
    """Raise ValueError/TypeError if ``t`` is missing, of the wrong rank/shape/dtype or on another device."""
    if t is None:
        if required:
            raise ValueError(f"{op}: '{name}' is required")
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: '{name}' must be a Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: '{name}' must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: '{name}' must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: '{name}' must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: '{name}' is on {t.device}, expected {device} like the other inputs")


def check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")
