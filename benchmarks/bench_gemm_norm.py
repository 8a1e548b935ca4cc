"""GEMM + norm benchmark: how much of the norm's time fusenorm's fused kernels hide, shape by shape.

Grid: M = 262144 rows (``--rows``), bf16, K x N (``--K``, ``--N``), LayerNorm / RMSNorm (``--norms``), affine
off / on (``--affine``; "on" = a weight ~ 1 + 0.1 randn and, for LayerNorm, a bias ~ 0.1 randn), forward /
backward (``--dirs``). Inputs are randn, GEMM weights scaled by 1/sqrt(K); eps 1e-5 (LN), 1e-6 (RMS).
Per point, four timings of GPU work (``--timer cudagraph``: ``do_bench_cudagraph``, GPU time alone;
``events``: ``do_bench``), medians; cuBLAS, the unfused function, the fused op and its GEMM base are timed
in ``--rounds`` alternating rounds (median of the rounds). fusenorm runs its Gluon sm_90 kernels where they
apply (``config.gluon``, on by default; ``--no-gluon``: the ``tl`` kernels); t_base_ms is the GEMM core of
the kernel timed with a plain epilogue (the fused kernel's own configuration, cluster schedule included), and
t_core_ms the GEMM core alone as a plain GEMM would run it (tile schedule, the fastest of
``plain_candidates``) against cuBLAS timed in the same rounds (t_mm_core_ms; once per direction and K x N, in
the direction's layout; ``--core-only`` measures just that, forward layout, for the grid's K x N and
``--merge`` attaches it to the forward points). Backward points also time every Gluon candidate once
(candidates_ms):

fwd  ``y = norm(a @ W.T)``, a [M, K], W [N, K] (an nn.Linear weight); all under no_grad
    t_mm       cuBLAS ``torch.mm(a, W.t())``
    t_norm     Inductor's norm alone on h [M, N]                           (torch.compile, dynamic=False)
    t_unfused  Inductor's ``norm(F.linear(a, W))``: cuBLAS GEMM, then Inductor's norm kernel
    t_fused    ``fusenorm::mm_norm(a, W.t(), ...)`` as fusenorm runs it under no_grad: y (and mean/rstd) only;
               ``--fwd-save-normed`` times what a training forward with an affine norm runs instead
               (save_normed: hh written beside y for the backward, one more [M, N] write)
bwd  data gradient of ``z = norm(h) @ W2.T`` (W2 [K, N]), regrouped: ``dx = norm_backward(dz @ W2)``
    t_mm       cuBLAS ``torch.mm(dz, W2)``
    t_norm     Inductor's norm backward alone on dn [M, N]: dx, and dw (db) with affine
    t_unfused  Inductor's ``norm_backward(torch.mm(dz, W2))``
    t_fused    ``fusenorm::mm_norm_backward(dz, W2, ...)`` from the saved normalized hh

Reported per point:
    hidden           (t_unfused - t_fused) / t_norm, the seed's metric: the share of the norm's time the fused
                     kernel removes (1 = all of it, < 0 = the fused kernel is slower than unfused);
    hidden_fusenorm  the same for what fusenorm runs: its dispatch (``ops.tuning``) may keep a shape unfused,
                     then t_fusenorm = t_unfused and this is 0 ("path" says which it chose);
    fused/mm; norm_share = t_norm / t_unfused; the fused op's TFLOP/s and GB/s (bytes = its least traffic),
    and floor% = floor / t_fused with floor = max(flops / matmul peak, bytes / copy bandwidth), both ceilings
    measured in the same run; peak memory of each timed call; max |fused - unfused| of the main output.
Summaries per (norm, direction, affine) and per (norm, direction) use the points where the norm is at least
``--min-share`` (10%) of the unfused time.

Run on the GPU machine. The output is written after every point, so a run stopped by a time limit keeps its
rows; the same command with ``--resume`` measures only the missing points. The whole grid likely takes more
than one 10-minute call (compiles, and fusenorm's dispatch measuring its candidates per shape): split it.
    python benchmarks/bench_gemm_norm.py                     # -> benchmarks/results/gemm_norm_h200.{json,png}
    python benchmarks/bench_gemm_norm.py --dirs fwd --out /tmp/gn_fwd.json
    python benchmarks/bench_gemm_norm.py --dirs bwd --out /tmp/gn_bwd.json
    python benchmarks/bench_gemm_norm.py --merge /tmp/gn_fwd.json /tmp/gn_bwd.json \\
        --out benchmarks/results/gemm_norm_h200.json
    python benchmarks/bench_gemm_norm.py --plot-only benchmarks/results/gemm_norm_h200.json
    python benchmarks/bench_gemm_norm.py --dry-run           # CPU, tiny shapes: checks the calls, not speed

Compiling the ~240 Inductor functions one after another would take longer than timing them, so
``--precompile-workers J`` subprocesses of this script first compile (and run once) their share into a fresh
Inductor cache directory; the main process then compiles the same functions again (FX graph cache hits) and
times them alone on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cached_property
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the shared harness: timers, rounds, peak memory, environment, JSON, PNG)
from common import Bench, png_path, pyplot, write_json  # noqa: E402

DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16 element
FWD_SAVE_NORMED = False  # --fwd-save-normed
EPS = {"layer": 1e-5, "rms": 1e-6}
DEFAULTS = {"rows": 262144, "K": "256,512,1024,2048,4096", "N": "128,256,512,1024,2048,4096,8192"}
DRY_DEFAULTS = {"rows": 64, "K": "32", "N": "40"}
DEFAULT_OUT = "benchmarks/results/gemm_norm_h200.json"
STAT_CHUNK = 32768  # rows per chunk when computing mean/rstd/hh: keeps fp32 temporaries small


# ----------------------------------------------------------------------------------------------------------
# The grid: points, and the Inductor functions they need
# ----------------------------------------------------------------------------------------------------------


class Point(NamedTuple):
    dir: str  # "fwd" | "bwd"
    K: int
    N: int
    norm: str  # "layer" | "rms"
    affine: bool


class Job(NamedTuple):
    """One Inductor-compiled function. t_norm depends on neither K nor the GEMM, so it is compiled and timed
    once per (dir, N, norm, affine) and shared by all K (K is None then)."""

    dir: str
    kind: str  # "norm" | "unfused"
    K: int | None
    N: int
    norm: str
    affine: bool


def grid(args) -> list[Point]:
    return [
        Point(d, k, n, norm, aff)
        for d in args.dirs for k in args.K for n in args.N for norm in args.norms for aff in args.affine
    ]


def norm_job(p: Point) -> Job:
    return Job(p.dir, "norm", None, p.N, p.norm, p.affine)


def unfused_job(p: Point) -> Job:
    return Job(p.dir, "unfused", p.K, p.N, p.norm, p.affine)


def jobs(points: list[Point]) -> list[Job]:
    """Every Inductor function of the grid, once, in the order the main process compiles them."""
    out: dict[Job, None] = {}
    for p in points:
        out.setdefault(norm_job(p))
        out.setdefault(unfused_job(p))
    return list(out)


# ----------------------------------------------------------------------------------------------------------
# Inputs of one point (made on first use, so a compile worker allocates only what its function reads)
# ----------------------------------------------------------------------------------------------------------


class Case:
    def __init__(self, p: Point | Job, m: int, device: str):
        self.p, self.m, self.device = p, m, device
        self.is_rms = p.norm == "rms"
        self.eps = EPS[p.norm]

    def _randn(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=DTYPE)
        return t.mul_(scale).add_(shift) if scale != 1.0 or shift else t

    @cached_property
    def weight(self):
        return self._randn(self.p.N, scale=0.1, shift=1.0) if self.p.affine else None

    @cached_property
    def norm_bias(self):
        return self._randn(self.p.N, scale=0.1) if self.p.affine and not self.is_rms else None

    # fwd
    @cached_property
    def a(self):
        return self._randn(self.m, self.p.K)

    @cached_property
    def W(self):  # [N, K], nn.Linear(K, N).weight
        return self._randn(self.p.N, self.p.K, scale=self.p.K**-0.5)

    # bwd
    @cached_property
    def dz(self):
        return self._randn(self.m, self.p.K)

    @cached_property
    def W2(self):  # [K, N], nn.Linear(N, K).weight: dn = dz @ W2
        return self._randn(self.p.K, self.p.N, scale=self.p.K**-0.5)

    @cached_property
    def dn(self):  # the norm backward's incoming gradient, for t_norm alone
        return self._randn(self.m, self.p.N)

    # both: h is the norm's input (fwd: t_norm alone; bwd: what the forward saw)
    @cached_property
    def h(self):
        return self._randn(self.m, self.p.N)

    @cached_property
    def stats(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(mean, rstd) of h in fp32 [M] (mean None for RMSNorm), as the forward saved them; in row chunks, so
        that the fp32 temporaries stay small (compile workers share the GPU's memory)."""
        mean = None if self.is_rms else torch.empty(self.m, device=self.device)
        rstd = torch.empty(self.m, device=self.device)
        for s, x in self._row_chunks():
            e = s + len(x)
            if self.is_rms:
                rstd[s:e] = torch.rsqrt(x.pow(2).mean(-1) + self.eps)
            else:
                var, mu = torch.var_mean(x, dim=-1, unbiased=False)
                mean[s:e], rstd[s:e] = mu, torch.rsqrt(var + self.eps)
        return mean, rstd

    @cached_property
    def hh(self):
        """The normalized h in bf16, what the fused forward saves (save_normed; y itself without affine)."""
        mean, rstd = self.stats
        hh = torch.empty_like(self.h)
        for s, x in self._row_chunks():
            e = s + len(x)
            centered = x if mean is None else x - mean[s:e, None]
            hh[s:e] = centered * rstd[s:e, None]
        return hh

    def _row_chunks(self):
        for s in range(0, self.m, STAT_CHUNK):
            yield s, self.h[s : s + STAT_CHUNK].float()


