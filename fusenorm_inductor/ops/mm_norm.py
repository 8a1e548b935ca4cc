"""Post-norm forward: ``y = norm(a @ b + bias + residual)`` in one GEMM with the norm in its epilogue.

Used by the pattern ``linear_norm_fwd`` (patterns/post_norm.py) for ``linear -> [+ residual] -> norm``.
Reads top-down: reference (the CPU implementation and the tests' oracle) -> custom op ``fusenorm::mm_norm``
(fake, autograd) -> the CUDA call path: the launch plan cached per argument signature, else the configuration
tuning picks (tuning/mm_norm.py) and the kernels' launcher (kernels/triton/mm_norm.py). The kernel modules
and tuning/mm_norm.py are imported when a CUDA tensor first reaches the op (tuning/measure.py, whose plan
key every call reads, imports no kernel).

Outputs (y, hh, mean, rstd):
- y    [M, N] in ``out_dtype``: the norm's output;
- hh   [M, N] in the pre-norm dtype, the normalized row before the affine, written only when
       ``save_normed`` (training with an affine norm: the backward needs hh, and y cannot give it back
       accurately when the weight is near zero); otherwise 0-size. Without affine, hh == y and the backward
       uses y. The pre-norm tensor ``a @ b + ...`` is never written, so it is never saved for the backward;
- mean [M] fp32 (0-size for RMSNorm), rstd [M] fp32.
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

__all__ = ["mm_norm", "mm_norm_reference"]

_OP = "fusenorm::mm_norm"


def _prenorm_dtype(a: Tensor, residual: Optional[Tensor]) -> torch.dtype:
    # The dtype the unfused graph gives `a @ b + bias + residual`, i.e. the dtype hh is kept in.
    return torch.promote_types(a.dtype, residual.dtype) if residual is not None else a.dtype


def _check(a, b, bias, residual, weight, norm_bias, eps) -> None:
    check_tensor(_OP, "a", a, ndim=2)
    m, k = a.shape
    check_tensor(_OP, "b", b, ndim=2, device=a.device, dtypes=(a.dtype,))
    if b.shape[0] != k:
        raise ValueError(f"{_OP}: a is {tuple(a.shape)} but b is {tuple(b.shape)}: inner dims differ")
    n = b.shape[1]
    check_tensor(_OP, "bias", bias, shape=(n,), device=a.device, dtypes=(a.dtype,), required=False)
    check_tensor(_OP, "residual", residual, shape=(m, n), device=a.device, required=False)
    check_tensor(_OP, "weight", weight, shape=(n,), device=a.device, required=False)
    check_tensor(_OP, "norm_bias", norm_bias, shape=(n,), device=a.device, required=False)
    check_eps(_OP, eps)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# Reference (CPU implementation and the tests' oracle): fp32 GEMM, then the canonical norm.
# ----------------------------------------------------------------------------------------------------------


def mm_norm_reference(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype] = None,
    save_normed: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, hh, mean, rstd) of ``fusenorm::mm_norm`` in plain torch (fp32 math): its CPU implementation and the
    tests' oracle."""
    h = a.float() @ b.float()
    if bias is not None:
        h = h + bias.float()
    if residual is not None:
        h = h + residual.float()
    y, mean, rstd = norm_reference(h, weight, norm_bias, eps, is_rms, out_dtype or a.dtype)
    if save_normed:
        hh, _, _ = norm_reference(h, None, None, eps, is_rms, _prenorm_dtype(a, residual))
    else:
        hh = _empty(a)
    return y, hh, mean, rstd


