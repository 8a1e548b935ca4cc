"""Whether to fuse at all: the compile-time decision of the fusion patterns, from measurements.

``forward_choice`` / ``backward_choice`` / ``prenorm_choice`` (called by the patterns at compile time, on
the traced graph's fake tensors) take the best fused time of the kernels' candidates against the unfused
path's time: Inductor's own compiled code for the matched subgraph, timed on the same inputs
(ops/baseline.py), where it can turn the verdict; elsewhere, where that compile fails or
``config.tuning.measure_inductor`` is off, it is estimated as cuBLAS's GEMM plus a norm at copy speed
(Inductor's norm kernels run at the copy bandwidth: docs/baselines-h200.md). Unless the graph will run
under CUDA graphs, each side takes at least ``config.tuning.host_weight`` times its host time per call (the
fused op as a compiled graph calls it, against the lower of Inductor's compiled subgraph's call and cuBLAS's
call plus one Triton launch: ``measure.fused_host_us`` / ``unfused_host_us``): without CUDA graphs a
kernel shorter than its launch waits for the CPU. Fusion is kept only when it
is faster by ``config.tuning.margin`` (``margin_gluon`` where the measured kernel is a Gluon one);
otherwise the match report names the measured times and Inductor compiles the graph as it would without
fusenorm. The measurements are the kernels' own (``measure_forward`` in mm_norm_kernels.py, ...), kept in
ops/measure.py's cache, where the launchers later find which configuration to run.

Deterministic mode (``torch.use_deterministic_algorithms(True)``): nothing is timed and every match is
fused, as with ``config.tuning.measure`` off; the match report's reason says so. When the copy-bandwidth
probe fails the unfused time is unknown: the match is fused, the reason says why, and the entry is kept in
the process only.

The kernel modules are imported only to measure (on CUDA); they never import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import config
from . import measure

__all__ = ["Choice", "backward_choice", "forward_choice", "prenorm_choice", "prenorm_norm_ms"]


@dataclass(frozen=True)
class Choice:
    fuse: bool
    config: str  # the fused kernel's configuration label ("ptr ...", "row ...", "coop ...", "gl_pp ...")
    reason: str
    t_fused_ms: Optional[float] = None
    t_unfused_ms: Optional[float] = None


def forward_choice(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed) -> Choice:
    """Whether ``mm_norm`` beats the unfused GEMM + norm on this shape, and with which configuration."""

    def measure_fn():
        from ..kernels.triton import mm_norm as mm_norm_kernels

        return mm_norm_kernels.measure_forward(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype,
                                               save_normed)

    key = measure.forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed)
    choice = _choice(key, a.device, measure_fn, lambda: _default_label(a))
    if a.device.type == "cuda" and not choice.config.startswith("gl_"):
        from ..kernels.triton.mm_norm import gluon_unsupported

        why = gluon_unsupported(a, b, bias, residual, weight, norm_bias, out_dtype, save_normed)
        if why is not None:
            choice = replace(choice, reason=f"{choice.reason}; Gluon sm_90 path not taken: {why}")
    return choice


def backward_choice(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype) -> Choice:
    """Whether ``mm_norm_backward`` beats the unfused data-gradient GEMM + norm backward on this shape."""

    def measure_fn():
        from ..kernels.triton import mm_norm_backward as mm_norm_backward_kernels

        return mm_norm_backward_kernels.measure_backward(dy, b, extra, src, weight, mean, rstd, is_rms,
                                                         src_is_normed, has_bias, dx_dtype)

    key = measure.backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype)
    choice = _choice(key, dy.device, measure_fn, lambda: _default_label(dy))
    if dy.device.type == "cuda" and not choice.config.startswith("gl_"):
        from ..kernels.triton.mm_norm_backward import gluon_unsupported

        why = gluon_unsupported(dy, b, extra, src, weight, mean, rstd, dx_dtype)
        if why is not None:
            choice = replace(choice, reason=f"{choice.reason}; Gluon sm_90 path not taken: {why}")
    return choice


def prenorm_choice(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype) -> Choice:
    """Whether ``norm_mm`` beats the norm + cuBLAS GEMM on this shape (one consumer's view: with fan-out
    the pattern compares the consumers' sum against one norm + their GEMMs), and with which configuration."""

    def measure_fn():
        from ..kernels.triton import norm_mm as norm_mm_kernels

        return norm_mm_kernels.measure_prenorm(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)

    key = measure.prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype)
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
    return measure.norm_proxy_ms(a.shape[0], a.shape[1], a.dtype, 2, a.device)