# ----------------------------------------------------------------------------------------------------------
# The functions timed
# ----------------------------------------------------------------------------------------------------------


def norm_forward(norm: str) -> Callable:
    eps = EPS[norm]
    if norm == "rms":
        return lambda h, w, b: F.rms_norm(h, (h.shape[-1],), w, eps)
    return lambda h, w, b: F.layer_norm(h, (h.shape[-1],), w, b, eps)


def layer_norm_backward(dn, h, mean, rstd, w, b):
    """Inductor's own LayerNorm backward: the aten op its decomposition handles (mean/rstd as [M, 1], as
    ``native_layer_norm`` returns them); dx, and dw/db when there is a weight/bias."""
    mask = [True, w is not None, b is not None]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dn, h, [h.shape[-1]], mean.unsqueeze(-1), rstd.unsqueeze(-1), w, b, mask
    )
    return (dx,) + tuple(g for g in (dw, db) if g is not None)


def rms_norm_backward(dn, h, mean, rstd, w, b):
    """RMSNorm backward in fp32, as Inductor's decomposition computes it: hh = h * rstd, dhh = dn * w,
    dx = rstd * (dhh - hh * mean(dhh * hh)), dw = sum_rows(dn * hh); dx and dw in the inputs' dtypes."""
    r = rstd.unsqueeze(-1)
    hh = h.float() * r
    dnf = dn.float()
    dhh = dnf * w.float() if w is not None else dnf
    dx = (r * (dhh - hh * (dhh * hh).mean(-1, keepdim=True))).to(dn.dtype)
    if w is None:
        return (dx,)
    return dx, (dnf * hh).sum(0).to(w.dtype)


def norm_backward(norm: str) -> Callable:
    return rms_norm_backward if norm == "rms" else layer_norm_backward


def inductor_function(job: Job, case: Case) -> tuple[Callable, tuple]:
    """The Python function of one Inductor timing and its arguments (norm weights passed as arguments, not
    captured, so the same graph is traced in the workers and in the main process)."""
    w, b = case.weight, case.norm_bias
    if job.dir == "fwd":
        nf = norm_forward(job.norm)
        if job.kind == "norm":
            return nf, (case.h, w, b)
        return (lambda a, W, w, b: nf(F.linear(a, W), w, b)), (case.a, case.W, w, b)
    nb = norm_backward(job.norm)
    mean, rstd = case.stats
    if job.kind == "norm":
        return nb, (case.dn, case.h, mean, rstd, w, b)
    return (lambda dz, W2, h, mean, rstd, w, b: nb(torch.mm(dz, W2), h, mean, rstd, w, b)), (
        case.dz, case.W2, case.h, mean, rstd, w, b,
    )


def compiled(job: Job, case: Case) -> Callable:
    fn, fargs = inductor_function(job, case)
    torch._dynamo.reset()  # one function at a time: no recompiles, no guards piling up on a shared code object
    cfn = torch.compile(fn, dynamic=False)  # dynamic shapes gave up-to-7x slower norm kernels (baselines)
    return lambda: cfn(*fargs)


def gemm_call(p: Point, case: Case) -> Callable:
    if p.dir == "fwd":
        a, W = case.a, case.W
        return lambda: torch.mm(a, W.t())
    dz, W2 = case.dz, case.W2
    return lambda: torch.mm(dz, W2)


def fused_op_args(p: Point, case: Case) -> tuple[Callable, tuple]:
    """The fused op and its arguments; tuning's forward_choice / backward_choice take the same ones."""
    if p.dir == "fwd":
        save = FWD_SAVE_NORMED and p.affine  # training with an affine norm saves hh for the backward
        args = (case.a, case.W.t(), None, None, case.weight, case.norm_bias, case.eps, case.is_rms, DTYPE, save)
        return torch.ops.fusenorm.mm_norm, args
    _, rstd = case.stats
    hh = case.hh
    # src = hh (without affine the forward saves y, which equals hh): src_is_normed, no mean needed
    args = (case.dz, case.W2, None, hh, case.weight, None, rstd, case.is_rms, True, case.norm_bias is not None, DTYPE)
    return torch.ops.fusenorm.mm_norm_backward, args


