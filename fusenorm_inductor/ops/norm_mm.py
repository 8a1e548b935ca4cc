"""Pre-norm ("Lazy Pre-Norm"): ``c = norm(a) @ b + bias`` without writing ``norm(a)``.

Used by the pattern ``norm_linear_fwd`` (patterns/pre_norm.py) for ``norm -> linear``. Two ops:

- ``fusenorm::norm_mm(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)`` -> (c, mean, rstd): the
  forward. The norm's affine folds into the GEMM (b' = diag(weight) b, bias' = bias + norm_bias b); the K loop
  that loads A for the GEMM also accumulates each row's statistics, and the epilogue applies them:
      RMSNorm:   c = rstd * (a @ b') + bias'
      LayerNorm: c = rstd * (a @ b' - mean * colsum(b')) + bias'        (a rank-1 correction)
  so ``norm(a)`` is never written (kernels: kernels/triton/norm_mm.py, on sm_90 kernels/hopper/norm_mm.py).
- ``fusenorm::mm_normed(x, a, mean, rstd, weight, norm_bias, is_rms)`` -> ``x @ norm(a)``: the linear's
  weight gradient ``dc^T @ y`` with y rebuilt from a and the saved row statistics, so the backward needs
  a, mean and rstd (which the norm's own backward reads anyway) and never a saved y.

Outputs: c [M, N] in ``out_dtype`` (default a's dtype); mean [M] fp32 (0-size for RMSNorm); rstd [M] fp32.
Reads top-down: reference (the CPU implementation and the tests' oracle) -> custom ops (fake, autograd) ->
the CUDA call path: the launch plan cached per argument signature, else the configuration tuning picks
(tuning/norm_mm.py) and the kernels' launcher. The kernel modules and tuning/norm_mm.py are imported when a
CUDA tensor first reaches the op (tuning/measure.py, whose plan key every call reads, loads without triton).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import memory
from .. import config as settings  # "config" names the GemmConfig here
from .. import graph_calls
from ..tuning import measure
from ._validate import check_eps, check_tensor
from .norm import norm_backward, norm_reference

__all__ = ["norm_mm", "norm_mm_reference", "mm_normed", "mm_normed_reference", "normed"]

_OP = "fusenorm::norm_mm"
_OP_W = "fusenorm::mm_normed"
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check(a, b, bias, weight, norm_bias, eps) -> None:
    check_tensor(_OP, "a", a, ndim=2, dtypes=FLOATS)
    m, k = a.shape
    if k == 0:
        raise ValueError(f"{_OP}: a is {tuple(a.shape)}: the norm needs at least one column")
    check_tensor(_OP, "b", b, ndim=2, device=a.device, dtypes=(a.dtype,))
    if b.shape[0] != k:
        raise ValueError(f"{_OP}: a is {tuple(a.shape)} but b is {tuple(b.shape)}: inner dims differ")
    check_tensor(_OP, "bias", bias, shape=(b.shape[1],), device=a.device, dtypes=(a.dtype,), required=False)
    check_tensor(_OP, "weight", weight, shape=(k,), device=a.device, required=False)
    check_tensor(_OP, "norm_bias", norm_bias, shape=(k,), device=a.device, required=False)
    check_eps(_OP, eps)


def _check_normed(x, a, mean, rstd, weight, norm_bias, is_rms) -> None:
    check_tensor(_OP_W, "a", a, ndim=2, dtypes=FLOATS)
    m, k = a.shape
    check_tensor(_OP_W, "x", x, ndim=2, device=a.device, dtypes=FLOATS)
    if x.shape[1] != m:
        raise ValueError(f"{_OP_W}: x is {tuple(x.shape)} but a is {tuple(a.shape)}: x must be [P, M]")
    if not is_rms:
        check_tensor(_OP_W, "mean", mean, shape=(m,), device=a.device, dtypes=(torch.float32,))
    check_tensor(_OP_W, "rstd", rstd, shape=(m,), device=a.device, dtypes=(torch.float32,))
    check_tensor(_OP_W, "weight", weight, shape=(k,), device=a.device, required=False)
    check_tensor(_OP_W, "norm_bias", norm_bias, shape=(k,), device=a.device, required=False)


# ----------------------------------------------------------------------------------------------------------
# Reference (CPU implementation and the tests' oracle): fp32 norm, fp32 GEMM.
# ----------------------------------------------------------------------------------------------------------


def norm_mm_reference(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(c, mean, rstd) of ``fusenorm::norm_mm`` in plain torch (fp32 math): its CPU implementation and the tests'
    oracle."""
    y, mean, rstd = norm_reference(a, weight, norm_bias, eps, is_rms, torch.float32)
    c = y @ b.float()
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype or a.dtype), mean, rstd


