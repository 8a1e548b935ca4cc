"""Lazy Pre-Norm (``fusenorm::norm_mm``): which configuration the kernels run, and whether to fuse at all.

- ``prenorm_candidates``: the configurations of ``norm_mm_triton`` (kernels/triton/norm_mm.py) worth timing,
  best guess first: the Gluon kernel's (kernels/hopper/norm_mm.py) where ``gluon_unsupported`` lets it take the
  inputs, then the tl kernels' (``tl_candidates``).
- ``measure_prenorm``: every candidate timed on random inputs like the call's, against the unfused side; the
  result is an entry of tuning/measure.py's cache under ``prenorm_key``.
- ``prenorm_config``: the configuration a launch runs (the op's CUDA path asks for it, ops/norm_mm.py): the
  cached measurement, else its bucket's, else the first candidate (``measure.tuned_config``; never a timing).
- ``prenorm_choice`` / ``prenorm_norm_ms``: the compile-time decision of the pattern (patterns/pre_norm.py)
  whether to fuse, from the same entries, by tuning/decide.py's rules (``_choice``).

The kernel modules are imported only to list or measure candidates, not with this module: the patterns import
it, and the kernels need triton.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import baseline, measure
from .decide import _PROBE_FAILED, Choice, _choice, _default_label, gluon_off

__all__ = ["gluon_unsupported", "measure_prenorm", "prenorm_candidates", "prenorm_choice", "prenorm_config",
           "prenorm_key", "prenorm_norm_ms", "tl_candidates"]

# The TMA kernel's tiles (kernels/triton/norm_mm.py's docstring): 128 rows, BLOCK_K 64, 8 warps, 3 stages;
# N tiles of 128 or 256 (``_tma_block_ns``).
TMA_BLOCK_M = 128
TMA_BLOCK_K = 64
TMA_WARPS = 8
TMA_STAGES = 3


# ----------------------------------------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------------------------------------


def gluon_unsupported(a: Tensor, b: Tensor, out_dtype) -> Optional[str]:
    """Why the Gluon sm_90 kernel (kernels/hopper/norm_mm.py) cannot take these inputs; None when it can."""
    why = gluon_off()
    if why is not None:
        return why
    from ..kernels.hopper import norm_mm as hopper

    return hopper.unsupported(a, b, out_dtype)


def prenorm_candidates(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> list:
    """The configurations (``GemmConfig``) worth timing for ``norm_mm_triton(a, b, ...)``, best guess first
    (``prenorm_config`` times them on CUDA; without tuning the first one runs). b may be b or b' (same layout).

    The Gluon kernel's configurations come first where it takes the inputs, then the tl kernels' first
    choice. Of the tl kernels, where N spans several tiles and the row blocks fill the SMs, the row-block walk
    ("tma_rows": statistics once per row block) comes first, the flattened walk ("tma": statistics per
    tile) after it."""
    if a.shape[0] and b.shape[1] and gluon_unsupported(a, b, out_dtype) is None:
        from ..kernels.hopper import norm_mm as hopper

        gluon = hopper.candidates(a, b)
        if gluon:
            return gluon + tl_candidates(a, b, out_dtype)[:1]
    return tl_candidates(a, b, out_dtype)


def tl_candidates(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> list:
    """The tl kernels' configurations, best guess first: the pointer kernel's tile where TMA cannot read the
    operands (or N == 0), else the TMA kernel's walks. The first is also what runs when a Gluon
    configuration's specialization spills (ops/norm_mm.py)."""
    import triton

    from ..kernels.triton import common, norm_mm as kernels

    m, k = a.shape
    n = b.shape[1]
    if n == 0 or common.tma_layout(a, b) is None:
        return [kernels.pointer_config(m, n, k, a.dtype, a.device)]
    bk = min(TMA_BLOCK_K, common.pow2_at_least(k))
    out_bytes = out_dtype.itemsize
    cands = []
    for bn in _tma_block_ns(m, n, a.device):
        flat = common.tma_config("tma", TMA_BLOCK_M, bn, bk, TMA_STAGES, TMA_WARPS, out_bytes)
        if triton.cdiv(n, bn) > 1 and triton.cdiv(m, flat.block_m) >= common.num_sms(a.device):
            cands.append(flat._replace(kind="tma_rows"))
        cands.append(flat)
    return cands


