"""Deferred normalization (``fusenorm::deferred_mm``): which configuration a launch runs, and whether a norm
site is deferred at all.

- ``stats_tile``: the width of the column tiles the producer writes statistics for (a divisor of every
  configuration's N tile, so each CTA writes whole partials of its own tile).
- ``unsupported`` / ``deferred_candidates`` / ``deferred_config``: the kernel backends' configurations
  (backends/: our Gluon kernel, kernels/hopper/deferred_mm.py, and quack's GEMMs where installed), pooled, and
  the one a launch runs: each GEMM's candidates timed against each other, the fastest cached under
  ``deferred_key`` (tuning/measure.py), else the first candidate.
- ``site_choice``: the pattern's compile-time decision for one norm site (patterns/deferred_norm.py): the
  fused GEMMs of the site (the producer that writes the statistics, each consumer that applies them) timed
  against the unfused site: Inductor's own code for it where it compiles (tuning/baseline.py; the fused
  GEMMs then run as one sequence, timed in turn with it), else cuBLAS's GEMMs plus the norm at copy speed;
  by tuning/decide.py's rules. Where nothing is measured (CPU, measuring off, deterministic mode), a site
  whose producer is a GEMM is deferred; one whose input comes from pointwise code is left to Lazy Pre-Norm
  (which computes the statistics in its consumer's mainloop) while that pattern is on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import backends, config
from ..backends import DeferredArgs, DeferredCase
from . import baseline, decide, measure
from .decide import Choice, _choice

__all__ = ["Consumer", "Producer", "Site", "deferred_candidates", "deferred_config", "deferred_key", "dgrad_unsupported", "fp32_output_gemm",
           "site_choice", "stats_tile", "unsupported", "x_tile"]

STATS_TILE = 128  # the narrowest N tile the Gluon candidates use where rows are wider than it


def stats_tile(n: int) -> int:
    """Columns per statistics tile for rows of n: 128, or the one power-of-two tile a narrower row takes."""
    from ..kernels.hopper.common import pow2_tile

    return min(STATS_TILE, pow2_tile(n))


def x_tile(n: int, has_producer: bool) -> int:
    """The statistics tile of the norm's input x [M, n] as the consumers read it: the producer GEMM's tiles
    (``stats_tile``), or, where x comes from anything else, one tile of the whole row (the aten row
    reduction the rewrite adds, which Inductor fuses into the kernel that computes x). The decision times the
    consumers on statistics of this layout: another one is another kernel specialization, and another key."""
    return stats_tile(n) if has_producer else n


def unsupported(case: DeferredCase) -> Optional[str]:
    """Why no kernel backend can take this GEMM of a deferred norm (each backend's reason: backends/); None
    when one can."""
    return backends.deferred_unsupported(case)


def dgrad_unsupported(x: Tensor, width: int) -> Optional[str]:
    """Why no backend can take the input-gradient GEMM of a deferred norm's backward (the consumers' scaled
    gradients [M, width] times their folded weights [width, N], x [M, N] the residual, with the norm's
    backward as per-row residual terms); None when one can, or off CUDA (the reference runs there)."""
    if x.device.type != "cuda":
        return None
    rows = x.new_empty((3, x.shape[0]), dtype=torch.float32)
    return unsupported(DeferredCase(x.new_empty((x.shape[0], width)), x.new_empty((width, x.shape[1])),
                                    residual=x, res_rows=rows))


@functools.cache
def fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch and device run a 16-bit GEMM with an fp32 result (``torch.mm(..., out_dtype=)``): a
    deferred backward's weight gradients use it (kernels/deferred.py ``mm_fp32``). Tried once per device and
    dtype on tiny real tensors; off CUDA the product is taken in fp32 instead."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return True
    try:
        with measure.RealInputs():
            a = torch.ones((16, 16), dtype=dtype, device=device)
            return bool(torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32)
    except Exception:  # noqa: BLE001 - any failure means: not available here
        return False


def deferred_candidates(a: Tensor, b: Tensor, out_tile: int, residual: Optional[Tensor] = None,
                        res_rows: Optional[Tensor] = None, out_norm: Optional[int] = None, a_norm: int = 0) -> list:
    """Every backend's candidates for this GEMM (``out_norm``: the norm its statistics serve, RMSNorm where a
    tile is given and no norm is named; ``a_norm``: the norm it applies to a)."""
    if out_norm is None:
        out_norm = 1 if out_tile else 0
    return backends.deferred_candidates(DeferredCase(a, b, None, residual, a_norm, out_norm, out_tile, res_rows))


def deferred_key(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_norm, out_norm, out_tile, res_rows=None
                 ) -> tuple:
    return ("deferred_mm", a.device, measure.spec(a, rows=True), measure.spec(b), measure.spec(bias),
            measure.spec(residual), measure.spec(a_stats), measure.spec(norm_weight), measure.spec(norm_bias),
            int(a_norm), int(out_norm), int(out_tile), None if res_rows is None else int(res_rows.shape[0]))


def key_of(d: DeferredArgs) -> tuple:
    """``deferred_key`` of one call's arguments."""
    return deferred_key(d.a, d.b, d.bias, d.residual, d.a_stats, d.norm_weight, d.norm_bias, d.a_norm, d.out_norm,
                        d.out_tile, d.res_rows)


