"""Which configuration ``fusenorm::mm_norm`` runs, and whether to fuse ``linear -> [+ residual] -> norm`` at all.

- ``forward_candidates``: the configurations worth timing for a shape, best guess first: the Gluon sm_90
  kernels' (kernels/hopper/mm_norm.py) where ``gluon_unsupported`` finds nothing against them, else the
  ``tl`` kernels' (kernels/triton/mm_norm.py);
- ``measure_forward``: every candidate timed, and the unfused side (tuning/baseline.py), as a cache entry
  (tuning/measure.py);
- ``forward_config``: the launch-time choice (``measure.tuned_config``: the cached measurement, else its
  bucket's, else the first candidate; never a timing), which the op's CUDA call (ops/mm_norm.py) passes to
  the launcher;
- ``forward_choice``: the compile-time decision of the pattern ``linear_norm_fwd`` (tuning/decide.py's rules)
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

__all__ = ["describe_mm_norm", "forward_candidates", "forward_choice", "forward_config", "forward_key",
           "forward_out_bytes", "gluon_unsupported", "measure_forward", "tl_fallback_config"]


def gluon_unsupported(a, b, bias, residual, weight, norm_bias, out_dtype, save_normed) -> Optional[str]:
    """Why the Gluon sm_90 kernels (kernels/hopper/mm_norm.py) cannot take these inputs; None when they can."""
    from ..kernels.triton import mm_norm as kernels

    why = gluon_off(kernels._FORCE_BLOCK_N)
    if why is not None:
        return why
    from ..kernels.hopper import mm_norm as hopper

    return hopper.unsupported(a, b, bias, residual, weight, norm_bias, out_dtype, save_normed)


def forward_candidates(a: Tensor, b: Tensor, n: int, out_bytes: int = 2, gluon_args: Optional[tuple] = None
                       ) -> list[GemmConfig]:
    """The configurations worth timing for this shape, best guess first (``forward_config`` times them on
    CUDA and caches the winner; without tuning the first one runs). ``out_bytes``: 4 when an [M, N] output is
    fp32. ``gluon_args`` (bias, residual, weight, norm_bias, out_dtype, save_normed): when given and the Gluon
    kernels take these inputs, their configurations come first."""
    import triton

    from ..kernels.triton import mm_norm as kernels
    from ..kernels.triton.common import (TMA_MAX_BLOCK_N, fixed_candidates, num_sms, pow2_at_least, spin_allowed,
                                         tma_config)

    if gluon_args is not None and gluon_unsupported(a, b, *gluon_args) is None:
        from ..kernels.hopper import mm_norm as hopper

        gluon = hopper.candidates(a, b, gluon_args[-1])
        if gluon:
            return gluon
    fixed, bk = fixed_candidates(a, b, n, kernels._FORCE_BLOCK_N)
    if fixed is not None:
        return fixed
    bn = pow2_at_least(n)
    if bn <= TMA_MAX_BLOCK_N:
        warps = 8 if bn > 64 else 4
        return [
            tma_config("row", 128, bn, bk, 3, warps, out_bytes),
            tma_config("row", 64, bn, bk, 4, 4, out_bytes, progs_per_sm=2),
        ]
    out = []
    if spin_allowed(a.device) and triton.cdiv(n, 128) <= num_sms(a.device):
        out = [tma_config("spin", 128, 256, bk, 3, 8, out_bytes), tma_config("spin", 128, 128, bk, 4, 8, out_bytes)]
    return out + [tma_config("coop", 128, 256, bk, 3, 8, out_bytes), tma_config("coop", 64, 256, bk, 4, 4, out_bytes)]


def forward_out_bytes(a, residual, out_dtype, save_normed) -> int:
    """Bytes per element of the widest [M, N] output (4 when y or hh is fp32): it bounds the pipeline depth."""
    h_dtype = torch.promote_types(a.dtype, residual.dtype) if residual is not None else a.dtype
    wide = (out_dtype or a.dtype) == torch.float32 or (save_normed and h_dtype == torch.float32)
    return 4 if wide else 2


def tl_fallback_config(a, b, residual, out_dtype, save_normed) -> GemmConfig:
    """What runs where a Gluon configuration cannot (its specialization spills registers): the ``tl``
    kernels' first choice."""
    return forward_candidates(a, b, b.shape[1], forward_out_bytes(a, residual, out_dtype, save_normed))[0]