def fused_bytes(p: Point, m: int) -> int:
    """Least traffic of the fused op: each operand read once, each output written once."""
    k, n = p.K, p.N
    n_params = int(p.affine) + int(p.affine and p.norm == "layer")  # weight, bias
    if p.dir == "fwd":  # a, W, y, hh (save_normed), rstd (+ mean), weight/bias
        outs = 1 + int(p.affine and FWD_SAVE_NORMED)
        return ELEM * (m * k + n * k + outs * m * n + n_params * n) + 4 * m * (1 if p.norm == "rms" else 2)
    # dz, W2, src, dx, rstd, weight, dw/db (fp32)
    return ELEM * (m * k + k * n + 2 * m * n) + 4 * m + ELEM * n * int(p.affine) + 4 * n * n_params


# ----------------------------------------------------------------------------------------------------------
# Ceilings (the timers, rounds and peak memory are common.py's: Bench, alternating)
# ----------------------------------------------------------------------------------------------------------


def measure_ceilings(bench: Bench, device: str, dry: bool) -> dict:
    """bf16 matmul peak (cuBLAS, 8192^3) and copy bandwidth (read + write of a 1 GiB tensor by a wide Triton
    copy kernel, the one fusenorm's dispatch uses: torch's copy_ reaches only ~2/3 of it on the H200)."""
    n = 256 if dry else 8192
    numel = (1 << 20) if dry else (1 << 29)  # 1 GiB of bf16: far beyond L2
    if device == "cuda":
        from fusenorm_inductor.tuning import measure

        copy_gbps = measure.copy_bandwidth_gbps(torch.device("cuda"))
    else:
        copy_gbps = 2 * numel * ELEM / _time_copy(bench, device, numel) / 1e6
    return {
        "matmul_tflops": 2 * n**3 / _time_matmul(bench, device, n) / 1e9,
        "matmul_shape": n,
        "copy_gbps": copy_gbps,
        "copy_bytes": numel * ELEM,
    }


def _time_matmul(bench: Bench, device: str, n: int) -> float:
    x = torch.randn(n, n, device=device, dtype=DTYPE)
    y = torch.randn(n, n, device=device, dtype=DTYPE)
    return bench.time_ms(lambda: torch.mm(x, y))[0]


def _time_copy(bench: Bench, device: str, numel: int) -> float:
    src = torch.empty(numel, device=device, dtype=DTYPE)
    dst = torch.empty_like(src)
    return bench.time_ms(lambda: dst.copy_(src))[0]


# ----------------------------------------------------------------------------------------------------------
# One point
# ----------------------------------------------------------------------------------------------------------


def dispatch(p: Point, op_args: tuple) -> dict:
    """fusenorm's fuse-or-not decision for the shape (ops.tuning), asked before t_fused is timed since it
    may autotune and cache. "n/a" when the module or the function does not exist (yet)."""
    return ask_choice("forward_choice" if p.dir == "fwd" else "backward_choice", op_args)


def ask_choice(name: str, op_args: tuple) -> dict:
    """The decision function ``name`` of the op's tuning module (``forward_choice`` in tuning/mm_norm.py,
    ``backward_choice`` in tuning/mm_norm_backward.py, ``prenorm_choice`` in tuning/norm_mm.py) on ``op_args``
    as row fields; "n/a" when the module or the function does not exist, the error recorded when it raises."""
    import importlib

    module = {"forward_choice": "mm_norm", "backward_choice": "mm_norm_backward", "prenorm_choice": "norm_mm"}
    try:
        tuning = importlib.import_module(f"fusenorm_inductor.tuning.{module.get(name, 'decide')}")
    except Exception as e:  # noqa: BLE001
        return {"path": "n/a", "fuse": None, "dispatch_error": f"import: {type(e).__name__}: {e}"}
    choose = getattr(tuning, name, None)
    if choose is None:
        return {"path": "n/a", "fuse": None}
    t0 = time.time()
    try:
        c = choose(*op_args)
    except Exception as e:  # noqa: BLE001 (a broken dispatch must not cost the timings)
        return {"path": "n/a", "fuse": None, "dispatch_error": f"{type(e).__name__}: {str(e)[:300]}"}
    fuse = bool(c.fuse)
    config = getattr(c, "config", None)
    return {
        "dispatch_s": time.time() - t0,  # wall time of the choice: its measurements, on the first call
        "fuse": fuse,
        "path": str(config) if fuse else "unfused",
        "dispatch_config": config,
        "dispatch_reason": getattr(c, "reason", None),
        "dispatch_t_fused_ms": getattr(c, "t_fused_ms", None),
        "dispatch_t_unfused_ms": getattr(c, "t_unfused_ms", None),
    }


def max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return max((float((x[s : s + STAT_CHUNK].float() - y[s : s + STAT_CHUNK].float()).abs().max())
                for s in range(0, x.shape[0], STAT_CHUNK)), default=0.0)


def run_point(p: Point, m: int, device: str, bench: Bench, shared: dict) -> dict:
    """The four timings of one point; a point that raises keeps what was measured and records the error."""
    row = {"M": m, "K": p.K, "N": p.N, "norm": p.norm, "affine": p.affine, "dir": p.dir}
    try:
        with torch.no_grad():
            _measure_point(p, m, device, bench, shared, row)
    except Exception as e:  # noqa: BLE001 (whatever broke, the rest of the grid still runs)
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()  # the next point's shapes differ: hand the memory back
    return row


def core_point(p: Point, m: int, device: str, bench: Bench) -> dict:
    """--core-only: the GEMM core against cuBLAS at the point's K x N, a row of its own (dir "core")."""
    row = {"M": m, "K": p.K, "N": p.N, "norm": None, "affine": None, "dir": "core"}
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            row.update(core_alone(p, Case(p, m, device), bench, {}))
        row["core_throughput"] = row["t_mm_core_ms"] / row["t_core_ms"]
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def _measure_point(p: Point, m: int, device: str, bench: Bench, shared: dict, row: dict) -> None:
    torch.manual_seed(0)
    case = Case(p, m, device)
    mm_fn = gemm_call(p, case)
    _record(row, "mm", bench.measure(mm_fn))
    _record(row, "norm", _shared(shared, norm_job(p), lambda: _norm_alone(p, m, device, bench)))
    unfused_fn = compiled(unfused_job(p), case)
    unfused = bench.measure(unfused_fn)
    _record(row, "unfused", unfused)
    torch._dynamo.reset()
    op, op_args = fused_op_args(p, case)
    row.update(dispatch(p, op_args))  # before t_fused: the choice may autotune
    fused_fn = lambda: op(*op_args)  # noqa: E731
    fused = bench.measure(fused_fn)
    _record(row, "fused", fused)
    ref = unfused["out"]
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    row["max_abs_diff"] = max_abs_diff(fused["out"][0], ref)  # y (fwd) or dx (bwd)
    del fused, unfused, ref
    timed = {"mm": mm_fn, "unfused": unfused_fn, "fused": fused_fn}
    if device == "cuda":
        row.update(core_alone(p, case, bench, shared))
        base, label = gemm_base(p, op_args)
        row["t_base_ms"], row["base_config"] = bench.measure(base)["ms"], label
        timed["base"] = base
        if p.dir == "bwd":
            row["candidates_ms"] = candidate_times(op_args, bench)
    alternate_rounds(bench, timed, row)