def candidates_of(d: DeferredArgs) -> list:
    """``deferred_candidates`` of one call's arguments."""
    return deferred_candidates(d.a, d.b, d.out_tile, d.residual, d.res_rows, d.out_norm, d.a_norm)


def deferred_config(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm,
                    out_tile, cache_fold=False, res_rows=None):
    """The GemmConfig a launch runs for these (real) arguments (``measure.tuned_config``: never a timing)."""
    return measure.tuned_config(
        deferred_key(a, b, bias, residual, a_stats, norm_weight, norm_bias, a_norm, out_norm, out_tile, res_rows),
        a.device,
        lambda: deferred_candidates(a, b, out_tile, residual, res_rows, out_norm, a_norm))


# ----------------------------------------------------------------------------------------------------------
# The site's decision
# ----------------------------------------------------------------------------------------------------------


# What the producer of a site's statistics is: the GEMM ``a @ b`` (+ ``bias``) (+ ``residual``) whose epilogue
# writes them, and, where it is itself a link of a tower, the norm it applies to ``a`` (its partial statistics
# ``a_stats``, affine, eps, code ``a_norm`` and statistics tile ``a_tile``; none: ``a_norm`` 0): its own
# ``deferred_mm`` arguments, the statistics it writes (out_norm, out_tile) left for the site to fill in.
Producer = DeferredArgs


class Consumer(NamedTuple):
    """A GEMM of a site that applies the norm to what it reads: its weight operand ``b`` [N, N2] (the norm's
    affine is folded into it) and bias."""

    b: Tensor
    bias: Optional[Tensor] = None


class Site:
    """One norm site as the decision sees it (example values; fake ones at compile time):
    ``producer``: the ``Producer`` of the statistics (None where the norm's input comes from pointwise code),
    ``consumers``: the ``Consumer`` GEMMs that apply the norm,
    ``x``: the norm's input [M, N]; the norm's (weight, bias, eps, code); ``wgrads``: weight gradients that
    read norm(x) rebuilt in the backward (training); ``cache``: whether the fold is kept between calls;
    ``dgrad``: training with the norm's backward deferred too, the width of its input-gradient GEMM's operand
    (the consumers' outputs together; 0: the backward stays Inductor's, with norm(x) rebuilt), and
    ``g_passes`` the [M, dgrad] passes of the kernel that scales the gradients into that operand: 1 (its
    write) where Inductor's pointwise code computes them anyway, 2 (a read too) where they come from a GEMM
    or from the graph's caller. ``training``: the graph has a backward, and the decision judges the whole
    step (``_measure_step``)."""

    def __init__(self, x, producer, consumers, weight, norm_bias, eps, norm, wgrads, cache, dgrad=0, g_passes=1,
                 training=False):
        self.x = x
        self.producer = None if producer is None else Producer(*producer)
        self.consumers = [Consumer(*c) for c in consumers]
        self.weight, self.norm_bias, self.eps, self.norm = weight, norm_bias, eps, norm
        self.wgrads, self.cache, self.dgrad, self.g_passes = wgrads, cache, dgrad, g_passes
        self.training = training

    def key(self) -> tuple:
        p = self.producer
        prod = None if p is None else (
            measure.spec(p.a, rows=True), measure.spec(p.b), measure.spec(p.bias), measure.spec(p.residual),
            measure.spec(p.a_stats), p.a_eps, p.a_norm)
        return ("deferred_site", self.x.device, measure.spec(self.x, rows=True), prod,
                tuple((measure.spec(c.b), measure.spec(c.bias)) for c in self.consumers),
                measure.spec(self.weight), measure.spec(self.norm_bias), int(self.norm), int(self.wgrads),
                bool(self.cache), int(self.dgrad), int(self.g_passes), bool(self.training))


