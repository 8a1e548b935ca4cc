"""The Triton versions of the GDPA activations (names, codes and torch references: fusenorm_inductor/activations.py).

``ACT`` is ``activations.activation_code(name)``; every function works on fp32 tiles.
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no libdevice dependency.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def act_fwd(x, ACT: tl.constexpr):
    """act(x) for an fp32 tile; ACT is ``activation_code``."""
    if ACT == 0:
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
    elif ACT == 1:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        y = x * tl.sigmoid(x)
    elif ACT == 3:
        y = tl.maximum(x, 0.0)
    else:
        y = x
    return y


@triton.jit
def act_bwd(x, ACT: tl.constexpr):
    """d act / dx for an fp32 tile."""
    if ACT == 0:
        t = _tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))
        d_inner = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
    elif ACT == 1:
        g = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 2:
        s = tl.sigmoid(x)
        g = s * (1.0 + x * (1.0 - s))
    elif ACT == 3:
        g = tl.where(x > 0.0, 1.0, 0.0)
    else:
        g = tl.full(x.shape, 1.0, tl.float32)
    return g
