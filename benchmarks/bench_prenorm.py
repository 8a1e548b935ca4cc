"""Pre-norm benchmark (norm -> linear(s)): how much of the norm's time fusenorm's Lazy Pre-Norm hides.

The model is ``y = norm(x); return tuple(linear_i(y) for i < fanout)``: x [M, K] (M = ``--rows``, 262144), bf16,
LayerNorm (eps 1e-5) or RMSNorm (eps 1e-6) over K, affine off / on ("on": weight ~ 1 + 0.1 randn and, for
LayerNorm, a bias ~ 0.1 randn), ``fanout`` bias-free ``nn.Linear(K, N)`` with weights randn / sqrt(K). Fan-out
1 is a single linear, 2 is gate/up of an MLP, 3 is q/k/v of attention (each of the linears N wide). Forward
points run under no_grad; backward points train (x, the norm's affine and the linears' weights get gradients).
By default (``--fanout-shapes model``) fan-out 1 covers the whole K x N grid, fan-out 3 the points with N = K
(q/k/v of a K-wide attention) and fan-out 2 those with N = 2K (gate/up: the grid's nearest to ~2.7 K);
``--fanout-shapes grid`` measures every fan-out on the whole grid (3x the points).

Per point, medians of GPU time (``--timer cudagraph``: ``do_bench_cudagraph``; ``events``: ``do_bench``):
    t_mm       cuBLAS GEMMs alone, summed over the consumers: fwd ``mm(x, W_i.t())``; bwd the backward's
               GEMMs, ``dy = sum_i dc_i @ W_i`` (mm, then addmm accumulating) and ``dW_i = dc_i.t() @ y``
    t_norm     Inductor's norm alone on x [M, K] (fwd), or its backward, dx and with affine dw (db) (bwd); the
               functions of bench_gemm_norm.py with the norm over K, shared by every N and fan-out
    t_unfused  ``torch.compile(model, dynamic=False)`` (Inductor): fwd its forward; bwd its compiled backward
               alone, ``torch.autograd.grad`` of the outputs of one forward (retain_graph), not fwd+bwd - fwd
    t_fused    the same model under ``torch.compile(backend="fusenorm")``: what users get, including the
               dispatch, which may leave the norm unfused (then t_fused ~ t_unfused); which path was taken is
               read from ``fusenorm_inductor.reports()`` of that compile ("fuse", "path", "prenorm_reason")
    t_op       fwd: ``torch.ops.fusenorm.norm_mm`` alone, once per consumer (each recomputes the statistics)
bwd points also time each training forward (grad enabled): t_unfused_fwd / t_fused_fwd and their peaks,
which include what the forward saves for the backward (fusenorm saves x and mean/rstd, never norm(x)).
Reported: hidden = (t_unfused - t_fused) / t_norm (hidden_op with t_op), t_fused / t_mm, norm_share =
t_norm / t_unfused, TFLOP/s and GB/s of t_fused against floor = max(flops / matmul peak, bytes / copy
bandwidth) (ceilings measured in the same run), peak memory of every timed call, max |fused - unfused|.
The summary, per norm x direction x fan-out (x affine), uses the points whose norm_share >= ``--min-share``.

Run on the GPU machine. The default grid (184 points) is sized for about five minutes on two H200s, one
process of 92 points per GPU (not yet timed there; a run stopped by a time limit keeps its rows, written
after every point, and the same command with ``--resume`` measures the rest):
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_prenorm.py --norms layer --out /tmp/pn_layer.json &
    CUDA_VISIBLE_DEVICES=1 python benchmarks/bench_prenorm.py --norms rms --out /tmp/pn_rms.json &
    wait
    python benchmarks/bench_prenorm.py --merge /tmp/pn_layer.json /tmp/pn_rms.json \\
        --out benchmarks/results/prenorm_h200.json        # -> prenorm_h200.json and prenorm_h200.png
    python benchmarks/bench_prenorm.py --plot-only benchmarks/results/prenorm_h200.json
    python benchmarks/bench_prenorm.py --dry-run          # CPU, tiny shapes: checks the calls, not speed

Splitting by norm keeps both processes equally loaded (backward points cost more) and never has two GPUs
measure the same dispatch shape. ``--precompile-workers`` subprocesses first compile the grid's functions into
a fresh Inductor cache (fusenorm's dispatch measures in them too, unstored, which compiles the fused kernels'
candidates): the main process then compiles from the cache, measures the dispatch alone on the GPU, and times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, namedtuple
from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gemm_norm as gn  # noqa: E402  (the post-norm benchmark: ceilings, norm-alone functions, precompile)
import common  # noqa: E402  (the shared harness: timers, peak memory, environment, JSON, PNG)
from bench_gemm_norm import DTYPE, ELEM, EPS, complete  # noqa: E402
from common import Bench  # noqa: E402

DEFAULTS = {"rows": 262144, "K": "256,512,1024,2048", "N": "256,512,1024,2048"}
DRY_DEFAULTS = {"rows": 64, "K": "32", "N": "32,64"}
DEFAULT_OUT = "benchmarks/results/prenorm_h200.json"
FANOUT_ROLE = {1: "one linear", 2: "gate/up", 3: "q/k/v"}


# bench_gemm_norm's point (dir, K, N, norm, affine: the GEMMs are [M, K] @ [K, N] there too, but the norm here is
# over K, the GEMMs' input) and the fan-out: how many linears read the normalized tensor.
Point = namedtuple("Point", [*gn.Point._fields, "fanout"])


def in_grid(fanout: int, k: int, n: int, shapes: str) -> bool:
    """Fan-out 1 everywhere; with ``model`` shapes fan-out 3 at N = K and fan-out 2 at N = 2K only."""
    return fanout == 1 or shapes == "grid" or n == {2: 2 * k, 3: k}.get(fanout)


def grid(args) -> list[Point]:
    return [
        Point(d, k, n, norm, aff, f)
        for d in args.dirs for f in args.fanout for k in args.K for n in args.N if in_grid(f, k, n, args.fanout_shapes)
        for norm in args.norms for aff in args.affine
    ]


def row_key(r: dict) -> tuple:
    return (r["M"], r["K"], r["N"], r["norm"], r["affine"], r["dir"], r.get("fanout", 1))


def point_of(r: dict) -> Point:
    return Point(r["dir"], r["K"], r["N"], r["norm"], r["affine"], r.get("fanout", 1))


def norm_point(p: Point) -> gn.Point:
    """The post-norm benchmark's point whose norm is this one's (its N is the norm's width): t_norm reuses
    bench_gemm_norm's norm-alone functions and inputs."""
    return gn.Point(p.dir, p.N, p.K, p.norm, p.affine)


# ----------------------------------------------------------------------------------------------------------
# The model, its inputs, and the calls timed
# ----------------------------------------------------------------------------------------------------------


class PreNorm(nn.Module):
    def __init__(self, p: Point, device: str):
        super().__init__()
        kw = {"device": device, "dtype": DTYPE}
        if p.norm == "rms":
            self.norm = nn.RMSNorm(p.K, eps=EPS["rms"], elementwise_affine=p.affine, **kw)
        else:
            self.norm = nn.LayerNorm(p.K, eps=EPS["layer"], elementwise_affine=p.affine, bias=p.affine, **kw)
        self.linears = nn.ModuleList(nn.Linear(p.K, p.N, bias=False, **kw) for _ in range(p.fanout))
        with torch.no_grad():
            for lin in self.linears:
                lin.weight.normal_(0.0, p.K**-0.5)
            if p.affine:
                self.norm.weight.normal_(1.0, 0.1)
            if self.norm_bias is not None:
                self.norm_bias.normal_(0.0, 0.1)

    @property
    def norm_bias(self):
        return getattr(self.norm, "bias", None)  # nn.RMSNorm has none

    def forward(self, x):
        y = self.norm(x)
        return tuple(lin(y) for lin in self.linears)


class Inputs(NamedTuple):
    model: PreNorm
    x: torch.Tensor  # [M, K]; requires grad for bwd points
    grads: list  # bwd: the outputs' incoming gradients, [M, N] each


def make_inputs(p: Point, m: int, device: str) -> Inputs:
    torch.manual_seed(0)
    model = PreNorm(p, device)
    x = torch.randn(m, p.K, device=device, dtype=DTYPE).requires_grad_(p.dir == "bwd")
    grads = [torch.randn(m, p.N, device=device, dtype=DTYPE) for _ in range(p.fanout)] if p.dir == "bwd" else []
    return Inputs(model, x, grads)


def compile_model(model: nn.Module, backend: str) -> Callable:
    """``torch.compile(model, dynamic=False)`` with Inductor or with fusenorm's backend (the function that the
    name "fusenorm" is registered for: the same compile, whether or not the package is installed)."""
    torch._dynamo.reset()  # one model at a time: no recompiles, no guards piling up
    if backend == "fusenorm":
        from fusenorm_inductor import fusenorm_backend

        return torch.compile(model, backend=fusenorm_backend, dynamic=False)
    return torch.compile(model, dynamic=False)


def backward_call(cfn: Callable, inp: Inputs, device: str) -> Callable:
    """The compiled backward alone: one forward, then each call is ``autograd.grad`` of its outputs with the
    graph retained. On CUDA the forward runs on a side stream: autograd runs the backward on the forward's
    stream, which can then join the timer's graph capture (the legacy default stream cannot)."""
    stream = torch.cuda.Stream() if device == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # x and the weights were made on the current stream
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        outs = cfn(inp.x)
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    leaves = [inp.x, *inp.model.parameters()]
    return lambda: torch.autograd.grad(outs, leaves, inp.grads, retain_graph=True)


def gemm_call(p: Point, inp: Inputs) -> Callable:
    x, weights = inp.x.detach(), [lin.weight.detach() for lin in inp.model.linears]
    if p.dir == "fwd":
        return lambda: [torch.mm(x, w.t()) for w in weights]
    grads = inp.grads  # x stands in for the normalized y of the weight gradients (same shape and dtype)

    def backward_gemms():
        dy = torch.mm(grads[0], weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            dy = torch.addmm(dy, g, w)
        return dy, [torch.mm(g.t(), x) for g in grads]

    return backward_gemms


def op_args(p: Point, inp: Inputs) -> list[tuple]:
    """``fusenorm::norm_mm`` arguments of each consumer (b = W.t(), as the graph passes it)."""
    norm = inp.model.norm
    w = norm.weight.detach() if norm.weight is not None else None
    nb = inp.model.norm_bias.detach() if inp.model.norm_bias is not None else None
    return [(inp.x.detach(), lin.weight.detach().t(), None, w, nb, EPS[p.norm], p.norm == "rms", DTYPE)
            for lin in inp.model.linears]


def least_bytes(p: Point, m: int) -> int:
    """Least traffic of the point's work: x once, every weight and output once, the statistics once."""
    k, n, f = p.K, p.N, p.fanout
    n_affine = int(p.affine) * (2 if p.norm == "layer" else 1)  # weight (+ bias), [K] each
    stats = 4 * m * (1 if p.norm == "rms" else 2)
    if p.dir == "fwd":  # x, W_i, c_i
        return ELEM * (m * k + f * (n * k + m * n) + n_affine * k) + stats
    # dc_i, W_i, x read; dx, dW_i, d(weight, bias) written
    return ELEM * (f * m * n + 2 * f * n * k + 2 * m * k + 2 * n_affine * k) + stats


# ----------------------------------------------------------------------------------------------------------
# Setup and precompile workers
# ----------------------------------------------------------------------------------------------------------


def setup(tuning_rep_ms: float | None = None) -> dict:
    """bench_gemm_norm's setup_torch, plus: no donated buffers (the backward runs many times on one retained
    graph) and no AOTAutograd cache (a hit skips fusenorm's joint pass, whose report says which path ran);
    the same in workers and main process, so their FX graph cache keys agree."""
    settings = gn.setup_torch(tuning_rep_ms)
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    functorch_config.enable_autograd_cache = False
    return settings


def work_items(points: list[Point]) -> list[tuple]:
    """Every function the main process compiles: ("norm", gn.Job) once per norm, ("model", point, backend)."""
    items: dict[tuple, None] = {}
    for p in points:
        items.setdefault(("norm", gn.norm_job(norm_point(p))))
        items.setdefault(("model", p, "inductor"))
        items.setdefault(("model", p, "fusenorm"))
    return list(items)


def run_once(item: tuple, m: int, device: str) -> None:
    if item[0] == "norm":
        job = item[1]
        with torch.no_grad():
            gn.compiled(job, gn.Case(job, m, device))()
        return
    _, p, backend = item
    inp = make_inputs(p, m, device)
    cfn = compile_model(inp.model, backend)
    if p.dir == "fwd":
        with torch.no_grad():
            cfn(inp.x)
    else:
        backward_call(cfn, inp, device)()


def compile_only(args, device: str) -> None:
    """Worker: compile and run once its shard of the work items; no timing. fusenorm's dispatch measures
    here as it compiles (which builds every candidate kernel), but its results stay in this process: they
    were taken next to the other workers, the main process measures again alone."""
    import torch._inductor.config as inductor_config

    from fusenorm_inductor.tuning import measure

    inductor_config.autotune_local_cache = False  # as bench_gemm_norm: the main process autotunes alone
    measure._write_disk = lambda key, entry: None
    i, n = map(int, args.shard.split("/"))
    mine = work_items(todo_points(args, done_rows(args)))[i::n]
    t0 = time.time()
    for item in mine:
        try:
            run_once(item, args.rows, device)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (the main process compiles it again and reports the error)
            print(f"compile failed: {item}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"worker {i}/{n}: {len(mine)} functions in {time.time() - t0:.0f} s", flush=True)


def grid_argv(args) -> list[str]:
    argv = gn.grid_argv(args) + ["--fanout", ",".join(map(str, args.fanout)), "--fanout-shapes", args.fanout_shapes]
    return argv + (["--tuning-rep-ms", str(args.tuning_rep_ms)] if args.tuning_rep_ms is not None else [])


# ----------------------------------------------------------------------------------------------------------
# One point
# ----------------------------------------------------------------------------------------------------------


def measure_point(p: Point, m: int, device: str, bench: Bench, shared: dict) -> dict:
    """All timings of one point; whatever raises is recorded in the row and the grid goes on."""
    row = {"M": m, "K": p.K, "N": p.N, "norm": p.norm, "affine": p.affine, "dir": p.dir, "fanout": p.fanout}
    grad_mode = torch.no_grad() if p.dir == "fwd" else nullcontext()
    try:
        with grad_mode:
            _measure(p, m, device, bench, shared, row)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def _norm_alone(p: Point, m: int, device: str, bench: Bench) -> dict:
    with torch.no_grad():
        return gn._norm_alone(norm_point(p), m, device, bench)


def _measure(p: Point, m: int, device: str, bench: Bench, shared: dict, row: dict) -> None:
    import fusenorm_inductor

    inp = make_inputs(p, m, device)
    mm_key = ("mm", p.dir, p.K, p.N, p.fanout)  # the GEMMs do not depend on the norm
    gn._record(row, "mm", gn._shared(shared, mm_key, lambda: bench.measure(gemm_call(p, inp))))
    gn._record(row, "norm", gn._shared(shared, gn.norm_job(norm_point(p)), lambda: _norm_alone(p, m, device, bench)))
    main_out = {}  # the first linear's output (fwd) or dx (bwd) of each compile
    for name, backend in (("unfused", "inductor"), ("fused", "fusenorm")):
        fusenorm_inductor.report.clear()
        cfn = compile_model(inp.model, backend)
        if p.dir == "bwd":
            # The training forward (it compiles, and saves for the backward); its outputs are not kept.
            gn._record(row, f"{name}_fwd", bench.measure(lambda: cfn(inp.x)))
            res = _measure_backward(backward_call(cfn, inp, device), bench, row, name)
        else:
            res = bench.measure(lambda: cfn(inp.x))
            gn._record(row, name, res)
        main_out[name] = res["out"][0]
        if backend == "fusenorm":
            row.update(fusenorm_path(fusenorm_inductor.reports(), p.dir))
        res = cfn = None
    row["max_abs_diff"] = gn.max_abs_diff(main_out["fused"], main_out["unfused"])
    # One consumer's measured decision, asked after the compile asked it (an in-memory hit: no measuring).
    row["prenorm_choice"] = gn.ask_choice("prenorm_choice", op_args(p, inp)[0])
    if row.get("fuse") and row["prenorm_choice"].get("dispatch_config"):
        row["path"] = f"fused {row['prenorm_choice']['dispatch_config']}"
    if p.dir == "fwd":
        _measure_op(p, inp, bench, row, main_out["unfused"])


def _measure_backward(fn: Callable, bench: Bench, row: dict, name: str) -> dict:
    res = bench.measure(fn)
    # A backward faster than half its own GEMMs was not captured (autograd ran it outside the CUDA graph):
    # time it again with do_bench, say so.
    if bench.cuda and res["ms"] < 0.5 * row.get("t_mm_ms", 0.0):
        res["note"] = f"cudagraph time {res['ms']:.4g} ms is below half of t_mm: timed with do_bench"
        res["ms"] = Bench("events", bench.rep_ms, "cuda").time_ms(fn)[0]
    gn._record(row, name, res)
    return res


def _measure_op(p: Point, inp: Inputs, bench: Bench, row: dict, ref: torch.Tensor) -> None:
    calls = op_args(p, inp)
    try:
        res = bench.measure(lambda: [torch.ops.fusenorm.norm_mm(*a) for a in calls])
    except Exception as e:  # noqa: BLE001 (kernels being written: the compiled timings stand)
        row["op_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return
    gn._record(row, "op", res)
    row["max_abs_diff_op"] = gn.max_abs_diff(res["out"][0][0], ref)


def fusenorm_path(reps: list, direction: str) -> dict:
    """What fusenorm did with the compiled graphs: its rewrites (canonicalizations left out) and skips, and
    per pattern of interest whether it fused (the rewrite's kernel text) or not (the skip's reason)."""
    rewrites = [r for rep in reps for r in rep.rewrites if not r.pattern.startswith("canonical")]
    skips = [s for rep in reps for s in rep.skips]
    out = {
        "fusenorm_rewrites": dict(Counter(r.pattern for r in rewrites)),
        "fusenorm_skips": [f"{s.pattern} at {s.node}: {s.reason}"[:300] for s in skips],
        "fusenorm_errors": [e[:300] for rep in reps for e in rep.errors],
    }
    patterns = {"norm_linear_fwd": "prenorm", "dgrad_norm_bwd": "dgrad"} if direction == "bwd" else {
        "norm_linear_fwd": "prenorm"}
    for pattern, tag in patterns.items():
        fused = [r.kernel for r in rewrites if r.pattern == pattern]
        left = [s.reason for s in skips if s.pattern == pattern]
        out[f"{tag}_fuse"] = True if fused else (False if left else None)
        out[f"{tag}_reason"] = (fused or left or [None])[0]
    out["fuse"] = out.pop("prenorm_fuse")
    out["path"] = {True: "fused", False: "unfused", None: "n/a"}[out["fuse"]]
    return out


# ----------------------------------------------------------------------------------------------------------
# Metrics and summary
# ----------------------------------------------------------------------------------------------------------


def _num(x) -> bool:
    return isinstance(x, (int, float))


def derive(r: dict, ceilings: dict) -> dict:
    if not complete(r):
        return r
    p, m = point_of(r), r["M"]
    t_mm, t_norm, t_unf, t_fus = (r[t] for t in gn.TIMES)
    flops = 2 * m * p.K * p.N * p.fanout * (2 if p.dir == "bwd" else 1)
    r.update(hidden=(t_unf - t_fus) / t_norm, fused_over_mm=t_fus / t_mm, norm_share=t_norm / t_unf,
             **gn.throughput(flops, least_bytes(p, m), t_fus, ceilings))
    if _num(r.get("t_op_ms")):
        r.update(hidden_op=(t_unf - r["t_op_ms"]) / t_norm, op_over_mm=r["t_op_ms"] / t_mm,
                 op_floor_frac=r["floor_ms"] / r["t_op_ms"])
    if _num(r.get("peak_unfused_fwd_mib")) and _num(r.get("peak_fused_fwd_mib")):
        r["fwd_peak_saved_mib"] = r["peak_unfused_fwd_mib"] - r["peak_fused_fwd_mib"]
    return r


def _stats(prefix: str, vals: list) -> dict:
    return {f"median_{prefix}": statistics.median(vals) if vals else None, f"min_{prefix}": min(vals, default=None)}


def summarize(rows: list[dict], min_share: float) -> list[dict]:
    """Per (norm, dir, fanout) over both affines ("all") and per affine: hidden (and hidden_op) over the points
    whose norm is >= min_share of the unfused time; how many of those (and of all points) fusenorm made slower."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        for aff in ("all", "on" if r["affine"] else "off"):
            groups.setdefault((r["norm"], r["dir"], r.get("fanout", 1), aff), []).append(r)
    order = {"layer": 0, "rms": 1, "fwd": 0, "bwd": 1, "all": 0, "off": 1, "on": 2}
    out = []
    for (norm, d, f, aff), rs in sorted(groups.items(), key=lambda kv: [order.get(x, x) for x in kv[0]]):
        ok = [r for r in rs if complete(r)]
        used = [r for r in ok if r["norm_share"] >= min_share]
        s = {"norm": norm, "dir": d, "fanout": f, "affine": aff, "points": len(rs), "errors": len(rs) - len(ok),
             "considered": len(used)}
        s.update(_stats("hidden", [r["hidden"] for r in used]))
        s.update(_stats("hidden_op", [r["hidden_op"] for r in used if "hidden_op" in r]))
        s["fusenorm_slower"] = sum(r["t_fused_ms"] > r["t_unfused_ms"] for r in used)
        s["fusenorm_slower_any_share"] = sum(r["t_fused_ms"] > r["t_unfused_ms"] for r in ok)
        s["max_fused_over_unfused"] = max((r["t_fused_ms"] / r["t_unfused_ms"] for r in ok), default=None)
        s["kept_unfused"] = sum(r.get("fuse") is False for r in used)
        s["missed_wins"] = sum(r.get("fuse") is False and r.get("hidden_op", 0) > 0 for r in used)
        out.append(s)
    return out


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------

HEADER = (f"{'K':>5} {'N':>5} {'norm':>5} {'aff':>3} {'dir':>3} {'f':>1} | {'t_mm':>7} {'t_norm':>7} "
          f"{'unfused':>7} {'fused':>7} {'op':>7} | {'hidden':>6} {'op':>5} | {'f/mm':>5} | {'TFLOP/s':>7} "
          f"{'GB/s':>6} {'floor%':>6} | {'path':<24} | peak MiB fused/unfused (bwd: of the training fwd too)")


def _pct(x, width: int) -> str:
    return f"{100 * x:{width - 1}.0f}%" if _num(x) else "-".rjust(width)


def row_line(r: dict) -> str:
    head = (f"{r['K']:5d} {r['N']:5d} {r['norm']:>5} {'on' if r['affine'] else 'off':>3} {r['dir']:>3} "
            f"{r.get('fanout', 1):1d} |")
    if not complete(r):
        return f"{head} error: {r.get('error', 'incomplete')[:150]}"
    times = " ".join(gn._fmt(r.get(t), "7.3f", 7) for t in (*gn.TIMES, "t_op_ms"))
    peaks = " fwd ".join("/".join(gn._fmt(r.get(f"peak_{name}{s}_mib"), ".0f", 1) for name in ("fused", "unfused"))
                         for s in ("", "_fwd")[: 1 + (r["dir"] == "bwd")])
    return (f"{head} {times} | {_pct(r['hidden'], 6)} {_pct(r.get('hidden_op'), 5)} | {r['fused_over_mm']:5.2f} | "
            f"{r['tflops']:7.1f} {r['gbps']:6.0f} {_pct(r['floor_frac'], 6)} | {str(r.get('path'))[:24]:<24} | {peaks}")


def print_summary(summary: list[dict], min_share: float) -> None:
    print(f"\nSummary over points with norm_share >= {100 * min_share:.0f}% (hidden: backend=\"fusenorm\", "
          "dispatch included; op: norm_mm alone, fwd)")
    print(f"{'norm':>5} {'dir':>3} {'f':>1} {'aff':>3} | {'pts':>3} {'used':>4} {'err':>3} | {'med hid':>7} "
          f"{'min hid':>7} | {'med op':>6} {'min op':>6} | slower (any share, worst x) | kept unfused (missed wins)")
    for s in summary:
        worst = gn._fmt(s["max_fused_over_unfused"], ".2f", 4)
        print(f"{s['norm']:>5} {s['dir']:>3} {s['fanout']:1d} {s['affine']:>3} | {s['points']:3d} "
              f"{s['considered']:4d} {s['errors']:3d} | {_pct(s['median_hidden'], 7)} {_pct(s['min_hidden'], 7)} | "
              f"{_pct(s['median_hidden_op'], 6)} {_pct(s['min_hidden_op'], 6)} | {s['fusenorm_slower']:6d} "
              f"({s['fusenorm_slower_any_share']}, {worst}) | {s['kept_unfused']:12d} ({s['missed_wins']})")
    slower = [s for s in summary if s["affine"] == "all"]
    print(f"fusenorm slower than Inductor at {sum(s['fusenorm_slower'] for s in slower)} of "
          f"{sum(s['considered'] for s in slower)} points with norm_share >= {100 * min_share:.0f}% "
          f"({sum(s['fusenorm_slower_any_share'] for s in slower)} of "
          f"{sum(s['points'] - s['errors'] for s in slower)} points in all)")


def plot(data: dict, path: str, min_share: float) -> None:
    """Fan-out 1: heat maps of % hidden over K x N, a panel per (norm, direction), a figure row per affine off /
    on (bench_gemm_norm's panels). Below: a table of the summary per (norm, direction, fan-out)."""
    plt = common.pyplot()
    if plt is None:
        return
    rows = data["rows"]
    single = [r for r in rows if r.get("fanout", 1) == 1]
    combos = [(nm, d) for nm in ("layer", "rms") for d in ("fwd", "bwd")
              if any(r["norm"] == nm and r["dir"] == d for r in single)]
    affines = [a for a in (False, True) if any(r["affine"] == a for r in single)] if combos else []
    table = [s for s in data.get("summary") or summarize(rows, min_share) if s["affine"] == "all"]
    if not affines and not table:
        print("note: no rows to plot")
        return
    ks, ns = sorted({r["K"] for r in single}), sorted({r["N"] for r in single})
    n_cols = max(len(combos), 1)
    heights = [0.9 + 0.4 * len(ks)] * len(affines) + [0.6 + 0.2 * (len(table) + 2)]
    fig = plt.figure(layout="constrained", figsize=(max(8.0, 1.5 + 0.6 * len(ns) * n_cols), 1.4 + sum(heights)))
    spec = fig.add_gridspec(len(heights), n_cols, height_ratios=heights)
    cmap = plt.get_cmap("RdBu").copy()
    cmap.set_bad("lightgrey")
    heat_axes, im = [], None
    for i, aff in enumerate(affines):
        for j, (nm, d) in enumerate(combos):
            ax = fig.add_subplot(spec[i, j])
            heat_axes.append(ax)
            cells = {(r["K"], r["N"]): r for r in single if r["norm"] == nm and r["dir"] == d and r["affine"] == aff}
            im = gn.hidden_panel(ax, cells, ks, ns, min_share, cmap)
            ax.set_xlabel("N" if i == len(affines) - 1 else "", fontsize=8)
            ax.set_ylabel("K" if j == 0 else "", fontsize=8)
            ax.set_title(f"{'LayerNorm' if nm == 'layer' else 'RMSNorm'} {d}, affine {'on' if aff else 'off'}",
                         fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=heat_axes, shrink=0.8, label="% hidden")
    _summary_table(fig.add_subplot(spec[len(affines), :]), table, min_share)
    meta = data.get("meta", {})
    fig.suptitle(f"Pre-norm: % of the norm's time hidden by backend=\"fusenorm\", (t_unfused - t_fused) / t_norm; "
                 f"{meta.get('gpu', '?')}, M = {meta.get('rows', '?')}, {meta.get('timer_kind', '?')}\n"
                 f"fan-out 1. u: fusenorm's dispatch kept it unfused; hatched: norm < {100 * min_share:.0f}% of "
                 "t_unfused; grey: not measured", fontsize=9)
    common.save_figure(fig, path, dpi=130)


def _summary_table(ax, table: list[dict], min_share: float) -> None:
    ax.axis("off")
    if not table:
        return
    cols = ["norm", "dir", "fan-out", "points\nused / all", "median\nhidden", "min\nhidden", "median\nhidden op",
            "fusenorm\nslower", "kept\nunfused"]
    cells = [[s["norm"], s["dir"], f"{s['fanout']} ({FANOUT_ROLE.get(s['fanout'], '?')})",
              f"{s['considered']} / {s['points']}", _pct(s["median_hidden"], 1), _pct(s["min_hidden"], 1),
              _pct(s["median_hidden_op"], 1), str(s["fusenorm_slower"]), str(s["kept_unfused"])] for s in table]
    t = ax.table(cellText=cells, colLabels=cols, loc="upper center", cellLoc="center")
    t.auto_set_font_size(False)
    t.set_fontsize(7)
    t.auto_set_column_width(list(range(len(cols))))
    for (i, _), cell in t.get_celld().items():
        cell.set_height(cell.get_height() * (2.0 if i == 0 else 1.1))  # two-line headers
    ax.set_title(f"Per fan-out, affine off and on together, points with norm_share >= {100 * min_share:.0f}%",
                 fontsize=9)


def report(data: dict, json_path: str, min_share: float, write: bool = True, table: bool = True) -> None:
    data["rows"].sort(key=lambda r: (r["dir"] != "fwd", r.get("fanout", 1), r["K"], r["N"], r["norm"] != "layer",
                                     r["affine"]))
    data.setdefault("meta", {})["min_share"] = min_share
    data["summary"] = summarize(data["rows"], min_share)
    if table:
        print("\n" + HEADER)
        for r in data["rows"]:
            print(row_line(r))
    print_summary(data["summary"], min_share)
    if write:
        common.write_json(json_path, data)
    plot(data, common.png_path(json_path), min_share)


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------

METRICS = {
    "t_mm_ms": "cuBLAS GEMMs alone, all consumers: fwd mm(x, W_i.t()); bwd dy = sum_i dc_i @ W_i (mm, addmm) "
               "and dW_i = dc_i.t() @ y",
    "t_norm_ms": "Inductor's norm alone on x [M, K] (fwd) or its backward: dx, and dw (db) with affine (bwd)",
    "t_unfused_ms": "torch.compile(model, dynamic=False): fwd its forward under no_grad; bwd its compiled "
                    "backward alone (autograd.grad of one forward's outputs, retain_graph), not fwd+bwd - fwd",
    "t_fused_ms": "the same with backend=\"fusenorm\", dispatch included (fuse / path say what ran)",
    "t_op_ms": "fwd: torch.ops.fusenorm.norm_mm alone, once per consumer, its tuned configuration",
    "t_unfused_fwd_ms, t_fused_fwd_ms": "bwd rows: the training forward (grad enabled)",
    "hidden": "(t_unfused - t_fused) / t_norm",
    "hidden_op": "(t_unfused - t_op) / t_norm",
    "fused_over_mm, op_over_mm": "t_fused / t_mm, t_op / t_mm",
    "norm_share": "t_norm / t_unfused",
    "flops": "2 M K N per GEMM, fanout GEMMs (fwd) or 2 x fanout (bwd: data and weight gradients)",
    "bytes": "least traffic: x, the weights and the outputs once each, plus the row statistics (bwd: dc_i, W_i, "
             "x read; dx, dW_i, the norm's dw/db written)",
    "tflops, gbps, floor_ms, floor_frac": "of t_fused; floor = max(flops / matmul peak, bytes / copy bandwidth), "
                                          "floor_frac = floor / t_fused (op_floor_frac: of t_op)",
    "peak_*_mib": "max_memory_allocated during one call above what was allocated before it (outputs and, for "
                  "a training forward, what it saves included), MiB",
    "fwd_peak_saved_mib": "peak_unfused_fwd_mib - peak_fused_fwd_mib",
    "max_abs_diff": "max |fused - unfused| of the first linear's output (fwd) or of dx (bwd); max_abs_diff_op: "
                    "norm_mm against the unfused output",
    "fuse, path, prenorm_reason": "norm_linear_fwd in the fused compile's match reports: rewritten (true, the "
                                  "rewrite's kernel text) or skipped (false, the reason); null: not seen",
    "dgrad_fuse, dgrad_reason": "bwd: the same for dgrad_norm_bwd",
    "fusenorm_rewrites, fusenorm_skips, fusenorm_errors": "everything the fused compile's reports hold",
    "prenorm_choice": "tuning.norm_mm.prenorm_choice for one consumer, asked after the compile (a cache hit)",
}


def meta(args, device: str, ceilings: dict, tuning_settings: dict) -> dict:
    out = gn.meta_block(args, device, ceilings)
    out["grid"].update(fanout=args.fanout, fanout_shapes=args.fanout_shapes)
    out.update(metrics=METRICS, precompile_workers=args.precompile_workers, fusenorm_tuning=tuning_settings,
               model="norm over K -> fanout x nn.Linear(K, N, bias=False); x [M, K]; backend=fusenorm_backend "
                     "(the function registered as \"fusenorm\")",
               functorch={"donated_buffer": False, "enable_autograd_cache": False})
    return out


def done_rows(args) -> dict[tuple, dict]:
    """With --resume: the complete rows already in --out, by point."""
    return common.read_rows(args.out, row_key, complete) if args.resume else {}


def todo_points(args, done: dict) -> list[Point]:
    return [p for p in grid(args) if (args.rows, p.K, p.N, p.norm, p.affine, p.dir, p.fanout) not in done]


def run(args, device: str) -> dict:
    done = done_rows(args)
    points = todo_points(args, done)
    items = work_items(points)
    t_start = time.time()
    cache_dir = os.path.abspath(args.cache_dir or tempfile.mkdtemp(prefix="fusenorm_prenorm_inductor_"))
    os.makedirs(cache_dir, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # fresh unless given: no stale compiles or autotune picks
    print(f"{len(points)} points to measure ({len(done)} kept from {args.out}), {len(items)} functions to compile, "
          f"M = {args.rows}, device {device}, Inductor cache {cache_dir}", flush=True)
    try:
        gn.precompile(args, len(items), cache_dir, script=__file__, argv=grid_argv(args))
        t_pre = time.time()
        tuning_settings = setup(args.tuning_rep_ms)
        bench = Bench(args.timer, args.rep_ms, device)
        ceilings = gn.measure_ceilings(bench, device, args.dry_run)
        print(f"ceilings: bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s",
              flush=True)
        info = meta(args, device, ceilings, tuning_settings)
        rows = list(done.values())
        shared: dict = {}  # t_mm and t_norm, measured once for all the points that share them
        print(HEADER, flush=True)
        for p in points:
            start = time.time()
            row = derive(measure_point(p, args.rows, device, bench, shared), ceilings)
            row["point_s"] = time.time() - start  # wall time: compiles and the dispatch's measurements included
            print(row_line(row), flush=True)
            rows.append(row)
            # After every point: a run stopped by a time limit keeps its rows (rerun with --resume).
            common.write_json(args.out, {"meta": {**info, "partial": True}, "rows": rows}, quiet=True)
        t_end = time.time()
    finally:
        if args.cache_dir is None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    from torch._dynamo.utils import counters

    info["wall_s"] = {"precompile": t_pre - t_start, "ceilings_and_points": t_end - t_pre, "total": t_end - t_start}
    info["fx_graph_cache_main"] = {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    print(f"\nwall time: precompile {t_pre - t_start:.0f} s, ceilings + points {t_end - t_pre:.0f} s; main process "
          f"FX graph cache {info['fx_graph_cache_main']}")
    return {"meta": info, "rows": rows}


def parse_args(argv=None):
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[-2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_opts = [
        ("--rows", f"M (default {DEFAULTS['rows']}; {DRY_DEFAULTS['rows']} with --dry-run)"),
        ("--K", f"the norm's widths (default {DEFAULTS['K']}; {DRY_DEFAULTS['K']} with --dry-run)"),
        ("--N", f"each linear's output widths (default {DEFAULTS['N']}; {DRY_DEFAULTS['N']} with --dry-run)"),
    ]
    for flag, text in grid_opts:
        p.add_argument(flag, default=None, help=text)
    for flag, default in (("--norms", "layer,rms"), ("--affine", "off,on"), ("--dirs", "fwd,bwd"),
                          ("--fanout", "1,2,3")):
        p.add_argument(flag, default=default, help=f"comma list (default {default})")
    p.add_argument("--fanout-shapes", choices=["model", "grid"], default="model",
                   help="model: fan-out 3 at N = K, fan-out 2 at N = 2K (fan-out 1 everywhere); grid: every K x N")
    p.add_argument("--timer", choices=["cudagraph", "events"], default="cudagraph")
    p.add_argument("--rep-ms", type=float, default=30.0, help="GPU time per timing (default 30)")
    p.add_argument("--tuning-rep-ms", type=float, default=None,
                   help="fusenorm_inductor.config.tuning.rep_ms for the dispatch's own measurements")
    p.add_argument("--min-share", type=float, default=0.10, help="summaries: points with norm_share >= this")
    p.add_argument("--precompile-workers", type=int, default=None,
                   help="compile subprocesses (default 8; 2 with --dry-run; 0: none)")
    p.add_argument("--cache-dir", default=None, help="Inductor cache directory (default: a fresh temporary one)")
    p.add_argument("--out", default=None, help=f"JSON to write (default {DEFAULT_OUT}); the PNG goes beside it")
    p.add_argument("--resume", action="store_true", help="keep the complete rows already in --out, measure the rest")
    p.add_argument("--plot-only", metavar="JSON", help="print table and summary and write the PNG of a JSON")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge partial runs into --out")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (times meaningless)")
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    sizes = DRY_DEFAULTS if args.dry_run else DEFAULTS
    args.rows = int(args.rows or sizes["rows"])
    args.K, args.N = ([int(v) for v in (getattr(args, d) or sizes[d]).split(",")] for d in ("K", "N"))
    args.norms = common.choices(p, "--norms", args.norms, ("layer", "rms"))
    args.dirs = common.choices(p, "--dirs", args.dirs, ("fwd", "bwd"))
    args.affine = [a == "on" for a in common.choices(p, "--affine", args.affine, ("off", "on"))]
    args.fanout = [int(f) for f in common.choices(p, "--fanout", args.fanout, ("1", "2", "3"))]
    if args.precompile_workers is None:
        args.precompile_workers = 2 if args.dry_run else 8
    if args.out is None and not args.plot_only:
        args.out = os.path.join(tempfile.gettempdir(), "prenorm_dry_run.json") if args.dry_run else DEFAULT_OUT
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.merge:
        report(common.merge(args.merge, key=row_key), args.out, args.min_share)
        return
    if args.plot_only:  # table, summary and PNG of a written JSON, which stays as it is
        with open(args.plot_only) as f:
            report(json.load(f), args.plot_only, args.min_share, write=False)
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_prenorm needs a CUDA device (--dry-run runs it on the CPU, tiny shapes)")
    device = "cuda" if not args.dry_run else "cpu"
    if args.compile_only:
        setup(args.tuning_rep_ms)
        compile_only(args, device)
        return
    if not grid(args):
        sys.exit("no points: with --fanout-shapes model, fan-out 3 needs N = K and fan-out 2 N = 2K in --K/--N")
    report(run(args, device), args.out, args.min_share, table=False)


if __name__ == "__main__":
    main()