def site_choice(site: Site) -> Choice:
    """Whether to defer this site's norm (``fuse``), with the configuration label and the reason."""
    x = site.x
    on_cuda = x.device.type == "cuda"
    decided = measure.can_measure(x.device) or measure.decisions(x.device) == "table"  # times, measured or tabled
    measured = on_cuda and decided and not torch.are_deterministic_algorithms_enabled()
    if not measured and site.producer is None and config.patterns.norm_linear_fwd:
        return Choice(False, "-", "not measured: a norm of pointwise code is left to Lazy Pre-Norm "
                                  "(norm_linear_fwd) where nothing is timed")
    if not on_cuda:
        return Choice(True, f"{x.device.type} reference", f"fused (not measured on {x.device.type.upper()})")
    gemms = [(x, c.b, None, site.norm, 0, 0) for c in site.consumers]
    if site.producer is not None:
        p = site.producer
        gemms.append((p.a, p.b, p.residual, p.a_norm, site.norm, stats_tile(x.shape[1])))
    for a, b, residual, a_norm, out_norm, out_tile in gemms:
        why = unsupported(DeferredCase(a, b, None, residual, a_norm, out_norm, out_tile))
        if why is not None:
            return Choice(False, "-", f"not deferred: no kernel backend takes a GEMM of the site ({why})")
    choice = _choice(site.key(), x.device, lambda: _measure_site(site), lambda: "deferred_mm's first candidates",
                     what="Inductor's unfused site (or cuBLAS GEMMs + the norm at copy speed)",
                     step_fn=(lambda: _measure_step(site)) if site.training else None,
                     margin=config.tuning.margin_deferred)
    entry = measure.lookup(site.key()) if choice.t_fused_ms is not None else None
    labels = entry.get("gemm_labels") if entry else None
    if choice.fuse and entry is not None and entry.get("unfused_by") == decide.TABLE:
        why = _keep_table_configs(site, labels)
        if why is not None:
            return dataclasses.replace(choice, fuse=False, reason=f"left unfused: {why} ({choice.reason})")
    if isinstance(labels, list) and labels and all(isinstance(v, str) for v in labels):
        # every GEMM's own choice (the entry's configuration is the first GEMM's): which backend runs each
        chosen = " + ".join(labels)
        choice = dataclasses.replace(choice, config=chosen, reason=choice.reason.replace(f"[{choice.config}]",
                                                                                         f"[{chosen}]"))
    return choice


# The compile whose training step ``_measure_step`` times: fusenorm deferring every site it can, unmeasured
# (the GEMMs run the configurations ``_measure_site`` stored), and no other fusion taking the site first.
STEP_PATCHES = {"tuning.measure": False, "debug_dir": None, "patterns.linear_norm_fwd": False,
                "patterns.norm_linear_fwd": False, "patterns.dgrad_norm_bwd": False,
                "patterns.attention_block": False}


def _measure_step(site: Site) -> dict:
    """One training step of the site both ways, on random inputs like the (possibly fake) ones: the site
    compiled by fusenorm with its norm deferred (the backward the deferred rewrite makes of it) against
    Inductor's forward and backward of it unfused; {} where either cannot be compiled or timed. The
    forward-only comparison estimates what the backward adds (a rebuild of norm(x), the deferred dgrad);
    this times it: a forward that wins can still cost the step more than it saves."""
    dev = site.x.device
    like = measure.RealInputs.like
    with measure.RealInputs():
        if site.producer is not None:
            p = site.producer
            a, b, bias, residual = measure.real_gemm_operands(p.a, p.b, p.bias, p.residual)
        else:  # the norm's input from pointwise code: an add, into which Inductor fuses the statistics' reduction
            a, b, bias, residual = like(site.x, dev), None, None, like(site.x, dev)
        consumers = [tuple(measure.real_gemm_operands(site.x, c.b, c.bias)[1:]) for c in site.consumers]
        weight, norm_bias = like(site.weight, dev), like(site.norm_bias, dev)
    fn, inputs = baseline.norm_site_fn(a, b, bias, residual, weight, norm_bias, site.eps, site.norm == 1, consumers,
                                       with_y=False)
    timed = baseline.time_training_steps(
        lambda leaves: baseline.compile_fused(fn, leaves, STEP_PATCHES, "deferred_norm"),
        lambda leaves: baseline.compile_unfused(fn, leaves, training=True), inputs, "deferred norm site")
    return {} if timed is None else {"t_fused_step_ms": timed[0], "t_unfused_step_ms": timed[1]}