# ----------------------------------------------------------------------------------------------------------
# Custom op
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(_OP, mutates_args=())
def mm_norm(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: Optional[torch.dtype] = None,
    save_normed: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``norm(a @ b + bias + residual)`` over the last dim; see the module docstring for the outputs."""
    _check(a, b, bias, residual, weight, norm_bias, eps)
    return mm_norm_reference(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed)


def _cuda(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype=None, save_normed=False):
    # Validated once per argument signature: mm_norm_cuda caches its plan by what the checks read.
    return mm_norm_cuda(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed,
                        lambda: _check(a, b, bias, residual, weight, norm_bias, eps))


# The CUDA kernel is registered with the dispatcher directly, not through ``register_kernel``, whose wrapper
# (a Dynamo-disable context and an output aliasing check on every call) costs more host time than the launch:
# the outputs here are always fresh tensors, and Dynamo never traces into the op (it has a fake kernel).
_LIB = torch.library.Library("fusenorm", "IMPL")
_LIB.impl("mm_norm", _cuda, "CUDA")
graph_calls.register("mm_norm", _cuda)  # compiled graphs call _cuda directly (graph_calls.py)


@mm_norm.register_fake
def _(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype=None, save_normed=False):
    _check(a, b, bias, residual, weight, norm_bias, eps)
    m, n = a.shape[0], b.shape[1]
    return (
        a.new_empty((m, n), dtype=out_dtype or a.dtype),
        a.new_empty((m, n), dtype=_prenorm_dtype(a, residual)) if save_normed else _empty(a),
        a.new_empty((0,) if is_rms else (m,), dtype=torch.float32),
        a.new_empty((m,), dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed = inputs
    y, hh, mean, rstd = output
    affine = weight is not None or norm_bias is not None
    # Without affine, y is hh; with it, only the explicitly saved hh gives an exact backward.
    src = hh if save_normed else (None if affine else y)
    ctx.save_for_backward(a, b, weight, rstd, src)
    ctx.is_rms = is_rms
    ctx.meta = (
        bias is not None,
        residual.dtype if residual is not None else None,
        norm_bias.dtype if norm_bias is not None else None,
        _prenorm_dtype(a, residual),
        affine and not save_normed,
    )


def _backward(ctx, dy, _dhh, _dmean, _drstd):
    a, b, weight, rstd, src = ctx.saved_tensors
    has_bias, residual_dtype, norm_bias_dtype, h_dtype, missing_hh = ctx.meta
    if missing_hh:
        raise RuntimeError(
            f"{_OP}: backward through an affine norm needs save_normed=True in the forward "
            "(hh is not recoverable from y when the weight is near zero)"
        )
    dh, dw, dnb = norm_backward(
        dy, src, weight, None, rstd, ctx.is_rms, True, norm_bias_dtype is not None, h_dtype
    )
    da = (dh.to(a.dtype) @ b.t()) if ctx.needs_input_grad[0] else None
    db_ = (a.t() @ dh.to(a.dtype)) if ctx.needs_input_grad[1] else None
    dbias = dh.float().sum(0).to(a.dtype) if has_bias else None
    dres = dh.to(residual_dtype) if residual_dtype is not None else None
    dw = dw.to(weight.dtype) if weight is not None else None
    dnb = dnb.to(norm_bias_dtype) if norm_bias_dtype is not None else None
    return da, db_, dbias, dres, dw, dnb, None, None, None, None


mm_norm.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# CUDA: the launch plan, else tuning's configuration and the kernels' launcher
# ----------------------------------------------------------------------------------------------------------

_PLANS: dict[tuple, Callable] = memory.cache()  # plan_key -> launcher (mm_norm_cuda)


def mm_norm_cuda(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed, check):
    """The CUDA kernel of ``fusenorm::mm_norm`` as compiled graphs call it: the launch plan cached for this
    argument signature (measure.plan_key: no validation, tuning lookup or JIT specialization per call), else
    ``check()`` and ``mm_norm_tuned``, whose plan is kept when the launcher made one (the Gluon path; not while
    a CUDA graph is captured, where the tuner could not measure)."""
    from ..kernels.triton import mm_norm as kernels

    key = measure.plan_key((a, b, bias, residual, weight, norm_bias), eps, is_rms, out_dtype, save_normed,
                           settings.gluon, kernels._FORCE_BLOCK_N)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan(a, b, bias, residual, weight, norm_bias, eps)
    check()
    made: list = []
    out = mm_norm_tuned(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed, plan_out=made)
    if made and not torch.cuda.is_current_stream_capturing():
        _PLANS[key] = made[0]
    return out


def mm_norm_tuned(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype=None, save_normed=False,
                  plan_out=None):
    """(y, hh, mean, rstd) of ``mm_norm_reference`` from the kernels' launcher (``mm_norm_triton``) with the
    configuration ``forward_config`` picks (as measured at compile time, else the first candidate); inputs
    already checked. Without rows nothing runs, so nothing is measured. A Gluon configuration whose
    specialization spills (the launcher raises ``SpillError``) runs as the tl kernels' first choice instead.
    ``plan_out``: the launcher's."""
    from ..kernels.triton import mm_norm as kernels
    from ..tuning import mm_norm as tuning

    out_dtype = out_dtype or a.dtype
    args = (a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed)
    if a.shape[0] == 0:
        return kernels.mm_norm_triton(*args, None, plan_out=plan_out)  # the empty outputs
    config = tuning.forward_config(*args)
    if config.kind.startswith("gl_"):
        from ..kernels.hopper.common import SpillError

        try:
            return kernels.mm_norm_triton(*args, config, plan_out=plan_out)
        except SpillError:
            config = tuning.tl_fallback_config(a, b, residual, out_dtype, save_normed)
    return kernels.mm_norm_triton(*args, config, plan_out=plan_out)
