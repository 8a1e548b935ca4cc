"""Whether to fuse at all: the compile-time decision of the fusion patterns, from measurements.

``forward_choice`` (tuning/mm_norm.py) / ``backward_choice`` (tuning/mm_norm_backward.py) /
``prenorm_choice`` (tuning/norm_mm.py) (called by the patterns at compile time, on the traced graph's fake
tensors) take, through ``_choice`` here, the best fused time of the kernels' candidates against the unfused
path's time: Inductor's own compiled code for the matched subgraph, timed on the same inputs
(tuning/baseline.py), where it can turn the verdict; elsewhere, where that compile fails or
``config.tuning.measure_inductor`` is off, it is estimated as cuBLAS's GEMM plus a norm at copy speed
(Inductor's norm kernels run at the copy bandwidth: docs/baselines-h200.md). Unless the graph will run
under CUDA graphs, each side takes at least ``config.tuning.host_weight`` times its host time per call (the
fused op as a compiled graph calls it, against the lower of Inductor's compiled subgraph's call and cuBLAS's
call plus one Triton launch: ``measure.fused_host_us`` / ``unfused_host_us``): without CUDA graphs a
kernel shorter than its launch waits for the CPU. Fusion is kept only when it
is faster by ``config.tuning.margin`` (``margin_gluon`` where the measured kernel is a Gluon one,
``margin_deferred`` for a deferred-normalization site: the caller passes it);
otherwise the match report names the measured times and Inductor compiles the graph as it would without
fusenorm. The measurements are the kernels' own (``measure_forward`` in tuning/mm_norm.py, ...), kept in
tuning/measure.py's cache, where the ops' CUDA calls later find which configuration to run.

Deterministic mode (``torch.use_deterministic_algorithms(True)``): nothing is timed and every match is
fused, as with ``config.tuning.measure`` off; the match report's reason says so. When the copy-bandwidth
probe fails the unfused time is unknown: the match is fused, the reason says why, and the entry is kept in
the process only.

This module imports no kernel module (the op's tuning module measures), and no kernel module imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import config
from ..backends import gluon_off  # noqa: F401 - the ops' tuning modules take it from here
from . import measure, table

__all__ = ["Choice"]


@dataclass(frozen=True)
class Choice:
    fuse: bool
    config: str  # the fused kernel's configuration label ("ptr ...", "row ...", "coop ...", "gl_pp ...")
    reason: str
    t_fused_ms: Optional[float] = None
    t_unfused_ms: Optional[float] = None


def _default_label(t: Tensor) -> str:
    return f"{t.device.type} reference" if t.device.type != "cuda" else "the kernels' first candidate"


_PROBE_FAILED = "not measured: the copy-bandwidth probe failed, so the unfused norm's time is unknown"


def _choice(key, device, measure_fn: Callable[[], dict], default_label: Callable[[], str],
            what: str = "cuBLAS GEMM + norm at copy speed", step_fn: Optional[Callable[[], dict]] = None,
            margin: Optional[float] = None) -> Choice:
    """The decision for ``key``: the cached entry, else ``measure_fn()``'s (stored), judged by the rules in the
    module docstring. ``step_fn`` (a training graph): where the forward alone would fuse, the whole step is
    timed too (``step_fn()``: the fused forward with the backward it implies against Inductor's forward and
    backward of the unfused subgraph, ``t_fused_step_ms`` / ``t_unfused_step_ms``, kept in the entry) and
    decides, by ``tuning.margin_step``: a forward that wins can still cost the step more in the backward it
    brings. ``margin``: the fraction the fused forward must win by, where the caller's comparison needs its
    own (else the label's)."""
    choice, entry = _forward_choice(key, device, measure_fn, default_label, what, margin)
    if step_fn is None or not choice.fuse or choice.t_fused_ms is None:
        return choice
    if entry.get("unfused_by") == TABLE:
        return _step_judge(entry, choice, "estimated from the table:")
    if "t_fused_step_ms" not in entry:
        entry = measure.agreed(key + ("step",), lambda: {**entry, **step_fn()})
        measure.store(key, entry, bucket=True)
    return _step_judge(entry, choice, "measured")


def _forward_choice(key, device, measure_fn: Callable[[], dict], default_label: Callable[[], str],
                    what: str, margin: Optional[float] = None) -> tuple[Choice, Optional[dict]]:
    can = measure.can_measure(device)
    if not can and device.type != "cuda":
        return Choice(True, default_label(), "fused (not measured on CPU)"), None
    if torch.are_deterministic_algorithms_enabled():
        why = "not measured: deterministic algorithms are on, and timings are not deterministic"
        return Choice(True, default_label(), f"fused ({why})"), None
    if measure.decisions(device) == "table":
        return _table_choice(key, device, what, margin)
    if not can:
        return Choice(True, default_label(), "fused (not measured (config.tuning.measure off))"), None

    def decided() -> dict:
        entry = measure.lookup(key)
        # An entry without the unfused time (a failed probe; in this process only) is measured again once the
        # probe works (a failed probe is not remembered).
        if entry is None or (entry["t_unfused_ms"] is None and measure.copy_bandwidth_gbps(device) > 0):
            entry = measure_fn()
            measure.store(key, entry, bucket=True)
        return entry

    entry = measure.agreed(key, decided)
    if entry["t_unfused_ms"] is None:
        return Choice(True, measure.config_of(entry).label(), f"fused ({_PROBE_FAILED})"), entry
    return _judge(entry, device, what, margin, "measured"), entry


def _judge(entry: dict, device, what: str, margin: Optional[float], how: str) -> Choice:
    """The forward's verdict on a decision entry's times (measured, or the table's): fused only when faster
    by the margin, each side taking at least its weighted host time where the graph runs without CUDA graphs."""
    t_f, t_u = entry["t_fused_ms"], entry["t_unfused_ms"]
    label = measure.config_of(entry).label()
    margin = measure.margin_for(label) if margin is None else margin
    host = ""
    h_f, weight = entry.get("h_fused_us"), config.tuning.host_weight
    use_host = isinstance(h_f, (int, float)) and weight > 0 and measure.host_counts()
    # a table entry keeps what its point was measured against ("measured_unfused_by")
    inductor = (entry.get("measured_unfused_by") if entry.get("unfused_by") == TABLE
                else entry.get("unfused_by")) == "inductor"
    if inductor:
        what = "Inductor's compiled unfused subgraph"
    h_u = None
    if use_host:
        # Inductor's compiled subgraph, timed alone, also pays its wrapper's call and input checks, which a
        # user's step pays once per graph, not per site: per site the unfused side costs at least the bare
        # GEMM call plus one launch, so the lower figure is the one that cannot overstate it.
        # (The bare pair's host time is a probe of two tiny launches, not a kernel's timing: the table's
        # decisions take it too, or they would judge host-bound sites against a dearer unfused side.)
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
    reason = f"{verdict} ({how} {t_f:.4g} ms fused [{label}] vs {t_u:.4g} ms {what}{host})"
    return Choice(fuse, label, reason, t_f, t_u)


def _step_judge(entry: dict, choice: Choice, how: str) -> Choice:
    """The training step's verdict (``_choice``) on an entry's step times."""
    t_fs, t_us = entry.get("t_fused_step_ms"), entry.get("t_unfused_step_ms")
    if not (isinstance(t_fs, (int, float)) and isinstance(t_us, (int, float))):
        missing = "could not be measured" if how == "measured" else "has no times in the table here"
        return Choice(False, choice.config, f"left unfused: the training step {missing}, and a "
                                            f"forward that wins alone may lose the step ({choice.reason})",
                      choice.t_fused_ms, choice.t_unfused_ms)
    fuse = t_fs < t_us * (1.0 - config.tuning.margin_step)
    verdict = "fused" if fuse else "left unfused: fusion would not win the training step"
    reason = (f"{verdict} ({how} the training step: {t_fs:.4g} ms fused forward + the backward it implies "
              f"[{choice.config}] vs {t_us:.4g} ms Inductor's forward + backward, CUDA events, no CUDA graphs; the "
              f"forward alone: {choice.reason})")
    return Choice(fuse, choice.config, reason, choice.t_fused_ms, choice.t_unfused_ms)


def charged(choice: Choice, extra_ms: Optional[float], why: str) -> Choice:
    """``choice`` with ``extra_ms`` more on its fused side (work the fusion adds outside the timed kernel),
    judged again by its margin; unfused where the extra is unknown (no copy bandwidth)."""
    if extra_ms is None:
        return replace(choice, fuse=False, reason=f"left unfused: {why}, and its cost is unknown ({choice.reason})")
    t_f = choice.t_fused_ms + extra_ms
    fuse = t_f < choice.t_unfused_ms * (1.0 - measure.margin_for(choice.config))
    verdict = "fused" if fuse else "left unfused: fusion would not win"
    return Choice(fuse, choice.config, f"{verdict} ({t_f:.4g} ms fused with {extra_ms:.4g} ms more: {why}; "
                                       f"{choice.reason})", t_f, choice.t_unfused_ms)


TABLE = measure.TABLE


def _table_choice(key, device, what: str, margin: Optional[float]) -> tuple[Choice, Optional[dict]]:
    """The default mode's decision (tuning/table.py): the verdict on the table's bracketing points and on the
    times interpolated between them, fused only where all three win; the entry (the estimate, with the
    nearer point's configuration) is kept in this process for the launches' ``tuned_config``."""
    cached = measure.lookup(key)
    if cached is not None and cached.get("unfused_by") not in (None, measure.LAUNCH_ONLY, TABLE) \
            and cached.get("t_unfused_ms") is not None:
        # measured before in this mode (config.tuning.measure = True once): the measurement decides
        return _judge(cached, device, what, margin, "measured"), cached
    points, why = table.lookup(key, device, measure._context())
    if points is None:
        return Choice(False, "-", f"left unfused: {why} (the default mode decides from the project's measured "
                                  "table without timing; mode='max-autotune' or config.tuning.measure = True "
                                  "measures this shape)"), None
    lo, hi, est = points

    def tabled(p: dict) -> dict:  # a table point as a decision entry, keeping what it was measured against
        return {**p, "unfused_by": TABLE, "measured_unfused_by": p.get("unfused_by")}

    entry = tabled(est)
    span = f"M {lo['M']}" if lo is hi else f"M {lo['M']}..{hi['M']}"
    how = f"estimated from the {table.measured_by(device)} at {span}:"
    choice = _judge(entry, device, what, margin, how)
    if choice.fuse and not all(_judge(tabled(p), device, what, margin, how).fuse for p in (lo, hi)):
        choice = replace(choice, fuse=False, reason=choice.reason.replace(
            "fused (", "left unfused: a measured point beside this shape did not win (", 1))
    measure.store(key, entry)
    return choice, entry


def _describe(t: torch.Tensor, op: str) -> str:
    if t.device.type != "cuda":
        return f"fusenorm::{op} ({t.device.type}: plain-torch reference)"
    return f"fusenorm::{op} (cuda: Triton)"