def _keep_table_configs(site: Site, labels) -> Optional[str]:
    """Each GEMM's configuration as the table's point measured it (``labels``), kept in this process for the
    launches; None, or why not (the labels do not fit this site's GEMMs and candidates)."""
    calls = _gemm_calls(site, real=False)
    if not isinstance(labels, list) or len(labels) != len(calls):
        return "the table's point does not name a configuration for each GEMM of the site"
    for call, label in zip(calls, labels):
        best = next((c for c in candidates_of(call) if c.label() == label), None)
        if best is None:
            return f"the table's configuration {label} is not a candidate here"
        measure.store(key_of(call),
                      {"config": list(best), "t_fused_ms": None, "t_unfused_ms": None, "unfused_by": decide.TABLE})
    return None


def _gemm_calls(site: Site, real: bool) -> list[DeferredArgs]:
    """The site's GEMMs as ``deferred_mm``'s arguments, in the compiled graph's order: the producer (if any),
    each consumer, the backward's input-gradient GEMM (``site.dgrad``). ``real``: random real tensors on the
    GPU (inside ``measure.RealInputs``, for timing); else the site's own (fake) tensors and empty statistics
    of the right shape, enough for the launches' keys and candidates (the table's decisions)."""
    from ..kernels import deferred as op

    x, norm = site.x, site.norm
    m, n = x.shape
    tile = stats_tile(n)  # what the producer writes
    x_stats_tile = x_tile(n, site.producer is not None)  # what the consumers read
    dev = x.device

    def like(t, scale=None):
        if not real or t is None:
            return t
        return measure.RealInputs.like(t, dev) if scale is None else measure.RealInputs.like(t, dev, scale)

    def stats(t, nrm, tl):
        return op.partial_stats(t, nrm, tl) if real else t.new_empty(op.stats_shape(t.shape[0], t.shape[1], nrm, tl),
                                                                     dtype=torch.float32)

    def operands(a, b, *others):
        return measure.real_gemm_operands(a, b, *others) if real else [a, b, *others]

    rx, rw, rnb = like(x), like(site.weight), like(site.norm_bias)
    x_stats = stats(rx, norm, x_stats_tile)
    calls: list[DeferredArgs] = []
    if site.producer is not None:  # writes the statistics of x in its tiles
        p = site.producer
        ra, rb, rbias, rres = operands(p.a, p.b, p.bias, p.residual)
        calls.append(p._replace(a=ra, b=rb, bias=rbias, residual=rres,
                                a_stats=stats(ra, p.a_norm, p.a_tile) if p.a_norm else None,
                                norm_weight=like(p.norm_weight), norm_bias=like(p.norm_bias),
                                out_norm=norm, out_tile=tile, cache_fold=site.cache))
    for cons in site.consumers:  # each applies the norm to x
        _, rb, rbias = operands(x, cons.b, cons.bias)
        calls.append(DeferredArgs(rx, rb, rbias, None, x_stats, rw, rnb, site.eps, norm, x_stats_tile,
                                  cache_fold=site.cache))
    if site.dgrad:
        # the backward's GEMM of the consumers' scaled gradients, the norm's backward in its epilogue
        a = torch.empty((m, site.dgrad), dtype=x.dtype, device="meta")
        b = torch.empty((site.dgrad, n), dtype=x.dtype, device="meta")
        ga, gb = (measure.real_gemm_operands(a, b, device=dev) if real else
                  [x.new_empty((m, site.dgrad)), x.new_empty((site.dgrad, n))])
        rows = (like(torch.empty((1 if norm == 1 else 3, m), device="meta")) if real
                else x.new_empty((1 if norm == 1 else 3, m), dtype=torch.float32))
        calls.append(DeferredArgs(ga, gb, residual=rx, res_rows=rows))
    return calls