def candidate_times(op_args: tuple, bench: Bench) -> dict:
    """Every configuration the backward's dispatch would time, each timed once here (label -> ms, or why it
    did not run: a specialization that spills is refused)."""
    from fusenorm_inductor.kernels.triton import mm_norm_backward as bk
    from fusenorm_inductor.tuning import mm_norm_backward as bk_tuning

    dy, b, extra, src, weight, mean, rstd, _, _, _, dx_dtype = op_args
    out = {}
    for cfg in bk_tuning.backward_candidates(dy, b, b.shape[1], 2, (extra, src, weight, mean, rstd, dx_dtype)):
        try:
            out[cfg.label()] = bench.time_ms(lambda c=cfg: bk.mm_norm_backward_triton(*op_args, config=c))[0]
        except Exception as e:  # noqa: BLE001 (refused: spills, or a schedule that cannot run)
            out[cfg.label()] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def alternate_rounds(bench: Bench, fns: dict, row: dict) -> None:
    """``bench.rounds - 1`` more rounds of the point's timings, alternating (cuBLAS, Inductor's unfused
    function, the fused op, its GEMM base, then again), so slow drifts of clock or temperature hit all of
    them alike; each t_*_ms becomes the median over the rounds, the rounds kept as rounds_*."""
    if bench.rounds <= 1:
        return
    more = common.alternating(fns, bench.ms, bench.rounds - 1)
    times = {k: [row[f"t_{k}_ms"], *more[k]] for k in fns}
    for k, ts in times.items():
        row[f"t_{k}_ms"] = statistics.median(ts)
        row[f"rounds_{k}_ms"] = ts


CORE_FIELDS = ("t_mm_core_ms", "t_core_ms", "core_config", "core_configs_ms")


def core_alone(p: Point, case: Case, bench: Bench, shared: dict) -> dict:
    """The GEMM core with a plain epilogue on its tile schedule (``plain_candidates``: the configurations a
    plain GEMM would take, no cluster) against cuBLAS, both timed in the same alternating rounds, in the
    direction's layout: ``a @ W.t()`` (fwd; W [N, K]) or the data gradient ``dz @ W2`` (bwd; W2 [K, N]
    row-major); once per (dir, K, N), shared by the point's norms. t_core_ms is the fastest configuration's
    median."""
    key = ("core", p.dir, p.K, p.N)
    if key not in shared:
        from fusenorm_inductor.kernels.hopper import mm_norm as hopper

        a, b = (case.a, case.W.t()) if p.dir == "fwd" else (case.dz, case.W2)
        fns = {"cublas": lambda: torch.mm(a, b)}
        for cfg in hopper.plain_candidates(p.N, p.K):
            fns[cfg.label()] = plain_core(a, b, cfg)
        med = common.medians(common.alternating(fns, bench.ms, max(bench.rounds, 1)))
        best = min((k for k in med if k != "cublas"), key=med.get)
        shared[key] = {"t_mm_core_ms": med["cublas"], "t_core_ms": med[best], "core_config": best,
                       "core_configs_ms": {k: v for k, v in med.items() if k != "cublas"}}
    return dict(shared[key])


def gemm_base(p: Point, op_args: tuple) -> tuple[Callable, str]:
    """The fused kernel with the norm switched off (same configuration as t_fused): its GEMM alone, to
    compare with cuBLAS (t_base / t_mm)."""
    from fusenorm_inductor.kernels.triton import mm_norm_backward as bk
    from fusenorm_inductor.kernels.triton import mm_norm as fk
    from fusenorm_inductor.tuning import mm_norm as fk_tuning
    from fusenorm_inductor.tuning import mm_norm_backward as bk_tuning

    if p.dir == "fwd":
        cfg = fk_tuning.forward_config(*op_args)
        return (lambda: fk.mm_norm_triton(*op_args, config=cfg, gemm_only=True)), cfg.label()
    cfg = bk_tuning.backward_config(*op_args)
    if cfg.kind.startswith("gl_"):
        # the Gluon backward has no plain epilogue of its own: the core with the forward's plain one, the same
        # tile configuration and schedule, on the data-gradient operands (dz @ W2, W2 row-major)
        return plain_core(op_args[0], op_args[1], cfg), cfg.label()
    return (lambda: bk.mm_norm_backward_triton(*op_args, config=cfg, gemm_only=True)), cfg.label()


def plain_core(a: torch.Tensor, b: torch.Tensor, cfg) -> Callable:
    """``a @ b`` on the Gluon GEMM core in configuration ``cfg`` with its plain epilogue (the forward op with
    the norm switched off)."""
    from fusenorm_inductor.kernels.triton import mm_norm as fk

    return lambda: fk.mm_norm_triton(a, b, None, None, None, None, 1e-6, True, DTYPE, False, config=cfg,
                                     gemm_only=True)


def _norm_alone(p: Point, m: int, device: str, bench: Bench) -> dict:
    job = norm_job(p)
    return bench.measure(compiled(job, Case(job, m, device)))  # its own h / dn, freed once timed


def _shared(shared: dict, key, make: Callable[[], dict]) -> dict:
    """t_mm and t_norm: measured for the first point that needs them, reused by the others."""
    if key not in shared:
        shared[key] = {**make(), "out": None}  # outputs are not kept across points
    return shared[key]


def _record(row: dict, name: str, res: dict) -> None:
    row[f"t_{name}_ms"], row[f"peak_{name}_mib"] = res["ms"], res["peak_mib"]
    if res["note"]:
        row.setdefault("notes", []).append(f"{name}: {res['note']}")


# ----------------------------------------------------------------------------------------------------------
# Metrics and summary
# ----------------------------------------------------------------------------------------------------------

TIMES = ("t_mm_ms", "t_norm_ms", "t_unfused_ms", "t_fused_ms")


def complete(r: dict) -> bool:
    return "error" not in r and all(isinstance(r.get(t), (int, float)) for t in TIMES)


