"""Deferred normalization: a norm between GEMMs split between its producer and its consumers.

The norm's input y is written by its producer as usual; the producer's epilogue also writes *partial* row
statistics of y, one per tile of ``tile`` columns; each consumer applies the norm where it reads y
(docs/support.md "Deferred normalization", docs/algorithms.md). No kernel needs another's data, and
norm(y) is never written where only GEMMs read it. Two ops:

``fusenorm::deferred_mm(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile,
out_norm, out_tile, cache_fold, res_rows)`` -> (c, stats) is one GEMM ``acc = a @ b'`` (fp32) whose epilogue
  1. applies the deferred norm of its input a (``a_norm``: 0 none, 1 RMSNorm, 2 LayerNorm), whose partial
     statistics ``a_stats`` (tiles of ``a_tile`` columns of a) it merges per row into (mean, rstd):
         RMSNorm:   acc = rstd * acc
         LayerNorm: acc = rstd * (acc - mean * colsum)
     with b', colsum and bias' folded from the norm's affine (kernels/fold.py: b' = diag(norm_weight) b,
     colsum = the column sums of the rounded b', bias' = bias + norm_bias b); without a norm, b' = b;
  2. adds bias' and ``residual`` and rounds once to a's dtype: c; with ``res_rows`` [1 or 3, M] fp32 the
     residual r enters as scale * r, or scale * (r - center) + shift, per row: in a training graph, the GEMM
     of the consumers' gradients applies the norm's backward this way (patterns/deferred_norm.py);
  3. writes the partial statistics of c *as stored* (``out_norm``: which norm will read them, in tiles of
     ``out_tile`` columns) for the next norm: the producer's side.
A tower ``linear -> norm -> linear -> norm`` is a chain of these, each applying the previous norm and
producing the next one's statistics. The fold depends on the weights only: with ``cache_fold`` (inference
graphs) it is kept per weight version (the parameters' version counters) and not redone per call; it never
leaves the op, so nothing the compiled graph may overwrite or reuse is shared between calls.

Statistics, their merge and the fold live in kernels/deferred.py (plain torch): ``stats`` is [Q, M, T] fp32,
T = ceil(N / tile), Q = 1 (RMSNorm) or 2 (LayerNorm). ``merge_stats`` turns them into the norm's (mean,
rstd); the graph inlines it (aten ops, fused by Inductor) where the statistics are needed outside a GEMM:
the norm's backward, a weight gradient's rebuild of norm(x).

Reads top-down: reference (the CPU implementation and the tests' oracle) -> custom ops (fake; autograd for
direct calls) -> the CUDA call path: launch plan cached per argument signature, else the configuration
tuning picks (tuning/deferred_norm.py) and the Gluon kernel (kernels/hopper/deferred_mm.py); where Gluon
cannot take the inputs, the reference's torch code on the GPU (correct, slow: the dispatch, which measures,
never picks deferral there).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import backends, graph_calls, memory
from .. import config as settings
from ..backends import DeferredCase
from ..kernels.deferred import LN, NONE, RMS, applied, folded, merge_stats, partial_stats, stats_shape
from ..tuning import measure
from ._validate import check_eps, check_tensor

__all__ = ["deferred_mm", "deferred_mm_reference", "merge_stats", "partial_stats", "stats_shape", "NONE", "RMS",
           "LN"]

_OP = "fusenorm::deferred_mm"
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_norm_code(op: str, name: str, code) -> None:
    if isinstance(code, bool) or code not in (NONE, RMS, LN):
        raise ValueError(f"{op}: {name} must be 0 (no norm), 1 (RMSNorm) or 2 (LayerNorm), got {code!r}")


def _check_tile(op: str, name: str, tile) -> None:
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"{op}: {name} must be a positive int (columns per statistics tile), got {tile!r}")


def _check(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile,
           cache_fold, res_rows=None) -> None:
    check_tensor(_OP, "a", a, ndim=2, dtypes=FLOATS)
    m, k = a.shape
    check_tensor(_OP, "b", b, ndim=2, device=a.device, dtypes=(a.dtype,))
    if b.shape[0] != k:
        raise ValueError(f"{_OP}: a is {tuple(a.shape)} but b is {tuple(b.shape)}: inner dims differ")
    n = b.shape[1]
    check_tensor(_OP, "bias", bias, shape=(n,), device=a.device, required=False)
    check_tensor(_OP, "residual", residual, shape=(m, n), device=a.device, required=False)
    _check_norm_code(_OP, "a_norm", a_norm)
    _check_norm_code(_OP, "out_norm", out_norm)
    if a_norm != NONE:
        if k == 0:
            raise ValueError(f"{_OP}: a is {tuple(a.shape)}: a norm needs at least one column")
        _check_tile(_OP, "a_tile", a_tile)
        check_tensor(_OP, "a_stats", a_stats, shape=stats_shape(m, k, a_norm, a_tile), device=a.device,
                     dtypes=(torch.float32,))
        check_eps(_OP, a_eps)
        check_tensor(_OP, "norm_weight", norm_weight, shape=(k,), device=a.device, required=False)
        check_tensor(_OP, "norm_bias", norm_bias, shape=(k,), device=a.device, required=False)
    elif a_stats is not None or norm_weight is not None or norm_bias is not None:
        raise ValueError(f"{_OP}: a_stats/norm_weight/norm_bias given but a_norm = 0 (no norm to apply)")
    if out_norm != NONE:
        if n == 0:
            raise ValueError(f"{_OP}: b is {tuple(b.shape)}: statistics need at least one output column")
        _check_tile(_OP, "out_tile", out_tile)
    if res_rows is not None:
        if residual is None:
            raise ValueError(f"{_OP}: res_rows given without a residual to apply them to")
        check_tensor(_OP, "res_rows", res_rows, ndim=2, device=a.device, dtypes=(torch.float32,))
        if res_rows.shape[0] not in (1, 3) or res_rows.shape[1] != m:
            raise ValueError(f"{_OP}: res_rows must be [1, M] (scale) or [3, M] (scale, center, shift) with "
                             f"M = {m}, got {tuple(res_rows.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Reference (CPU implementation and the tests' oracle): fp32 statistics, fp32 GEMM, one rounding of c.
# ----------------------------------------------------------------------------------------------------------


def deferred_mm_reference(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm,
                          out_tile, cache_fold=False, res_rows=None) -> tuple[Tensor, Tensor]:
    b, bias, colsum = folded(b, bias, norm_weight, norm_bias, a_norm)
    return applied(a, b, bias, colsum, residual, a_stats, a_eps, a_norm, a_tile, out_norm, out_tile, res_rows)


# ----------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(_OP, mutates_args=())
def deferred_mm(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    a_stats: Optional[Tensor],
    norm_weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    a_eps: float,
    a_norm: int,
    a_tile: int,
    out_norm: int,
    out_tile: int,
    cache_fold: bool = False,
    res_rows: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """One GEMM that applies a deferred norm of its input and writes statistics of its output for the next
    one; see the module docstring."""
    args = (a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile,
            cache_fold, res_rows)
    _check(*args)
    return deferred_mm_reference(*args)


@deferred_mm.register_fake
def _(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile,
      cache_fold=False, res_rows=None):
    _check(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile,
           cache_fold, res_rows)
    m, n = a.shape[0], b.shape[1]
    return a.new_empty((m, n)), a.new_empty(stats_shape(m, n, out_norm, out_tile), dtype=torch.float32)


def _cuda(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile,
          cache_fold=False, res_rows=None):
    args = (a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile,
            cache_fold, res_rows)
    return deferred_mm_cuda(args, lambda: _check(*args))


# Registered with the dispatcher directly, as mm_norm's CUDA kernel (ops/mm_norm.py says why).
_LIB = torch.library.Library("fusenorm", "IMPL")
_LIB.impl("deferred_mm", _cuda, "CUDA")
graph_calls.register("deferred_mm", _cuda)  # compiled graphs call _cuda directly (graph_calls.py)


def _setup_context(ctx, inputs, output):
    a, b, bias, residual = inputs[:4]
    ctx.save_for_backward(a, b, inputs[13] if len(inputs) > 13 else None)
    ctx.a_norm = inputs[8]
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dc, _dstats):
    if ctx.a_norm != NONE:
        # Compiled graphs never need this: the rewrite happens on the joint graph, after autograd traced the
        # unfused norm's backward (patterns/deferred_norm.py).
        raise NotImplementedError(
            f"{_OP}: backward through a deferred norm (a_norm != 0) is not implemented for direct calls; "
            "differentiate the unfused graph (torch.compile does, before fusenorm rewrites it)")
    a, b, res_rows = ctx.saved_tensors
    da = dc.to(b.dtype) @ b.t() if ctx.needs_input_grad[0] else None
    db = a.t() @ dc.to(a.dtype) if ctx.needs_input_grad[1] else None
    dbias = dc.float().sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    dres = None
    if ctx.residual_dtype is not None:  # the per-row terms are constants to the residual's gradient
        dres = (dc.float() * res_rows[0].unsqueeze(-1) if res_rows is not None else dc).to(ctx.residual_dtype)
    return (da, db, dbias, dres) + (None,) * 10


deferred_mm.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# CUDA: the launch plan, else tuning's configuration and the Gluon kernel; else the reference on the GPU
# ----------------------------------------------------------------------------------------------------------

_PLANS: dict[tuple, Callable] = memory.cache()  # plan_key -> launcher (deferred_mm_cuda)


def deferred_mm_cuda(args: tuple, check: Callable[[], None]):
    """The CUDA kernel of ``fusenorm::deferred_mm`` as compiled graphs call it: the launch plan cached for
    this argument signature (no validation or tuning lookup per call), else ``check()`` and
    ``deferred_mm_tuned``, whose plan is kept when it made one (not while a CUDA graph is captured)."""
    tensors, scalars = args[:7] + args[13:], args[7:13]
    key = measure.plan_key(tensors, *scalars, settings.gluon, settings.quack)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan(*args)
    check()
    made: list = []
    out = deferred_mm_tuned(args, plan_out=made)
    if made and not torch.cuda.is_current_stream_capturing():
        _PLANS[key] = made[0]
    return out


def _alloc(shape, dtype, device) -> Tensor:
    """Every output the Gluon launch writes comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def deferred_mm_tuned(args: tuple, config=None, plan_out: Optional[list] = None):
    """(c, stats) of ``deferred_mm_reference``: the Gluon kernel with ``config`` (default: the one tuning picks,
    tuning/deferred_norm.py) where it takes the inputs, else the reference's torch code on the GPU (also
    where the specialization spills). ``plan_out``: where a Gluon launch appends the function that launches
    it again on inputs of the same signature."""
    from ..tuning import deferred_norm as tuning

    args = backends.DeferredArgs.of(args)
    a, b = args.a, args.b
    if 0 in (a.shape[0], a.shape[1], b.shape[1]) or tuning.unsupported(DeferredCase.of(args)):
        return deferred_mm_reference(*args)
    config = config or tuning.deferred_config(*args)
    backend = backends.backend_of(config)
    if backend.deferred_unsupported(DeferredCase.of(args)) is not None:
        # the cached choice's backend is gone (switched off, not installed in this process): another's first
        config = tuning.candidates_of(args)[0]
        backend = backends.backend_of(config)
    try:
        return backend.deferred_launch(args, config, _alloc, plan_out)
    except Exception as e:
        if getattr(e, "refusal", False):  # a specialization its kernel cannot build (spills): nothing launched
            return deferred_mm_reference(*args)
        if backend is backends.GLUON:
            raise
        # a peer library failing on inputs it said it takes: the correct, slow path, said once
        measure.warn_once(("deferred_mm", backend.name, type(e).__name__),
                          f"fusenorm: {backend.name}'s deferred GEMM failed ({type(e).__name__}: {e}); the op's "
                          "reference runs instead")
        return deferred_mm_reference(*args)
