"""Which configuration ``fusenorm::mm_norm_backward`` runs, and whether to fuse the norm's backward into the
next linear's data-gradient GEMM at all.

- ``backward_candidates``: the configurations worth timing for a shape, best guess first: the Gluon sm_90
  kernel's (kernels/hopper/mm_norm_backward.py) where ``gluon_unsupported`` finds nothing against it, else
  the ``tl`` kernels' (kernels/triton/mm_norm_backward.py);
- ``measure_backward``: every candidate timed, and the unfused side (tuning/baseline.py), as a cache entry
  (tuning/measure.py);
- ``backward_config``: the launch-time choice (``measure.tuned_config``), which the op's CUDA call
  (ops/mm_norm_backward.py) passes to the launcher;
- ``backward_choice``: the compile-time decision of the pattern ``dgrad_norm_bwd`` (tuning/decide.py's rules)
  on the same cache entry.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from . import baseline, measure
from .decide import Choice, _choice, _default_label, _describe, gluon_off

if TYPE_CHECKING:
    from ..kernels.triton.common import GemmConfig

# The kernel modules (and triton) are imported inside the functions that list, time or launch configurations:
# the patterns import this module at compile time, also where there is no GPU and no triton.

__all__ = ["backward_candidates", "backward_choice", "backward_config", "backward_key", "backward_out_bytes",
           "describe_mm_norm_backward", "gluon_unsupported", "measure_backward", "tl_fallback_config"]


def gluon_unsupported(dy, b, extra, src, weight, mean, rstd, dx_dtype) -> Optional[str]:
    """Why the Gluon sm_90 kernel (kernels/hopper/mm_norm_backward.py) cannot take these inputs; None when it
    can."""
    from ..kernels.triton import mm_norm_backward as kernels

    why = gluon_off(kernels._FORCE_BLOCK_N)
    if why is not None:
        return why
    from ..kernels.hopper import mm_norm_backward as hopper

    return hopper.unsupported(dy, b, extra, src, weight, mean, rstd, dx_dtype)


def backward_candidates(dy: Tensor, b: Tensor, n: int, out_bytes: int = 2, gluon_args: Optional[tuple] = None
                        ) -> list[GemmConfig]:
    """The configurations worth timing for this shape, best guess first (see tuning/mm_norm.py's
    ``forward_candidates``). ``gluon_args`` (extra, src, weight, mean, rstd, dx_dtype): when given and the
    Gluon kernel takes these inputs, its configurations come first, then the ``tl`` kernels' best guess."""
    import triton

    from ..kernels.triton import mm_norm_backward as kernels
    from ..kernels.triton.common import (TMA_MAX_BLOCK_N, fixed_candidates, num_sms, pow2_at_least, spin_allowed,
                                         tma_config)

    if gluon_args is not None and gluon_unsupported(dy, b, *gluon_args) is None:
        from ..kernels.hopper import mm_norm_backward as hopper

        gluon = hopper.candidates(dy, b)
        if gluon:
            return gluon
    fixed, bk = fixed_candidates(dy, b, n, kernels._FORCE_BLOCK_N, prefetch=True)
    if fixed is not None:
        return fixed
    bn = pow2_at_least(n)
    if bn <= TMA_MAX_BLOCK_N:
        # The epilogue holds dn, hh and t at once (and src across the K loop when prefetched).
        return [
            tma_config("row", 128, bn, bk, 3, 8, out_bytes),
            tma_config("row", 64, bn, bk, 4, 8, out_bytes, prefetch=True),
            tma_config("row", 64, bn, bk, 3, 4, out_bytes, progs_per_sm=2),
        ]
    out = []
    if spin_allowed(dy.device) and triton.cdiv(n, 128) <= num_sms(dy.device):
        out = [
            tma_config("spin", 128, 128, bk, 4, 8, out_bytes),
            tma_config("spin", 64, 256, bk, 4, 8, out_bytes),
            tma_config("spin", 64, 256, bk, 4, 8, out_bytes, prefetch=True),
        ]
    return out + [tma_config("coop", 64, 256, bk, 4, 8, out_bytes)]


def backward_out_bytes(dx_dtype: torch.dtype) -> int:
    """Bytes per element of dx (4 when it is fp32): it bounds the pipeline depth."""
    return 4 if dx_dtype == torch.float32 else 2