def derive(r: dict, ceilings: dict) -> dict:
    """Per-point metrics from the four timings and the run's ceilings (in place)."""
    if not complete(r):
        return r
    p = Point(r["dir"], r["K"], r["N"], r["norm"], r["affine"])
    m = r["M"]
    t_mm, t_norm, t_unf, t_fus = (r[t] for t in TIMES)
    flops, nbytes = 2 * m * p.K * p.N, fused_bytes(p, m)
    # What users get: without a dispatch (path n/a) fusenorm always fuses a matched pattern.
    t_fn = t_unf if r.get("fuse") is False else t_fus
    if isinstance(r.get("t_base_ms"), (int, float)):
        r["base_over_mm"] = r["t_base_ms"] / t_mm
    if isinstance(r.get("t_core_ms"), (int, float)):
        r["core_throughput"] = r["t_mm_core_ms"] / r["t_core_ms"]  # the core's throughput over cuBLAS's
    r.update({
        "hidden": (t_unf - t_fus) / t_norm,
        "t_fusenorm_ms": t_fn,
        "hidden_fusenorm": (t_unf - t_fn) / t_norm,
        "fused_over_mm": t_fus / t_mm,
        "norm_share": t_norm / t_unf,
        **throughput(flops, nbytes, t_fus, ceilings),
    })
    return r


def throughput(flops: int, nbytes: int, t_ms: float, ceilings: dict) -> dict:
    """flops, bytes, TFLOP/s and GB/s of a run of t_ms, and its floor = max(flops / matmul peak, bytes / copy
    bandwidth) with floor_frac = floor / t_ms."""
    floor = max(flops / (ceilings["matmul_tflops"] * 1e9), nbytes / (ceilings["copy_gbps"] * 1e6))
    return {"flops": flops, "bytes": nbytes, "tflops": flops / t_ms / 1e9, "gbps": nbytes / t_ms / 1e6,
            "floor_ms": floor, "floor_frac": floor / t_ms}


def summarize(rows: list[dict], min_share: float) -> list[dict]:
    """Per (norm, dir, affine) and per (norm, dir): hidden over the points whose norm is >= min_share of the
    unfused time (below that, a few % of noise in t_unfused swamps the norm)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["dir"] == "core":  # --core-only rows: no norm (merged into the forward points)
            continue
        aff = "on" if r["affine"] else "off"
        groups.setdefault((r["norm"], r["dir"], aff), []).append(r)
        groups.setdefault((r["norm"], r["dir"], "all"), []).append(r)
    out = []
    for (norm, d, aff), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "fwd", kv[0][2])):
        ok = [r for r in rs if complete(r)]
        sel = [r for r in ok if r["norm_share"] >= min_share]
        s = {"norm": norm, "dir": d, "affine": aff, "points": len(rs), "errors": len(rs) - len(ok),
             "considered": len(sel)}
        for key in ("hidden", "hidden_fusenorm"):
            vals = [r[key] for r in sel]
            s[f"median_{key}"] = statistics.median(vals) if vals else None
            s[f"min_{key}"] = min(vals) if vals else None
        s["fused_slower"] = sum(r["t_fused_ms"] > r["t_unfused_ms"] for r in sel)
        s["fusenorm_slower"] = sum(r["t_fusenorm_ms"] > r["t_unfused_ms"] for r in sel)
        s["dispatch_unfused"] = sum(r.get("fuse") is False for r in sel)
        s["missed_wins"] = sum(r.get("fuse") is False and r["t_fused_ms"] < r["t_unfused_ms"] for r in sel)
        # The fused kernel's GEMM with the norm off against cuBLAS, over the same points (target <= 1.10).
        base = [r["base_over_mm"] for r in sel if "base_over_mm" in r]
        s["median_base_over_mm"] = statistics.median(base) if base else None
        s["max_base_over_mm"] = max(base) if base else None
        # The GEMM core alone on its tile schedule (targets: median >= 0.97, min >= 0.93 of cuBLAS's throughput).
        core = [r["core_throughput"] for r in sel if "core_throughput" in r]
        s["median_core_throughput"] = statistics.median(core) if core else None
        s["min_core_throughput"] = min(core) if core else None
        out.append(s)
    return out


# ----------------------------------------------------------------------------------------------------------
# Output: table, summary, JSON, PNG
# ----------------------------------------------------------------------------------------------------------

HEADER = (f"{'K':>5} {'N':>5} {'norm':>5} {'aff':>3} {'dir':>3} | {'t_mm':>7} {'t_norm':>7} {'unfused':>7} "
          f"{'fused':>7} | {'hidden':>6} {'fn':>5} | {'f/mm':>5} | {'TFLOP/s':>7} {'GB/s':>6} {'floor%':>6} | "
          f"{'path':<22} | peak MiB fused/unfused")


def _fmt(x, spec: str, width: int) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-".rjust(width)


def row_line(r: dict) -> str:
    if r["dir"] == "core":
        return (f"{r['K']:5d} {r['N']:5d} core: cuBLAS {_fmt(r.get('t_mm_core_ms'), '.4f', 6)} ms, core "
                f"{_fmt(r.get('t_core_ms'), '.4f', 6)} ms [{r.get('core_config')}], throughput "
                f"{_fmt(r.get('core_throughput'), '.3f', 5)}x cuBLAS {r.get('error', '')}")
    head = f"{r['K']:5d} {r['N']:5d} {r['norm']:>5} {'on' if r['affine'] else 'off':>3} {r['dir']:>3} |"
    if not complete(r):
        return f"{head} error: {r.get('error', 'incomplete')[:150]}"
    times = " ".join(_fmt(r[t], "7.3f", 7) for t in TIMES)
    return (f"{head} {times} | {100 * r['hidden']:5.0f}% {100 * r['hidden_fusenorm']:4.0f}% | "
            f"{r['fused_over_mm']:5.2f} | {r['tflops']:7.1f} {r['gbps']:6.0f} {100 * r['floor_frac']:5.0f}% | "
            f"{str(r.get('path'))[:22]:<22} | {_fmt(r.get('peak_fused_mib'), '.0f', 1)}"
            f"/{_fmt(r.get('peak_unfused_mib'), '.0f', 1)}")


def print_table(rows: list[dict]) -> None:
    print(HEADER)
    for r in rows:
        print(row_line(r))


def print_summary(summary: list[dict], min_share: float) -> None:
    def pct(x):
        return f"{100 * x:6.0f}%" if x is not None else "      -"

    print(f"\nSummary over points with norm_share >= {100 * min_share:.0f}% "
          "(hidden: fused kernel; fn: what fusenorm runs after its dispatch)")
    print(f"{'norm':>5} {'dir':>3} {'aff':>3} | {'pts':>3} {'used':>4} {'err':>3} | {'med hid':>7} {'min hid':>7} | "
          f"{'med fn':>7} {'min fn':>7} | fused slower  fn slower  dispatch unfused (missed wins) | base/mm med max"
          " | core/cuBLAS throughput med min")
    for s in summary:
        print(f"{s['norm']:>5} {s['dir']:>3} {s['affine']:>3} | {s['points']:3d} {s['considered']:4d} "
              f"{s['errors']:3d} | {pct(s['median_hidden'])} {pct(s['min_hidden'])} | "
              f"{pct(s['median_hidden_fusenorm'])} {pct(s['min_hidden_fusenorm'])} | {s['fused_slower']:12d} "
              f"{s['fusenorm_slower']:10d} {s['dispatch_unfused']:17d} ({s['missed_wins']}) | "
              f"{_fmt(s.get('median_base_over_mm'), '.2f', 4)} {_fmt(s.get('max_base_over_mm'), '.2f', 4)} | "
              f"{_fmt(s.get('median_core_throughput'), '.3f', 5)} {_fmt(s.get('min_core_throughput'), '.3f', 5)}")


def hidden_panel(ax, cells: dict, ks: list, ns: list, min_share: float, cmap):
    """One heat map of % hidden over K (rows) x N (columns): cells {(K, N): row} with "hidden", "fuse" and
    "norm_share" (``complete`` rows); "u" marks fuse False, hatching norm_share < min_share. Returns the image."""
    import numpy as np
    from matplotlib.patches import Rectangle

    vals = np.full((len(ks), len(ns)), np.nan)
    for (k, n), r in cells.items():
        if complete(r):
            vals[ks.index(k), ns.index(n)] = 100 * r["hidden"]
    im = ax.imshow(np.clip(vals, -100, 100), cmap=cmap, vmin=-100, vmax=100, aspect="auto")
    for (k, n), r in cells.items():
        y, x = ks.index(k), ns.index(n)
        if not complete(r):
            ax.text(x, y, "err", ha="center", va="center", fontsize=7)
            continue
        v = round(100 * r["hidden"]) + 0  # + 0: no "-0"
        label = f"{v}" + ("u" if r.get("fuse") is False else "")
        ax.text(x, y, label, ha="center", va="center", fontsize=7, color="white" if abs(v) > 60 else "black")
        if r["norm_share"] < min_share:
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="white", alpha=0.55,
                                   hatch="///", edgecolor="grey", linewidth=0))
    ax.set_xticks(range(len(ns)), [str(n) for n in ns], fontsize=7)
    ax.set_yticks(range(len(ks)), [str(k) for k in ks], fontsize=7)
    return im


def plot(data: dict, path: str, min_share: float) -> None:
    """Heat maps of % hidden over K (rows) x N (columns): one panel per (norm, direction), a figure row per
    affine off/on. "u": fusenorm's dispatch runs this shape unfused; hatched: norm < min_share of t_unfused."""
    plt = pyplot()
    if plt is None:
        return
    rows = data["rows"]
    combos = [(nm, d) for nm in ("layer", "rms") for d in ("fwd", "bwd")
              if any(r["norm"] == nm and r["dir"] == d for r in rows)]
    affines = [a for a in (False, True) if any(r["affine"] == a for r in rows)]
    ks, ns = sorted({r["K"] for r in rows}), sorted({r["N"] for r in rows})
    if not combos or not affines:
        print("note: no rows to plot")
        return
    fig, axes = plt.subplots(len(affines), len(combos), squeeze=False, layout="constrained",
                             figsize=(1.5 + 0.6 * len(ns) * len(combos), 1.2 + (0.9 + 0.4 * len(ks)) * len(affines)))
    cmap = plt.get_cmap("RdBu").copy()
    cmap.set_bad("lightgrey")
    im = None
    for i, aff in enumerate(affines):
        for j, (nm, d) in enumerate(combos):
            ax = axes[i][j]
            cells = {(r["K"], r["N"]): r for r in rows if r["norm"] == nm and r["dir"] == d and r["affine"] == aff}
            im = hidden_panel(ax, cells, ks, ns, min_share, cmap)
            if i == len(affines) - 1:
                ax.set_xlabel("N", fontsize=8)
            if j == 0:
                ax.set_ylabel("K", fontsize=8)
            ax.set_title(f"{'LayerNorm' if nm == 'layer' else 'RMSNorm'} {d}, affine {'on' if aff else 'off'}",
                         fontsize=9)
    meta = data.get("meta", {})
    fig.suptitle(f"% of the norm's time hidden, (t_unfused - t_fused) / t_norm; {meta.get('gpu', '?')}, "
                 f"M = {meta.get('rows', '?')}, {meta.get('timer_kind', '?')}\n"
                 f"u: fusenorm's dispatch runs it unfused (0% for users); hatched: norm < {100 * min_share:.0f}% "
                 "of t_unfused; grey: not measured", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label="% hidden")
    common.save_figure(fig, path, dpi=130)


