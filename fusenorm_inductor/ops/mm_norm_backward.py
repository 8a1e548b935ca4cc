"""Regrouped norm backward: ``dx = norm_backward(dy @ b + extra)`` in one GEMM with the norm's backward in
its epilogue (docs/algorithms.md section 4, "fusion regrouping").

For ``n = norm(x); out = linear(n)``, the data gradient of the linear, ``dn = d_out @ W``, is a GEMM whose
output feeds the norm's backward. Fusing the norm backward into that GEMM's epilogue keeps ``dn`` on chip;
dw and db (the norm's affine gradients) come out of the same kernel. ``extra`` is any other gradient that
reaches the norm's output (a residual branch, other consumers) and is added to ``dy @ b`` first.

Used by the pattern ``dgrad_norm_bwd`` (patterns/dgrad_norm_backward.py).
Reads top-down: reference -> custom op ``fusenorm::mm_norm_backward`` (fake) -> the CUDA call path: the
launch plan cached per argument signature, else the configuration tuning picks (tuning/mm_norm_backward.py)
and the kernels' launcher (kernels/triton/mm_norm_backward.py), both imported when a CUDA tensor first
reaches the op.

Outputs (dx, dw, db): dx [M, N] in ``dx_dtype``; dw, db [N] fp32 (0-size without weight / bias).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import memory
from .. import config as settings  # "config" names the GemmConfig here
from .. import graph_calls
from ..tuning import measure
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
    """(dx, dw, db) of ``fusenorm::mm_norm_backward`` in plain torch (fp32 math): its CPU implementation and the
    tests' oracle."""
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
    # Validated once per argument signature: mm_norm_backward_cuda caches its plan by what the checks read.
    return mm_norm_backward_cuda(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype,
                                 lambda: _check(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed))


# Registered with the dispatcher directly, as mm_norm's CUDA kernel (ops/mm_norm.py says why).
_LIB = torch.library.Library("fusenorm", "IMPL")
_LIB.impl("mm_norm_backward", _cuda, "CUDA")
graph_calls.register("mm_norm_backward", _cuda)  # compiled graphs call _cuda directly (graph_calls.py)


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


# ----------------------------------------------------------------------------------------------------------
# CUDA: the launch plan, else tuning's configuration and the kernels' launcher
# ----------------------------------------------------------------------------------------------------------

_PLANS: dict[tuple, Callable] = memory.cache()  # plan_key -> launcher (mm_norm_backward_cuda)


def mm_norm_backward_cuda(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype, check):
    """The CUDA kernel of ``fusenorm::mm_norm_backward`` as compiled graphs call it (as ``mm_norm_cuda`` in
    ops/mm_norm.py): the launch plan cached for this argument signature, else ``check()`` and
    ``mm_norm_backward_tuned``, whose plan is kept when the launcher made one (the Gluon path; not while a CUDA
    graph is captured)."""
    from ..kernels.triton import mm_norm_backward as kernels

    key = measure.plan_key((dy, b, extra, src, weight, mean, rstd), is_rms, src_is_normed, has_bias, dx_dtype,
                           settings.gluon, kernels._FORCE_BLOCK_N)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan(dy, b, extra, src, weight, mean, rstd)
    check()
    made: list = []
    out = mm_norm_backward_tuned(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype,
                                 plan_out=made)
    if made and not torch.cuda.is_current_stream_capturing():
        _PLANS[key] = made[0]
    return out


def mm_norm_backward_tuned(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype,
                           plan_out=None):
    """(dx, dw, db) of ``mm_norm_backward_reference`` from the kernels' launcher (``mm_norm_backward_triton``)
    with the configuration ``backward_config`` picks (as measured at compile time, else the first candidate);
    inputs already checked. Without rows nothing runs, so nothing is measured. A Gluon configuration whose
    specialization spills (the launcher raises ``SpillError``) runs as the tl kernels' first choice instead.
    ``plan_out``: the launcher's."""
    from ..kernels.triton import mm_norm_backward as kernels
    from ..tuning import mm_norm_backward as tuning

    args = (dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype)
    if dy.shape[0] == 0:
        return kernels.mm_norm_backward_triton(*args, None, plan_out=plan_out)  # dx empty, dw and db zeros
    config = tuning.backward_config(*args)
    if config.kind.startswith("gl_"):
        from ..kernels.hopper.common import SpillError

        try:
            return kernels.mm_norm_backward_triton(*args, config, plan_out=plan_out)
        except SpillError:
            config = tuning.tl_fallback_config(dy, b, dx_dtype)
    return kernels.mm_norm_backward_triton(*args, config, plan_out=plan_out)