def normed(a: Tensor, mean: Optional[Tensor], rstd: Tensor, weight: Optional[Tensor],
           norm_bias: Optional[Tensor], is_rms: bool) -> Tensor:
    """y = norm(a) * weight + norm_bias in fp32, from the saved row statistics."""
    y = a.float() if is_rms else a.float() - mean.unsqueeze(-1)
    y = y * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if norm_bias is not None:
        y = y + norm_bias.float()
    return y


def mm_normed_reference(x: Tensor, a: Tensor, mean: Optional[Tensor], rstd: Tensor, weight: Optional[Tensor],
                        norm_bias: Optional[Tensor], is_rms: bool) -> Tensor:
    """``fusenorm::mm_normed`` in plain torch: x @ norm(a) rebuilt from the row statistics, in x's dtype."""
    return (x.float() @ normed(a, mean, rstd, weight, norm_bias, is_rms)).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(_OP, mutates_args=())
def norm_mm(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``norm(a) @ b + bias`` with the norm over a's last dim; see the module docstring."""
    _check(a, b, bias, weight, norm_bias, eps)
    return norm_mm_reference(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)


def _cuda(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype=None):
    # Validated once per argument signature: norm_mm_cuda caches its plan by what the checks read.
    return norm_mm_cuda(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype,
                        lambda: _check(a, b, bias, weight, norm_bias, eps))


# Registered with the dispatcher directly, as mm_norm's CUDA kernel (ops/mm_norm.py says why).
_LIB = torch.library.Library("fusenorm", "IMPL")
_LIB.impl("norm_mm", _cuda, "CUDA")
graph_calls.register("norm_mm", _cuda)  # compiled graphs call _cuda directly (graph_calls.py)


@norm_mm.register_fake
def _(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype=None):
    _check(a, b, bias, weight, norm_bias, eps)
    m, n = a.shape[0], b.shape[1]
    return (
        a.new_empty((m, n), dtype=out_dtype or a.dtype),
        a.new_empty((0,) if is_rms else (m,), dtype=torch.float32),
        a.new_empty((m,), dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    a, b, bias, weight, norm_bias, eps, is_rms, out_dtype = inputs
    _, mean, rstd = output
    # a and the statistics, never norm(a): mm_normed rebuilds it for b's gradient.
    ctx.save_for_backward(a, b, weight, norm_bias, mean if not is_rms else None, rstd)
    ctx.is_rms = is_rms
    ctx.has_bias = bias is not None


def _backward(ctx, dc, _dmean, _drstd):
    a, b, weight, norm_bias, mean, rstd = ctx.saved_tensors
    dy = dc.to(b.dtype) @ b.t()
    da, dw, dnb = norm_backward(
        dy, a, weight, mean, rstd, ctx.is_rms, False, norm_bias is not None, a.dtype
    )
    db_ = mm_normed(dc.to(a.dtype).t(), a, mean, rstd, weight, norm_bias, ctx.is_rms).t() \
        if ctx.needs_input_grad[1] else None
    dbias = dc.float().sum(0).to(b.dtype) if ctx.has_bias else None
    dw = dw.to(weight.dtype) if weight is not None else None
    dnb = dnb.to(norm_bias.dtype) if norm_bias is not None else None
    return da, db_, dbias, dw, dnb, None, None, None


norm_mm.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(_OP_W, mutates_args=())
def mm_normed(
    x: Tensor,
    a: Tensor,
    mean: Optional[Tensor],
    rstd: Tensor,
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    is_rms: bool,
) -> Tensor:
    """``x @ (norm(a) * weight + norm_bias)`` in x's dtype, norm(a) rebuilt from a, mean and rstd."""
    _check_normed(x, a, mean, rstd, weight, norm_bias, is_rms)
    return mm_normed_reference(x, a, mean, rstd, weight, norm_bias, is_rms)


@mm_normed.register_kernel("cuda")
def _cuda_normed(x, a, mean, rstd, weight, norm_bias, is_rms):
    _check_normed(x, a, mean, rstd, weight, norm_bias, is_rms)
    # y is rebuilt in a's dtype, the dtype the unfused graph saved it in, as a transient of this backward
    # op (never saved across the step), then cuBLAS. A kernel that normalizes A tiles on their way into
    # the MMA would save that round trip (not written yet).
    from ..kernels.triton.norm_mm import normed_triton

    y = normed_triton(a, mean, rstd, weight, norm_bias, is_rms)
    return (x.to(a.dtype) @ y).to(x.dtype)


graph_calls.register("mm_normed", _cuda_normed)


@mm_normed.register_fake
def _(x, a, mean, rstd, weight, norm_bias, is_rms):
    _check_normed(x, a, mean, rstd, weight, norm_bias, is_rms)
    return x.new_empty((x.shape[0], a.shape[1]))


# ----------------------------------------------------------------------------------------------------------
# CUDA: the launch plan, else tuning's configuration and the kernels' launcher
# ----------------------------------------------------------------------------------------------------------

_PLANS: dict[tuple, Callable] = memory.cache()  # plan_key -> launcher (norm_mm_cuda)


def norm_mm_cuda(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype, check):
    """The CUDA kernel of ``fusenorm::norm_mm`` as compiled graphs call it: the launch plan cached for this
    argument signature (no validation, tuning lookup or JIT specialization per call), else ``check()`` and
    ``norm_mm_tuned``, whose plan is kept when the launcher made one (the Gluon path; not while a CUDA graph is
    captured, where the tuner could not measure)."""
    key = measure.plan_key((a, b, bias, weight, norm_bias), eps, is_rms, out_dtype, settings.gluon)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan(a, b, bias, weight, norm_bias)
    check()
    made: list = []
    out = norm_mm_tuned(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype, plan_out=made)
    if made and not torch.cuda.is_current_stream_capturing():
        _PLANS[key] = made[0]
    return out


def norm_mm_tuned(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype=None, plan_out=None):
    """(c, mean, rstd) of ``norm_mm_reference`` from the kernels' launcher (``norm_mm_triton``) with the
    configuration ``prenorm_config`` picks (as measured at compile time, else the first candidate); inputs
    already checked. A Gluon configuration whose specialization spills (the launcher raises ``SpillError``)
    runs as the tl kernels' first choice instead. ``plan_out``: the launcher's."""
    from ..kernels.triton import norm_mm as kernels
    from ..tuning import norm_mm as tuning

    out_dtype = out_dtype or a.dtype
    m, k = a.shape
    if m == 0 or k == 0:
        # Nothing to run, so nothing to measure: the launcher returns the empty outputs (M == 0) or raises
        # (K == 0) before it reads the configuration it is given.
        config = kernels.pointer_config(m, b.shape[1], k, a.dtype, a.device)
        return kernels.norm_mm_triton(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype, config, plan_out)
    config = tuning.prenorm_config(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)
    if config.kind.startswith("gl_"):
        from ..kernels.hopper.common import SpillError

        try:
            return kernels.norm_mm_triton(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype, config, plan_out)
        except SpillError:
            config = tuning.tl_candidates(a, b, out_dtype)[0]
    return kernels.norm_mm_triton(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype, config, plan_out)