def tl_fallback_config(dy, b, dx_dtype) -> GemmConfig:
    """What runs where a Gluon configuration cannot (its specialization spills registers): the ``tl``
    kernels' first choice."""
    return backward_candidates(dy, b, b.shape[1], backward_out_bytes(dx_dtype))[0]


def measure_backward(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype) -> dict:
    """Every candidate timed on random inputs like the (possibly fake) arguments, and the unfused side:
    Inductor's own code for it (tuning/baseline.py) where that can turn the verdict, else the estimate:
    cuBLAS's data-gradient GEMM plus a norm backward at copy speed (it reads dn and the saved tensor and writes
    dx; row sums stay on chip)."""
    from ..kernels.triton import mm_norm_backward as kernels

    with measure.RealInputs():
        rdy, rb, rextra, rsrc, rw, rmean, rstd_r = measure.real_gemm_operands(dy, b, extra, src, weight, mean, rstd)
        rstd_r = rstd_r.abs_() + 0.5
        t_mm = measure.gemm_ms(rdy, rb, None)
        t_est = measure.plus(t_mm, measure.norm_proxy_ms(rdy.shape[0], rb.shape[1], rdy.dtype, 3, dy.device))
        best, times = measure.time_candidates(
            backward_candidates(rdy, rb, rb.shape[1], backward_out_bytes(dx_dtype),
                                (rextra, rsrc, rw, rmean, rstd_r, dx_dtype)),
            lambda c: kernels.mm_norm_backward_triton(
                rdy, rb, rextra, rsrc, rw, rmean, rstd_r, is_rms, src_is_normed, has_bias, dx_dtype, config=c
            ),
            t_est,
        )
        # The host time of the call a compiled graph makes: the cached launch plan where the launcher makes one.
        made: list = []
        full = lambda: kernels.mm_norm_backward_triton(  # noqa: E731
            rdy, rb, rextra, rsrc, rw, rmean, rstd_r, is_rms, src_is_normed, has_bias, dx_dtype, config=best,
            plan_out=made)
        h = measure.fused_host_us(lambda: made[0](rdy, rb, rextra, rsrc, rw, rmean, rstd_r) if made else full(),
                                  times[best])
        ind = baseline.unfused_where_it_counts(
            dy.device, times[best], h, t_est, best.label(),
            baseline.dgrad_norm_fn(rdy, rb, rextra, rsrc, rw, rmean, rstd_r, is_rms, src_is_normed, has_bias,
                                   dx_dtype),
            "data-gradient GEMM + norm backward")
    return measure.make_entry(best, times, t_est, h, ind)


def backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype) -> tuple:
    """The measurement cache's key (tuning/measure.py) of these arguments."""
    spec = measure.spec
    return (
        "mm_norm_backward", dy.device, spec(dy, rows=True), spec(b), spec(extra, rows=True), spec(src, rows=True),
        spec(weight),
        bool(is_rms), bool(src_is_normed), bool(has_bias), str(dx_dtype),
    )


def backward_config(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype
                    ) -> GemmConfig:
    """The GemmConfig the launcher runs for these (real) arguments (``measure.tuned_config``)."""
    return measure.tuned_config(
        backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype),
        dy.device,
        lambda: backward_candidates(dy, b, b.shape[1], backward_out_bytes(dx_dtype),
                                    (extra, src, weight, mean, rstd, dx_dtype)),
    )


def backward_choice(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype) -> Choice:
    """Whether ``mm_norm_backward`` beats the unfused data-gradient GEMM + norm backward on this shape."""

    def measure_fn():
        return measure_backward(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype)

    key = backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype)
    choice = _choice(key, dy.device, measure_fn, lambda: _default_label(dy))
    if dy.device.type == "cuda" and not choice.config.startswith("gl_"):
        why = gluon_unsupported(dy, b, extra, src, weight, mean, rstd, dx_dtype)
        if why is not None:
            choice = replace(choice, reason=f"{choice.reason}; Gluon sm_90 path not taken: {why}")
    return choice


def describe_mm_norm_backward(dy: torch.Tensor, n: int, is_rms: bool) -> str:
    """The report's kernel column (see describe_mm_norm in tuning/mm_norm.py)."""
    return _describe(dy, "mm_norm_backward")