def measure_forward(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed) -> dict:
    """Every candidate timed on random inputs like the (possibly fake) arguments, and the unfused side:
    Inductor's own code for the subgraph (tuning/baseline.py), and the estimate (cuBLAS's GEMM plus a norm at
    copy speed: it reads h, and the residual, and writes y) that stands in where that cannot be measured."""
    from ..kernels.triton import mm_norm as kernels

    with measure.RealInputs():
        ra, rb, *args = measure.real_gemm_operands(a, b, bias, residual, weight, norm_bias)
        out_bytes = forward_out_bytes(ra, residual, out_dtype, save_normed)
        t_mm = measure.gemm_ms(ra, rb, args[0])
        t_est = measure.plus(t_mm, measure.norm_proxy_ms(ra.shape[0], rb.shape[1], ra.dtype,
                                                         3 if residual is not None else 2, a.device))
        best, times = measure.time_candidates(
            forward_candidates(ra, rb, rb.shape[1], out_bytes, (*args, out_dtype, save_normed)),
            lambda c: kernels.mm_norm_triton(ra, rb, *args, eps, is_rms, out_dtype, save_normed, config=c),
            t_est,
        )
        # The host time of the call a compiled graph makes: the cached launch plan where the launcher makes one.
        made: list = []
        full = lambda: kernels.mm_norm_triton(ra, rb, *args, eps, is_rms, out_dtype, save_normed,  # noqa: E731
                                              config=best, plan_out=made)
        h = measure.fused_host_us(lambda: made[0](ra, rb, *args, eps) if made else full(), times[best])
        ind = baseline.unfused_where_it_counts(a.device, times[best], h, t_est, best.label(),
                                               baseline.post_norm_fn(ra, rb, *args, eps, is_rms, out_dtype),
                                               "linear + norm")
    return measure.make_entry(best, times, t_est, h, ind)


def forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed) -> tuple:
    """The measurement cache's key (tuning/measure.py) of these arguments."""
    spec = measure.spec
    return (
        "mm_norm", a.device, spec(a, rows=True), spec(b), spec(bias), spec(residual, rows=True), spec(weight),
        spec(norm_bias),
        bool(is_rms), str(out_dtype or a.dtype), bool(save_normed),
    )


def measure_step(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed) -> dict:
    """One training step of the subgraph both ways, on random inputs like the (possibly fake) arguments:
    ``mm_norm`` (the configuration the decision just stored runs) with the backward it implies (its autograd:
    the norm's backward from what it saved, decomposed as the joint pass does, and the GEMMs' gradients),
    against Inductor's forward and backward of the unfused linear + norm; {} where either cannot be timed."""
    from ..norm_math import norm_backward_reference

    # the norm's backward inlined as the joint pass inlines it where it stays unfused (ops/norm.decomposition)
    decomposed = {torch.ops.fusenorm.norm_backward.default: norm_backward_reference}
    with measure.RealInputs():
        ra, rb, *args = measure.real_gemm_operands(a, b, bias, residual, weight, norm_bias)
        names = ("a", "b", "bias", "residual", "weight", "norm_bias")
        present = [(n, t) for n, t in zip(names, (ra, rb, *args)) if t is not None]

    def fused(*ts):
        t = dict(zip([n for n, _ in present], ts))
        return torch.ops.fusenorm.mm_norm(t["a"], t["b"], t.get("bias"), t.get("residual"), t.get("weight"),
                                          t.get("norm_bias"), eps, is_rms, out_dtype, save_normed)[0]

    unfused, inputs = baseline.post_norm_fn(ra, rb, *args, eps, is_rms, out_dtype)
    # post_norm_fn's inputs are ``present``'s tensors in the same order: both sides take them
    timed = baseline.time_training_steps(
        lambda leaves: baseline.compile_unfused(fused, leaves, training=True, decompositions=decomposed),
        lambda leaves: baseline.compile_unfused(unfused, leaves, training=True), inputs, "linear + norm")
    return {} if timed is None else {"t_fused_step_ms": timed[0], "t_unfused_step_ms": timed[1]}


def forward_config(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed) -> GemmConfig:
    """The GemmConfig the launcher runs for these (real) arguments (``measure.tuned_config``)."""
    return measure.tuned_config(
        forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed),
        a.device,
        lambda: forward_candidates(a, b, b.shape[1], forward_out_bytes(a, residual, out_dtype, save_normed),
                                   (bias, residual, weight, norm_bias, out_dtype, save_normed)),
    )


def forward_choice(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed,
                   training: bool = False) -> Choice:
    """Whether ``mm_norm`` beats the unfused GEMM + norm on this shape, and with which configuration.
    ``training``: the graph has a backward, and the decision judges the whole step (``measure_step``)."""

    def measure_fn():
        return measure_forward(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed)

    def step_fn():
        return measure_step(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed)

    key = forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed)
    choice = _choice(key, a.device, measure_fn, lambda: _default_label(a), step_fn=step_fn if training else None)
    if a.device.type == "cuda" and not choice.config.startswith("gl_"):
        why = gluon_unsupported(a, b, bias, residual, weight, norm_bias, out_dtype, save_normed)
        if why is not None:
            choice = replace(choice, reason=f"{choice.reason}; Gluon sm_90 path not taken: {why}")
    return choice


def describe_mm_norm(a: torch.Tensor, n: int, is_rms: bool) -> str:
    """The report's kernel column; the patterns append the tuned configuration and the measured times."""
    return _describe(a, "mm_norm")