def _default_label(t: Tensor) -> str:
    return f"{t.device.type} reference" if t.device.type != "cuda" else "the kernels' first candidate"


_PROBE_FAILED = "not measured: the copy-bandwidth probe failed, so the unfused norm's time is unknown"


def _choice(key, device, measure_fn: Callable[[], dict], default_label: Callable[[], str],
            what: str = "cuBLAS GEMM + norm at copy speed") -> Choice:
    can = measure.can_measure(device)
    if not can and device.type != "cuda":
        return Choice(True, default_label(), "fused (not measured on CPU)")
    if torch.are_deterministic_algorithms_enabled():
        why = "not measured: deterministic algorithms are on, and timings are not deterministic"
        return Choice(True, default_label(), f"fused ({why})")
    if not can:
        return Choice(True, default_label(), "fused (not measured (config.tuning.measure off))")
    entry = measure.lookup(key)
    # An entry without the unfused time (a failed probe; in this process only) is measured again once the
    # probe works (a failed probe is not remembered).
    if entry is None or (entry["t_unfused_ms"] is None and measure.copy_bandwidth_gbps(device) > 0):
        entry = measure_fn()
        measure.store(key, entry)
    t_f, t_u = entry["t_fused_ms"], entry["t_unfused_ms"]
    label = measure.config_of(entry).label()
    if t_u is None:
        return Choice(True, label, f"fused ({_PROBE_FAILED})")
    margin = measure.margin_for(label)
    host = ""
    h_f, weight = entry.get("h_fused_us"), config.tuning.host_weight
    use_host = isinstance(h_f, (int, float)) and weight > 0 and measure.host_counts()
    inductor = entry.get("unfused_by") == "inductor"
    if inductor:
        what = "Inductor's compiled unfused subgraph"
    h_u = None
    if use_host:
        # Inductor's compiled subgraph, timed alone, also pays its wrapper's call and input checks, which a
        # user's step pays once per graph, not per site: per site the unfused side costs at least the bare
        # GEMM call plus one launch, so the lower figure is the one that cannot overstate it.
        known = [h for h in (entry.get("h_unfused_us") if inductor else None, measure.unfused_host_us(device))
                 if isinstance(h, (int, float))]
        h_u = min(known) if known else None
    if h_u is not None:
        # Without CUDA graphs a call takes at least its host time (weighted: config.tuning.host_weight): a
        # kernel shorter than that waits for the CPU.
        host = f"; host {h_f:.0f} us fused vs {h_u:.0f} us unfused per call, no CUDA graphs"
        t_f, t_u = max(t_f, weight * h_f / 1e3), max(t_u, weight * h_u / 1e3)
    fuse = t_f < t_u * (1.0 - margin)
    verdict = "fused" if fuse else "left unfused: fusion would not win"
    reason = f"{verdict} (measured {t_f:.4g} ms fused [{label}] vs {t_u:.4g} ms {what}{host})"
    return Choice(fuse, label, reason, t_f, t_u)


def _describe(t: torch.Tensor, op: str) -> str:
    if t.device.type != "cuda":
        return f"fusenorm::{op} ({t.device.type}: plain-torch reference)"
    return f"fusenorm::{op} (cuda: Triton)"


def describe_mm_norm(a: torch.Tensor, n: int, is_rms: bool) -> str:
    """The report's kernel column; the patterns append the tuned configuration and the measured times."""
    return _describe(a, "mm_norm")


def describe_mm_norm_backward(dy: torch.Tensor, n: int, is_rms: bool) -> str:
    return _describe(dy, "mm_norm_backward")