def _tma_block_ns(m: int, n: int, device: torch.device) -> list[int]:
    """N tiles of the TMA kernel, best guess first: 256 (the widest TMA box and wgmma N) unless it pads N
    more than 128 does, or its tiles would not fill the SMs once; then 128."""
    import triton

    from ..kernels.triton.common import TMA_MAX_BLOCK_N, num_sms

    if n <= 128:
        return [128]
    row_blocks = triton.cdiv(m, TMA_BLOCK_M)
    narrow_first = (
        triton.cdiv(n, 128) * 128 < triton.cdiv(n, TMA_MAX_BLOCK_N) * TMA_MAX_BLOCK_N
        or row_blocks * triton.cdiv(n, TMA_MAX_BLOCK_N) < num_sms(device)
    )
    return [128, TMA_MAX_BLOCK_N] if narrow_first else [TMA_MAX_BLOCK_N, 128]


# ----------------------------------------------------------------------------------------------------------
# Which configuration runs: measured per shape (tuning/measure.py)
# ----------------------------------------------------------------------------------------------------------


def prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype) -> tuple:
    return (
        "norm_mm", a.device, measure.spec(a, rows=True), measure.spec(b), measure.spec(bias), measure.spec(weight),
        measure.spec(norm_bias), bool(is_rms), str(out_dtype or a.dtype),
    )


def measure_prenorm(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype) -> dict:
    """Every candidate timed on random inputs like the (possibly fake) arguments, and the unfused side:
    Inductor's own code for the subgraph (tuning/baseline.py), else the estimate (the norm at copy speed plus
    cuBLAS's GEMM)."""
    from ..kernels.triton import norm_mm as kernels

    with measure.RealInputs():
        ra, rb, rbias, rw, rnb = measure.real_gemm_operands(a, b, bias, weight, norm_bias)
        t_mm = measure.gemm_ms(ra, rb, rbias)
        t_est = measure.plus(t_mm, _prenorm_norm_ms(a))
        best, times = measure.time_candidates(
            prenorm_candidates(ra, rb, out_dtype or ra.dtype),
            lambda c: kernels.norm_mm_triton(ra, rb, rbias, rw, rnb, eps, is_rms, out_dtype, config=c),
            t_est,
        )
        # The host time of the call a compiled graph makes: the cached launch plan where the launcher makes one.
        made: list = []
        full = lambda: kernels.norm_mm_triton(ra, rb, rbias, rw, rnb, eps, is_rms, out_dtype,  # noqa: E731
                                              config=best, plan_out=made)
        h = measure.fused_host_us(lambda: made[0](ra, rb, rbias, rw, rnb) if made else full(), times[best])
        ind = baseline.unfused_where_it_counts(a.device, times[best], h, t_est, best.label(),
                                               baseline.pre_norm_fn(ra, rb, rbias, rw, rnb, eps, is_rms, out_dtype),
                                               "norm + linear")
    return measure.make_entry(best, times, t_est, h, ind)


def prenorm_config(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype):
    """The GemmConfig a launch runs for these (real) arguments (``measure.tuned_config``)."""
    return measure.tuned_config(
        prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype),
        a.device,
        lambda: prenorm_candidates(a, b, out_dtype or a.dtype),
    )


# ----------------------------------------------------------------------------------------------------------
# Whether to fuse: the pattern's compile-time decision (tuning/decide.py)
# ----------------------------------------------------------------------------------------------------------


def prenorm_choice(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype) -> Choice:
    """Whether ``norm_mm`` beats the norm + cuBLAS GEMM on this shape (one consumer's view: with fan-out
    the pattern compares the consumers' sum against one norm + their GEMMs), and with which configuration."""

    def measure_fn():
        return measure_prenorm(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)

    key = prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype)
    choice = _choice(key, a.device, measure_fn, lambda: _default_label(b), what="norm at copy speed + cuBLAS GEMM")
    if choice.t_fused_ms is not None and _prenorm_norm_ms(a) is None:
        # A cached measurement, but the pattern weighs fan-out and weight-gradient rebuilds with
        # prenorm_norm_ms, which needs the copy bandwidth: without it the match counts as not measured.
        choice = Choice(True, choice.config, f"fused ({_PROBE_FAILED})")
    return choice


def prenorm_norm_ms(a: Tensor) -> float:
    """The unfused pre-norm's time: Inductor's norm reads x and writes y, [M, K] each, at copy speed. 0.0 when
    the bandwidth probe failed (``prenorm_choice`` then reports no measurement, so the pattern does not use it)."""
    t = _prenorm_norm_ms(a)
    return 0.0 if t is None else t


def _prenorm_norm_ms(a: Tensor) -> Optional[float]:
    """The unfused pre-norm's time (``prenorm_norm_ms``); None when the bandwidth probe failed."""
    return measure.norm_proxy_ms(a.shape[0], a.shape[1], a.dtype, 2, a.device)
