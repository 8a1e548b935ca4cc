"""The elementwise activations of GDPA (generalized dot-product attention: an activation instead of softmax).

Shared by ``fusenorm::gdpa`` and ``fusenorm::flash_norm_attention`` (docs/algorithms.md section 5). Each activation
has a torch reference (fp32 math; the ops' CPU implementation and the tests' oracle) and a Triton version
(kernels/triton/activations.py) selected by a constexpr code, with its derivative for the backward
(dS = act'(S) * dP):

    name        act(x)                                              code
    fast_gelu   0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))   0   (the tanh form; the default)
    gelu        0.5 x (1 + erf(x / sqrt(2)))                        1
    silu        x * sigmoid(x)                                      2
    relu        max(x, 0)                                           3   (derivative 0 at x = 0, as torch)
    raw         x                                                   4   (identity)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ACTIVATIONS = ("fast_gelu", "gelu", "silu", "relu", "raw")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # 0.7978845608...
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation_code(name: str, op: str = "fusenorm") -> int:
    """The constexpr code of an activation name; a clear error naming the valid ones otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS.index(name)


def act_reference(x: Tensor, name: str) -> Tensor:
    """act(x) in x's dtype's math (call it with fp32 for the reference)."""
    if name == "fast_gelu":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x * _INV_SQRT_2))
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "relu":
        return torch.relu(x)
    if name == "raw":
        return x
    raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")


def act_grad_reference(x: Tensor, name: str) -> Tensor:
    """d act / dx at x."""
    if name == "fast_gelu":
        inner = _SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)
        t = torch.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
    if name == "gelu":
        return 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if name == "relu":
        return (x > 0).to(x.dtype)
    if name == "raw":
        return torch.ones_like(x)
    raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