def report(data: dict, json_path: str, min_share: float, write: bool = True, table: bool = True) -> None:
    """Recompute the summary; print the table (a run has printed it line by line already) and the summary;
    write the JSON (if write) and the PNG beside it."""
    data["rows"].sort(key=lambda r: (r["dir"] != "fwd", r["K"], r["N"], r["norm"] != "layer", r["affine"]))
    data["summary"] = summarize(data["rows"], min_share)
    data.setdefault("meta", {})["min_share"] = min_share
    if table:
        print()
        print_table(data["rows"])
    print_summary(data["summary"], min_share)
    if write:
        write_json(json_path, data)
    plot(data, png_path(json_path), min_share)


def merge(paths: list[str], key: Callable[[dict], tuple] | None = None) -> dict:
    """``common.merge`` of partial runs (rows by ``key(row)``, default ``point_key``; the later file wins), and the
    --core-only rows (dir "core") attached to the forward points of the same M, K, N that have no core timings."""
    data = common.merge(paths, key or point_key)
    rows = data["rows"]
    cores = {(r["M"], r["K"], r["N"]): r for r in rows if r.get("dir") == "core"}
    rows = [r for r in rows if r.get("dir") != "core"]
    for r in rows if cores else ():
        c = cores.get((r["M"], r["K"], r["N"]))
        if c is not None and "t_core_ms" in c and r["dir"] == "fwd" and "t_core_ms" not in r:
            r.update({f: c[f] for f in CORE_FIELDS})
            r["core_throughput"] = c["t_mm_core_ms"] / c["t_core_ms"]
    return {"meta": data["meta"], "rows": rows}


# ----------------------------------------------------------------------------------------------------------
# Precompile workers
# ----------------------------------------------------------------------------------------------------------


def setup_torch(tuning_rep_ms: float | None = None, gluon: bool = True) -> dict:
    """The same state in the workers and the main process, so their FX graph cache keys agree; returns
    fusenorm's tuning settings for the meta block."""
    import fusenorm_inductor  # registers torch.ops.fusenorm.*

    if not gluon:
        fusenorm_inductor.config.gluon = False

    if fusenorm_inductor.config.enabled:  # FUSENORM_ENABLE=1: the baselines must be plain Inductor
        fusenorm_inductor.disable()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    tuning = getattr(fusenorm_inductor.config, "tuning", None)
    if tuning is None:
        return {}
    if tuning_rep_ms is not None:
        tuning.rep_ms = tuning_rep_ms
    return {**{k: getattr(tuning, k, None) for k in ("measure", "rep_ms", "margin", "margin_step", "compile_threads",
                                                     "cache_dir")},
            "gluon": getattr(fusenorm_inductor.config, "gluon", None)}