def _measure_site(site: Site) -> dict:
    """The site's fused GEMMs (each candidate of each GEMM timed, the best kept under its own key for the
    launches) against the unfused site."""
    x, norm = site.x, site.norm
    m, n = x.shape
    dev = x.device

    def gemm(k: int) -> tuple[Tensor, Tensor]:
        """Real operands [M, k] @ [k, N] (the backward's GEMMs), as ``real_gemm_operands`` makes them."""
        return tuple(measure.real_gemm_operands(torch.empty((m, k), dtype=x.dtype, device="meta"),
                                                torch.empty((k, n), dtype=x.dtype, device="meta"), device=dev))

    with measure.RealInputs():
        calls = _gemm_calls(site, real=True)
        first = calls[1 if site.producer is not None else 0]  # the first consumer's: x, the norm's γ and β
        rx, rw, rnb = first.a, first.norm_weight, first.norm_bias
        labels, best_all, hosts, launches, times_best = {}, [], [], [], []
        for args in calls:
            key = key_of(args)
            best, times = measure.time_candidates(candidates_of(args), _planned(args))
            measure.store(key, measure.make_launch_entry(best, times), bucket=True)
            times_best.append(times[best])
            best_all.append(best)
            # Each GEMM of the site is its own call in the compiled graph: the site pays their host times, each
            # through the cached launch plan, as the op's CUDA path calls it.
            made: list = []
            launches.append(lambda args=args, best=best, made=made: made[0](*args) if made
                            else backends.deferred_launch(args, best, _alloc, made))
            hosts.append(measure.fused_host_us(launches[-1], times[best]))
            labels.update({f"GEMM {len(best_all)}: {c.label()}": t for c, t in times.items()})
        forward = calls[:-1] if site.dgrad else calls
        t_gemms = sum(measure.gemm_ms(c.a, c.b, c.bias) for c in forward)
        # What the unfused norm adds to the GEMMs, in [M, N] passes at copy speed: after a GEMM, a kernel that
        # reads x and writes n (with a residual add, it reads the GEMM's output and the residual and writes x
        # too); after pointwise code, the write of n, in the kernel that computes x anyway.
        passes = 1 if site.producer is None else (4 if site.producer.residual is not None else 2)
        t_norm = measure.norm_proxy_ms(m, n, x.dtype, passes, x.device)
        t_bwd = 0.0  # what the unfused backward pays that the fused one does not run at all
        if site.dgrad:
            # The backward: the fused side's GEMM is timed above, plus its operand's write (the scaled
            # gradients); the unfused side runs cuBLAS's input-gradient GEMMs and the norm's backward kernel
            # (read dy and x, write dx: three passes).
            t_extra = measure.norm_proxy_ms(m, site.dgrad, x.dtype, site.g_passes, x.device)
            if t_extra is not None and site.producer is not None and site.producer.bias is not None:
                # the producer's bias gradient, a column sum of dx: its own pass over the GEMM's output, where
                # Inductor's norm backward may sum it in the kernel that writes dx
                t_extra += measure.norm_proxy_ms(m, n, x.dtype, 1, x.device)
            t_bwd = measure.plus(sum(measure.gemm_ms(*gemm(c.b.shape[1]), None) for c in site.consumers),
                                 measure.norm_proxy_ms(m, n, x.dtype, 3, x.device))
        else:
            # norm(x) rebuilt in the backward for the weight gradients: one write, fused into the norm's backward
            t_extra = measure.norm_proxy_ms(m, n, x.dtype, 1, x.device) if site.wgrads else 0.0
        if t_norm is None or t_extra is None or t_bwd is None:
            t_est, t_extra = None, 0.0
        else:
            t_est = t_gemms + t_norm + t_bwd
        t_forward = sum(times_best[:len(forward)])
        built = None
        if site.producer is not None:
            p0 = calls[0]
            built = baseline.norm_site_fn(p0.a, p0.b, p0.bias, p0.residual, rw, rnb, site.eps, norm == 1,
                                          [(c.b, c.bias) for c in calls[1:len(forward)]])
        ind = None
        if built is not None and baseline.enabled(x.device):
            # The forward's GEMMs, in the graph's order, timed in turn with Inductor's site: the fused side's
            # forward is that sequence's median, not the sum of its GEMMs each timed alone at another moment.
            def forward_sequence(run=launches[:len(forward)]):
                for launch in run:
                    launch()

            timed = baseline.time_compiled(*built, "norm site", against=forward_sequence)
            if timed is not None:
                t_forward, ind = timed[2], timed[:2]
        if ind is not None and site.dgrad:
            ind = None if t_bwd is None else (ind[0] + t_bwd, ind[1])
        t_fused = t_forward + sum(times_best[len(forward):]) + t_extra
    best = best_all[0]
    h_fused = None if None in hosts else sum(hosts)
    entry = measure.make_entry(best, {best: t_fused}, t_est, h_fused, ind)
    entry["candidates"] = labels
    entry["gemm_labels"] = [c.label() for c in best_all]
    return entry


def _planned(args: tuple):
    """``run(candidate)`` for ``measure.time_candidates``: the candidate's first call makes its launch plan (as
    the op's hot path does: compiles, resolves the kernel), every later one, captured in a CUDA graph by the
    timing, only launches it."""
    plans: dict = {}

    def run(c):
        plan = plans.get(c)
        if plan is not None:
            return plan(*args)
        made: list = []
        out = backends.deferred_launch(args, c, _alloc, made)
        if made:
            plans[c] = made[0]
        return out

    return run


def _alloc(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)