def grid_argv(args) -> list[str]:
    argv = ["--rows", str(args.rows), "--K", ",".join(map(str, args.K)), "--N", ",".join(map(str, args.N)),
            "--norms", ",".join(args.norms), "--affine", ",".join("on" if a else "off" for a in args.affine),
            "--dirs", ",".join(args.dirs)]
    argv += ["--dry-run"] if args.dry_run else []
    return argv + (["--resume", "--out", args.out] if args.resume else [])


def precompile(args, n_jobs: int, cache_dir: str, script: str | None = None, argv: list[str] | None = None) -> None:
    """Compile the grid's Inductor functions in parallel subprocesses (--compile-only) into cache_dir: the
    workers run ``script`` (default: this file) with ``argv`` (default: ``grid_argv(args)``)."""
    n_workers = min(args.precompile_workers, n_jobs)
    if n_workers <= 0:
        return
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    # Each worker's Inductor would otherwise start a compile pool of one process per core.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // n_workers)))
    argv = grid_argv(args) if argv is None else argv
    cmd = [sys.executable, os.path.abspath(script or __file__), *argv, "--compile-only"]
    logs = [os.path.join(cache_dir, f"worker{i}.log") for i in range(n_workers)]
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        procs = [
            subprocess.Popen(cmd + ["--shard", f"{i}/{n_workers}"], env=env, stderr=subprocess.STDOUT,
                             stdout=stack.enter_context(open(log, "w")))
            for i, log in enumerate(logs)
        ]
        rcs = [proc.wait() for proc in procs]
    failed = 0
    for i, (rc, log) in enumerate(zip(rcs, logs)):
        with open(log) as f:
            text = f.read()
        failed += text.count("compile failed")
        if rc != 0 or "compile failed" in text:
            print(f"precompile worker {i} (exit code {rc}), end of its log:\n{text[-3000:]}", flush=True)
    print(f"precompiled {n_jobs} Inductor functions with {n_workers} workers in {time.time() - t0:.0f} s"
          f" ({failed} failed: the main process compiles those itself)", flush=True)


def compile_only(args, device: str) -> None:
    """Worker: compile and run once its shard of the grid's Inductor functions; no timing."""
    i, n = map(int, args.shard.split("/"))
    import torch._inductor.config as inductor_config

    # Autotuning the generated kernels here would run next to the other workers on the same GPU: do not
    # store the picks (not part of the FX cache key), so the main process autotunes alone.
    inductor_config.autotune_local_cache = False
    mine = jobs(todo_points(args, done_rows(args)))[i::n]
    t0 = time.time()
    for job in mine:
        try:
            case = Case(job, args.rows, device)
            with torch.no_grad():
                compiled(job, case)()
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (the main process compiles it again and reports the error)
            print(f"compile failed: {job}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            case = None
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"worker {i}/{n}: {len(mine)} functions in {time.time() - t0:.0f} s", flush=True)
    if device == "cuda":
        t0 = time.time()
        points = todo_points(args, done_rows(args))[i::n]
        for p in points:
            warm_fused_kernels(p, args.rows, device)
        print(f"worker {i}/{n}: fused kernels of {len(points)} points compiled in {time.time() - t0:.0f} s", flush=True)


def warm_fused_kernels(p: Point, m: int, device: str) -> None:
    """Run every candidate configuration of the fused op once (with and without the norm), so that Triton's
    on-disk cache holds their binaries before the main process tunes and times them."""
    from fusenorm_inductor.kernels.triton import mm_norm_backward as bk
    from fusenorm_inductor.kernels.triton import mm_norm as fk
    from fusenorm_inductor.tuning import mm_norm as fk_tuning
    from fusenorm_inductor.tuning import mm_norm_backward as bk_tuning

    try:
        with torch.no_grad():
            case = Case(p, m, device)
            _, args = fused_op_args(p, case)
            if p.dir == "fwd":
                out_bytes = fk_tuning.forward_out_bytes(args[0], args[3], args[8], args[9])
                launch, cands = fk.mm_norm_triton, fk_tuning.forward_candidates(args[0], args[1], p.N, out_bytes)
            else:
                out_bytes = 4 if args[10] == torch.float32 else 2
                launch = bk.mm_norm_backward_triton
                cands = bk_tuning.backward_candidates(args[0], args[1], p.N, out_bytes)
            for c in cands:
                for gemm_only in (False, True):
                    try:
                        launch(*args, config=c, gemm_only=gemm_only)
                    except Exception as e:  # noqa: BLE001 (a failing candidate is skipped by the tuner too)
                        print(f"candidate failed: {p} {c.label()}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.synchronize()
    finally:
        case = None
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def meta_block(args, device: str, ceilings: dict) -> dict:
    timer = ("wall clock, CPU (dry run: meaningless)" if device != "cuda" else
             f"triton.testing.{'do_bench_cudagraph' if args.timer == 'cudagraph' else 'do_bench'} median, ms")
    return {
        **common.environment(device),  # gpu, torch, triton, python, date, commit
        "dtype": "bfloat16",
        "timer": timer,
        "timer_kind": args.timer if device == "cuda" else "cpu",
        "rep_ms": args.rep_ms,
        "rows": args.rows,
        "eps": EPS,
        "ceilings": ceilings,
        # post-norm's forward only (bench_prenorm.py shares this block and has no such flag)
        **({"fwd_fused_saves": "y and hh (training, --fwd-save-normed)" if args.fwd_save_normed else "y (no_grad)"}
           if hasattr(args, "fwd_save_normed") else {}),
        "grid": {"K": args.K, "N": args.N, "norms": args.norms, "affine": args.affine, "dirs": args.dirs},
        "metrics": {
            "hidden": "(t_unfused - t_fused) / t_norm",
            "hidden_fusenorm": "(t_unfused - t_fusenorm) / t_norm, t_fusenorm = t_unfused where the dispatch "
                               "keeps the shape unfused (fuse false), else t_fused",
            "norm_share": "t_norm / t_unfused",
            "bytes": "least traffic of the fused op (each operand read once, each output written once)",
            "floor_ms": "max(flops / matmul peak, bytes / copy bandwidth)",
            "peak_*_mib": "max_memory_allocated during one call above what was allocated before it, MiB",
            "max_abs_diff": "max |fused - unfused| of y (fwd) or dx (bwd)",
        },
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[-2:]))
    p.add_argument("--rows", type=int, default=None, help=f"M (default {DEFAULTS['rows']}; 64 with --dry-run)")
    p.add_argument("--K", default=None, help=f"comma list (default {DEFAULTS['K']}; 32 with --dry-run)")
    p.add_argument("--N", default=None, help=f"comma list (default {DEFAULTS['N']}; 40 with --dry-run)")
    p.add_argument("--norms", default="layer,rms")
    p.add_argument("--affine", default="off,on", help="off,on")
    p.add_argument("--dirs", default="fwd,bwd", help="fwd,bwd")
    p.add_argument("--timer", choices=["cudagraph", "events"], default="cudagraph",
                   help="cudagraph: do_bench_cudagraph (GPU time alone); events: do_bench (includes CPU launch "
                        "overhead when the GPU waits for it)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="GPU time spent measuring each timing (default 50)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds per point, alternating cuBLAS / unfused / fused / GEMM base; medians (default 3)")
    p.add_argument("--fwd-save-normed", action="store_true",
                   help="fwd: time the fused op as a training forward runs it (affine: hh saved beside y); "
                        "default: as fusenorm runs it under no_grad, like the unfused function timed")
    p.add_argument("--no-gluon", dest="gluon", action="store_false",
                   help="run fusenorm's tl kernels where the Gluon sm_90 ones would apply (config.gluon = False)")
    p.add_argument("--tuning-rep-ms", type=float, default=None,
                   help="fusenorm_inductor.config.tuning.rep_ms for the dispatch's own measurements (default: "
                        "fusenorm's); lower it to save GPU time")
    p.add_argument("--min-share", type=float, default=0.10,
                   help="summaries use the points whose norm_share = t_norm / t_unfused is at least this")
    p.add_argument("--precompile-workers", type=int, default=None,
                   help="subprocesses compiling the Inductor functions before timing (default 12; 2 with "
                        "--dry-run; 0: the main process compiles everything itself)")
    p.add_argument("--cache-dir", default=None,
                   help="Inductor cache directory (default: a fresh temporary one, removed at the end)")
    p.add_argument("--out", default=None, help=f"JSON to write (default {DEFAULT_OUT}); the PNG goes beside it")
    p.add_argument("--resume", action="store_true",
                   help="keep the complete rows already in --out (e.g. of a run stopped by a time limit) and "
                        "measure the other points")
    p.add_argument("--plot-only", metavar="JSON", help="print table and summary and write the PNG of a JSON")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge partial runs into --out")
    p.add_argument("--core-only", action="store_true",
                   help="only the GEMM core against cuBLAS, once per K x N of the grid (rows of dir 'core'; --merge "
                        "attaches them to the forward points)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes: compiles and runs everything on the CPU (wall-clock times, meaningless)")
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    defaults = DRY_DEFAULTS if args.dry_run else DEFAULTS
    args.rows = args.rows if args.rows is not None else defaults["rows"]
    args.K = [int(x) for x in (args.K or defaults["K"]).split(",")]
    args.N = [int(x) for x in (args.N or defaults["N"]).split(",")]
    args.norms = common.choices(p, "--norms", args.norms, ("layer", "rms"))
    args.dirs = common.choices(p, "--dirs", args.dirs, ("fwd", "bwd"))
    args.affine = [a == "on" for a in common.choices(p, "--affine", args.affine, ("off", "on"))]
    if args.precompile_workers is None:
        args.precompile_workers = 2 if args.dry_run else 12
    if args.out is None and not args.plot_only:
        args.out = os.path.join(tempfile.gettempdir(), "gemm_norm_dry_run.json") if args.dry_run else DEFAULT_OUT
    return args


def run(args, device: str) -> dict:
    global FWD_SAVE_NORMED
    FWD_SAVE_NORMED = args.fwd_save_normed
    t_start = time.time()
    done = done_rows(args)
    points = todo_points(args, done)
    own_cache = args.cache_dir is None
    cache_dir = os.path.abspath(args.cache_dir or tempfile.mkdtemp(prefix="fusenorm_bench_inductor_"))
    os.makedirs(cache_dir, exist_ok=True)
    # A fresh directory: no stale compiles or autotune picks from earlier runs; workers share it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1":
        print("warning: TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: the precompiled functions will not be reused")
    print(f"{len(points)} points to measure ({len(done)} kept from {args.out}), {len(jobs(points))} Inductor "
          f"functions, M = {args.rows}, device {device}, Inductor cache {cache_dir}", flush=True)
    try:
        if not args.core_only:
            precompile(args, len(jobs(points)), cache_dir)
        t_pre = time.time()
        tuning_settings = setup_torch(args.tuning_rep_ms, args.gluon)
        bench = Bench(args.timer, args.rep_ms, device, args.rounds)
        ceilings = measure_ceilings(bench, device, args.dry_run)
        print(f"ceilings: bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s",
              flush=True)
        meta = meta_block(args, device, ceilings)
        meta.update(precompile_workers=args.precompile_workers, fusenorm_tuning=tuning_settings)
        rows, shared = list(done.values()), {}
        print(HEADER, flush=True)
        if args.core_only:
            points = list({(p.K, p.N): p for p in points if p.dir == "fwd"}.values())
        for p in points:
            t0 = time.time()
            if args.core_only:
                r = core_point(p, args.rows, device, bench)
            else:
                r = derive(run_point(p, args.rows, device, bench, shared), ceilings)
            r["point_s"] = time.time() - t0  # wall time, compiles and the dispatch's measurements included
            rows.append(r)
            print(row_line(r), flush=True)
            # After every point: a run killed by a time limit keeps what it measured (rerun with --resume).
            write_json(args.out, {"meta": {**meta, "partial": True}, "rows": rows}, quiet=True)
        t_end = time.time()
    finally:
        if own_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    from torch._dynamo.utils import counters

    meta["wall_s"] = {"precompile": t_pre - t_start, "ceilings_and_points": t_end - t_pre, "total": t_end - t_start}
    meta["fx_graph_cache_main"] = {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    print(f"\nwall time: precompile {meta['wall_s']['precompile']:.0f} s, ceilings + points "
          f"{meta['wall_s']['ceilings_and_points']:.0f} s; main process FX graph cache {meta['fx_graph_cache_main']}")
    return {"meta": meta, "rows": rows}


def point_key(r: dict) -> tuple:
    return (r["M"], r["K"], r["N"], r["norm"], r["affine"], r["dir"])


def done_rows(args) -> dict[tuple, dict]:
    """With --resume: the complete rows already in --out (a partial or earlier run), by point."""
    return common.read_rows(args.out, point_key, complete) if args.resume else {}


def todo_points(args, done: dict) -> list[Point]:
    return [p for p in grid(args) if (args.rows, p.K, p.N, p.norm, p.affine, p.dir) not in done]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            data = json.load(f)
        report(data, args.plot_only, args.min_share, write=False)
        return
    if args.merge:
        report(merge(args.merge), args.out, args.min_share)
        return
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run to check the script on the CPU")
    if args.compile_only:
        setup_torch()
        compile_only(args, device)
        return
    report(run(args, device), args.out, args.min_share, table=False)


if __name__ == "__main__":
    main()
