"""Deferred-norm benchmark (norms between GEMMs): how much of the norms' time fusenorm hides in a GEMM chain.

The deferred normalization: the producer GEMM writes partial row statistics beside its output, the consumer
GEMM applies the norm in its epilogue, so the norm never makes its own pass over [M, N]. Chains (``--chains``):
    chain   x -> linear1 (+bias) (+r) -> norm -> linear2; linear1 maps K -> N, linear2 N -> N
    tower4  4 x (linear (+bias) (+residual) -> norm); the first linear maps K -> N, the others N -> N; the
            last norm's output is the output (so three norms sit between GEMMs, the last one does not)
x [M, K], M = ``--rows`` (262144), bf16, K x N from ``--shapes`` (default every pair of 256..4096),
LayerNorm (eps 1e-5) / RMSNorm (eps 1e-6) with affine (weight ~ 1 + 0.1 randn, LayerNorm bias ~ 0.1 randn).
``--bias on`` gives every linear a bias; ``--residual on`` adds a residual before each norm: r [M, N] (an
input: the residual stream) in ``chain`` and in the tower's first layer, the layer's own input in the tower's
later layers (post-LN). Modes (``--modes``): ``infer`` = the forward under no_grad; ``train`` = the whole step,
parameters' and x's gradients set to None, forward with an MSE loss against a fixed target (inside the
compiled model), backward.

Per point, in ``--rounds`` alternating rounds (order rotating each round), with each timer of ``--timers``:
    t_gemms     the chain's GEMMs alone, eager (cuBLAS through F.linear / torch.mm, no norm, no loss): infer the
                forward GEMMs; train also the backward's, dX = dY @ W and dW = dY.T @ X per linear (3 per linear)
    t_unfused   ``torch.compile(model, dynamic=False)``, Inductor
    t_fused     ``torch.compile(model, backend="fusenorm", dynamic=False)``: what users get, the dispatch included
                (which may leave a norm unfused: ``fused`` says what its match reports list as rewritten)
    aa_ms       a second Inductor compile of the same model (its own compile, not a cache hit): the A/A
    kernels_ms  with ``--kernels CALLS``: each call's mean GPU time per call by kernel name (torch.profiler over
                CALLS calls), for gemms, unfused and fused: where the fused chain's time goes
Timers: ``events`` = common.Bench("events"), do_bench (CUDA events around plain calls, launch cost included
where the GPU waits); ``graphs`` = common.Bench("cudagraph"), the call captured in a CUDA graph and replayed (GPU
time alone; a call that cannot be captured is timed with do_bench and the row says so in ``notes``); ``b2b``
(not in the default) = common.Bench("backtoback"), back-to-back plain calls between two CUDA events, no L2 flush
and no gap between calls, as a serving or training loop runs them (do_bench's flush and gap flattered the
deferred kernels on the H200: docs/history/performance-log.md). Peak
memory of one plain call of each (``peak_*_mib``, above what was allocated before it; train: with the
gradients of the previous step already freed). Each (point, timer) is one row; derived:
    norm_share   (t_unfused - t_gemms) / t_unfused: what is not GEMM in Inductor's time (norms, residual adds,
                 and in train also the loss, bias gradients and the norms' backward)
    norm_hidden  (t_unfused - t_fused) / (t_unfused - t_gemms): the share of that time fusenorm removes
    speedup      median over rounds of t_unfused / t_fused; aa_ratio the same for Inductor / Inductor again,
                 aa_spread = max / min - 1 of Inductor's two medians (common.spread)
Summary per norm x mode x timer over the rows with norm_share >= ``--min-share`` (10%): median and min of
norm_hidden; targets: infer median >= 0.9 and min >= 0.7; train median >= 0.3, min >= 0 and peak_fused <=
peak_unfused on every row of the group.

Run on the GPU machine. The JSON is rewritten after every point; ``--resume`` measures only what is missing,
``--merge`` joins partial runs (e.g. one per chain or per norm, on separate GPUs):
    python benchmarks/bench_deferred_norm.py                 # -> benchmarks/results/deferred_norm_h200.{json,png}
    python benchmarks/bench_deferred_norm.py --chains chain --out /tmp/dn_chain.json
    python benchmarks/bench_deferred_norm.py --chains tower4 --out /tmp/dn_tower.json
    python benchmarks/bench_deferred_norm.py --merge /tmp/dn_chain.json /tmp/dn_tower.json \\
        --out benchmarks/results/deferred_norm_h200.json
    python benchmarks/bench_deferred_norm.py --plot-only benchmarks/results/deferred_norm_h200.json
    python benchmarks/bench_deferred_norm.py --dry-run       # CPU, tiny shapes: checks the calls, not speed
    python benchmarks/bench_deferred_norm.py --dry-run --chains chain --modes infer --norms rms   # a quicker one
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _common  # noqa: E402  (examples/_common.py: compile_model, no_graph_caches)
import bench_gemm_norm as gn  # noqa: E402  (setup_torch, EPS, max_abs_diff)
import common  # noqa: E402  (the shared harness: Bench, alternating rounds, medians, environment, JSON, PNG)

CHAINS = ("chain", "tower4")
NORMS = ("ln", "rms")
MODES = ("infer", "train")
TIMERS = {"events": "events", "graphs": "cudagraph", "b2b": "backtoback"}  # row's timer name -> common.Bench's
DEFAULT_TIMERS = "events,graphs"
TIMER_TEXT = {"events": "common.Bench('events'): do_bench median, CUDA events around plain calls",
              "graphs": "common.Bench('cudagraph'): do_bench_cudagraph median, replays of a captured CUDA graph",
              "b2b": "common.Bench('backtoback'): median of 5 runs of back-to-back plain calls between two events"}
WIDTHS = (256, 512, 1024, 2048, 4096)
DEFAULTS = {"rows": 262144, "shapes": ",".join(f"{k}x{n}" for k in WIDTHS for n in WIDTHS), "rounds": 5,
            "rep_ms": 100.0}
DRY_DEFAULTS = {"rows": 64, "shapes": "64x64", "rounds": 2, "rep_ms": 1.0}
DEFAULT_OUT = "benchmarks/results/deferred_norm_h200.json"
DRY_OUT = "/tmp/deferred_norm_dry_run.json"
PATTERN = "deferred_norm"
# (median >= , min >= ) of norm_hidden; train also needs peak_fused <= peak_unfused.
TARGETS = {"infer": (1.0, 0.85), "train": (0.3, 0.0)}
CANDIDATES = ("gemms", "unfused", "fused", "unfused_aa")


# ----------------------------------------------------------------------------------------------------------
# The model, its inputs, the calls timed
# ----------------------------------------------------------------------------------------------------------


class Chain(nn.Module):
    def __init__(self, chain: str, k: int, n: int, norm: str, bias: bool, residual: bool, device, dtype):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.chain, self.residual = chain, residual
        depth = 4 if chain == "tower4" else 1
        widths = [k] + [n] * depth
        self.linears = nn.ModuleList(nn.Linear(widths[i], n, bias=bias, **kw) for i in range(depth))
        self.norms = nn.ModuleList(
            nn.RMSNorm(n, eps=gn.EPS["rms"], **kw) if norm == "rms" else nn.LayerNorm(n, eps=gn.EPS["layer"], **kw)
            for _ in range(depth))
        if chain == "chain":
            self.linears.append(nn.Linear(n, n, bias=bias, **kw))
        with torch.no_grad():  # not the identity: an affine that changes nothing could be folded away
            for nm in self.norms:
                nm.weight.normal_(1.0, 0.1)
                if getattr(nm, "bias", None) is not None:
                    nm.bias.normal_(0.0, 0.1)

    def forward(self, x, r=None, target=None):
        h = x
        for i, nm in enumerate(self.norms):
            y = self.linears[i](h)
            if self.residual:
                y = y + (r if i == 0 else h)  # the tower's later layers: their input, as a post-LN block
            h = nm(y)
        if self.chain == "chain":
            h = self.linears[-1](h)
        return h if target is None else F.mse_loss(h, target)


def clear_grads(models, x) -> None:
    for m in models:
        m.zero_grad(set_to_none=True)
    x.grad = None


def gemm_call(model: Chain, x: torch.Tensor, g: torch.Tensor, mode: str):
    """The chain's GEMMs alone, eager, without norms: the forward linears in sequence (each reads the previous
    one's output, the shape the norm would have given it); train also, per linear, dX = g @ W and dW = g.T @ X
    with g a fixed [M, N] gradient (bias gradients are reductions, not GEMMs: left to the non-GEMM share)."""
    params = [(lin.weight.detach(), lin.bias.detach() if lin.bias is not None else None) for lin in model.linears]
    x = x.detach()

    def forward():
        ins, h = [], x
        for w, b in params:
            ins.append(h)
            h = F.linear(h, w, b)
        return h, ins

    if mode == "infer":
        return lambda: forward()[0]

    def train():
        h, ins = forward()
        grads = [(torch.mm(g, w), torch.mm(g.t(), a)) for (w, _), a in zip(reversed(params), reversed(ins))]
        return h, grads

    return train


def quack_call(model: Chain, x: torch.Tensor, r, p: dict):
    """quack's hand-called deferred RMSNorm chain (``gemm_rms`` then ``gemm_norm_act``, autotuned on its first
    call, as its users call it), where it does the same fusion by hand: the RMSNorm chain in inference, without
    bias (gemm_rms has none), the residual as its C; None elsewhere or where quack is not installed."""
    if p["chain"] != "chain" or p["norm"] != "rms" or p["mode"] != "infer" or p["bias"] == "on":
        return None
    try:
        from quack.gemm_interface import gemm_norm_act, gemm_rms
    except Exception:  # noqa: BLE001 - not installed: no row
        return None
    w1t, w2t = model.linears[0].weight.detach().t(), model.linears[1].weight.detach().t()
    g, eps = model.norms[0].weight.detach(), model.norms[0].eps
    x = x.detach()

    def chain():
        d, rstd = gemm_rms(x, w1t, C=r, norm_weight=g, eps=eps)
        return gemm_norm_act(d, w2t, rstd=rstd)[1]

    return chain


def launched_backends(call) -> str:
    """Which kernel backends the fused call's deferred GEMMs run on ("quack", "gluon", "gluon+quack", or "none"):
    its launch plans made again on one call, each backend's launches counted."""
    from fusenorm_inductor import backends
    from fusenorm_inductor.ops import deferred_norm

    seen = set()
    saved = {}
    for b in backends.BACKENDS:
        real = type(b).deferred_launch
        saved[type(b)] = real

        def spy(self, *a, real=real, **k):
            seen.add(self.name)
            return real(self, *a, **k)

        type(b).deferred_launch = spy
    try:
        deferred_norm._PLANS.clear()
        call()
        common.sync()
    finally:
        for cls, real in saved.items():
            cls.deferred_launch = real
    return "+".join(sorted(seen)) or "none"


def model_call(cm, models, x, r, target, mode: str):
    if mode == "infer":
        return lambda: cm(x, r)

    def step():
        clear_grads(models, x)
        loss = cm(x, r, target)
        loss.backward()
        return loss.detach()

    return step


# ----------------------------------------------------------------------------------------------------------
# One point
# ----------------------------------------------------------------------------------------------------------


def point_key(r: dict) -> tuple:
    return (r["chain"], r["norm"], r["K"], r["N"], r["mode"], r["M"], r["bias"], r["residual"])


def row_key(r: dict) -> tuple:
    return (*point_key(r), r["timer"])


def measure_point(p: dict, args, device: str) -> list[dict]:
    """The rows of one point (one per timer); an error is recorded in them and the grid goes on."""
    base = {**p, "M": args.rows, "dtype": str(args.dtype).replace("torch.", "")}
    try:
        with _common.no_graph_caches(), (torch.no_grad() if p["mode"] == "infer" else nullcontext()):
            return _measure(p, base, args, device)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return [{**base, "timer": t, "error": f"{type(e).__name__}: {str(e)[:500]}"} for t in args.timers]
    finally:
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()


def _measure(p: dict, base: dict, args, device: str) -> list[dict]:
    import fusenorm_inductor

    m, k, n, mode, dtype = args.rows, p["K"], p["N"], p["mode"], args.dtype
    torch._dynamo.reset()
    torch.manual_seed(0)
    proto = Chain(p["chain"], k, n, p["norm"], p["bias"] == "on", p["residual"] == "on", device, dtype)
    x = torch.randn(m, k, device=device, dtype=dtype).requires_grad_(mode == "train")
    r = torch.randn(m, n, device=device, dtype=dtype) if p["residual"] == "on" else None
    target = torch.randn(m, n, device=device, dtype=dtype) if mode == "train" else None
    g = torch.randn(m, n, device=device, dtype=dtype) if mode == "train" else None
    # Three copies with the same weights, each compiled on its own (common.own_code).
    models = {name: common.own_code(copy.deepcopy(proto)) for name in ("unfused", "fused", "unfused_aa")}
    calls = {"gemms": gemm_call(proto, x, g, mode)}
    row = dict(base, first_call_s={})
    outs = {}
    for name, model in models.items():
        cm = _common.compile_model(model, "fusenorm" if name == "fused" else "inductor", reset=False)
        calls[name] = model_call(cm, models.values(), x, r, target, mode)
        seen = {id(rep) for rep in fusenorm_inductor.reports()}
        t0 = time.perf_counter()
        outs[name] = calls[name]()  # compiles (in train, the backward too) and, for fusenorm, runs its dispatch
        common.sync()
        row["first_call_s"][name] = time.perf_counter() - t0
        if name == "fused":
            reps = [rep for rep in fusenorm_inductor.reports() if id(rep) not in seen]
            row.update(common.fused_patterns(reps, PATTERN))
    if device == "cuda":
        row["backend"] = launched_backends(calls["fused"])
        quack = quack_call(proto, x, r, p)
        if quack is not None:
            t0 = time.perf_counter()
            outs["quack"] = quack()  # its autotuning, outside the timings
            common.sync()
            row["first_call_s"]["quack"] = time.perf_counter() - t0
            calls["quack"] = quack
    rows2d = {name: o.reshape(1, 1) if o.dim() == 0 else o for name, o in outs.items()}  # train: the loss
    if "quack" in rows2d:
        row["quack_max_abs_diff"] = gn.max_abs_diff(rows2d["quack"], rows2d["unfused"])
    row["max_abs_diff"] = gn.max_abs_diff(rows2d["fused"], rows2d["unfused"])
    row["aa_max_abs_diff"] = gn.max_abs_diff(rows2d["unfused_aa"], rows2d["unfused"])
    outs = rows2d = None
    bench0 = common.Bench("events", args.rep_ms, device)
    peaks = {}
    for name, fn in calls.items():
        clear_grads(models.values(), x)  # a step's peak includes the gradients it allocates
        peaks[name] = bench0.peak_mib(fn)
    clear_grads(models.values(), x)
    rows = []
    for timer in args.timers:
        bench = common.Bench(TIMERS[timer], args.rep_ms, device)
        names = {id(fn): name for name, fn in calls.items()}
        notes: dict[str, str] = {}

        def time_one(fn):
            ms, note = bench.time_ms(fn)
            if note:
                notes[names[id(fn)]] = note
            return ms

        rounds = common.alternating(calls, time_one, args.rounds, rotate=True)
        t = common.medians(rounds)
        out = dict(row, timer=timer, t_gemms_ms=t["gemms"], t_unfused_ms=t["unfused"], t_fused_ms=t["fused"],
                   aa_ms=t["unfused_aa"], peak_fused_mib=peaks["fused"], peak_unfused_mib=peaks["unfused"],
                   peak_aa_mib=peaks["unfused_aa"], peak_gemms_mib=peaks["gemms"], rounds_ms=rounds,
                   speedup=common.ratio_median(rounds, "unfused", "fused"),
                   aa_ratio=common.ratio_median(rounds, "unfused", "unfused_aa"),
                   aa_spread=common.spread([t["unfused"], t["unfused_aa"]]))
        if "quack" in t:
            out.update(t_quack_ms=t["quack"], peak_quack_mib=peaks["quack"],
                       fused_vs_quack=common.ratio_median(rounds, "quack", "fused"))
        if notes:
            out["notes"] = [f"{k}: {v}" for k, v in notes.items()]
        rows.append(derive(out))
    if args.kernels and device == "cuda":
        # Where the time goes: each call's GPU time by kernel (torch.profiler), the same on every timer's row.
        kernels = {name: common.profile_kernels(fn, args.kernels) for name, fn in calls.items()
                   if name != "unfused_aa"}
        for r in rows:
            r["kernels_ms"] = kernels
    return rows


def print_kernels(r: dict, top: int = 8) -> None:
    """The ``top`` kernels of each call of a row with ``kernels_ms`` (``--kernels``), and their sums."""
    for name, ks in r.get("kernels_ms", {}).items():
        print(f"    {name:>8}: {sum(ks.values()):.3f} ms in {len(ks)} kernels")
        for k, ms in list(ks.items())[:top]:
            print(f"      {ms:8.3f}  {k}")


def derive(r: dict) -> dict:
    t_g, t_u, t_f = r["t_gemms_ms"], r["t_unfused_ms"], r["t_fused_ms"]
    r["norm_share"] = (t_u - t_g) / t_u if t_u > 0 else None
    r["norm_hidden"] = (t_u - t_f) / (t_u - t_g) if t_u - t_g > 0 else None
    return r


# ----------------------------------------------------------------------------------------------------------
# Summary, table, plot
# ----------------------------------------------------------------------------------------------------------


def _ok(r: dict) -> bool:
    return "error" not in r and isinstance(r.get("t_fused_ms"), (int, float))


def summarize(rows: list[dict], min_share: float) -> list[dict]:
    """Per norm x mode x timer: median and min of norm_hidden over the rows whose norm_share >= min_share, and
    whether the mode's target holds (train: also peak_fused <= peak_unfused on every row of the group that
    has peaks, i.e. on CUDA)."""
    out = []
    groups = sorted({(r["norm"], r["mode"], r["timer"]) for r in rows if _ok(r)},
                    key=lambda g: (MODES.index(g[1]), g[2], g[0]))
    for norm, mode, timer in groups:
        group = [r for r in rows if _ok(r) and (r["norm"], r["mode"], r["timer"]) == (norm, mode, timer)]
        vals = [r["norm_hidden"] for r in group
                if r.get("norm_share") is not None and r["norm_share"] >= min_share and r["norm_hidden"] is not None]
        med_goal, min_goal = TARGETS[mode]
        s = {"norm": norm, "mode": mode, "timer": timer, "points": len(group), "points_used": len(vals),
             "median_norm_hidden": statistics.median(vals) if vals else None,
             "min_norm_hidden": min(vals, default=None),
             "goal": {"median": med_goal, "min": min_goal}}
        met = bool(vals) and s["median_norm_hidden"] >= med_goal and s["min_norm_hidden"] >= min_goal
        behind = [r["t_fused_ms"] / r["t_quack_ms"] - 1 for r in group if r.get("t_quack_ms")]
        if behind:  # fusenorm's compiled chain against quack's hand-called one (goal: 2% median, 5% worst)
            s["behind_quack_median"], s["behind_quack_max"] = statistics.median(behind), max(behind)
        if mode == "train":
            peaks = [(r["peak_fused_mib"], r["peak_unfused_mib"]) for r in group
                     if r.get("peak_fused_mib") is not None and r.get("peak_unfused_mib") is not None]
            s["peak_over"] = sum(f > u for f, u in peaks)
            s["peak_ok"] = bool(peaks) and not s["peak_over"]
            s["goal"]["peak"] = "peak_fused <= peak_unfused"
            met = met and s["peak_ok"]
        s["met"] = met
        out.append(s)
    return out


def _f(x, spec: str, width: int = 0) -> str:
    return (format(x, spec) if isinstance(x, (int, float)) else "-").rjust(width)


def print_table(rows: list[dict], summary: list[dict], min_share: float) -> None:
    print(f"\n{'chain':>6} {'norm':>4} {'K':>5} {'N':>5} {'mode':>5} {'timer':>6} | {'gemms':>8} {'unfused':>8} "
          f"{'fused':>8} {'A/A':>8} ms | {'share':>6} {'hidden':>7} {'speedup':>7} {'aa':>6} | "
          f"{'peak MiB f/u':>13} | fused")
    for r in rows:
        head = f"{r['chain']:>6} {r['norm']:>4} {r['K']:5d} {r['N']:5d} {r['mode']:>5} {r['timer']:>6}"
        if not _ok(r):
            print(f"{head} | ERROR {r.get('error')}")
            continue
        peak = f"{_f(r['peak_fused_mib'], '.0f')}/{_f(r['peak_unfused_mib'], '.0f')}"
        print(f"{head} | {_f(r['t_gemms_ms'], '.3f', 8)} {_f(r['t_unfused_ms'], '.3f', 8)} "
              f"{_f(r['t_fused_ms'], '.3f', 8)} {_f(r['aa_ms'], '.3f', 8)}    | {_f(r['norm_share'], '.0%', 6)} "
              f"{_f(r['norm_hidden'], '.0%', 7)} {_f(r['speedup'], '.3f', 7)} {_f(r['aa_spread'], '.1%', 6)} | "
              f"{peak:>13} | {r['fused']}")
    print(f"\nsummary: norm_hidden over the rows with norm_share >= {min_share:.0%}; targets: infer median >= "
          f"{TARGETS['infer'][0]:.0%}, min >= {TARGETS['infer'][1]:.0%}; train median >= {TARGETS['train'][0]:.0%}, "
          f"min >= {TARGETS['train'][1]:.0%}, peak_fused <= peak_unfused")
    for s in summary:
        peak = (f", peak fused > unfused on {s['peak_over']} row(s)" if s.get("peak_over")
                else (", peak ok" if s.get("peak_ok") else (", peak n/a" if s["mode"] == "train" else "")))
        print(f"  {s['norm']:>4} {s['mode']:>5} {s['timer']:>6}: {s['points_used']}/{s['points']} rows, median "
              f"{_f(s['median_norm_hidden'], '.0%')}, min {_f(s['min_norm_hidden'], '.0%')}{peak}: "
              f"{'met' if s['met'] else 'NOT met'}")


def plot(data: dict, path: str) -> None:
    """norm_hidden per K x N, one panel per mode x timer, a line per chain x norm; the targets' medians dashed."""
    plt = common.pyplot()
    rows = [r for r in data["rows"] if _ok(r) and r.get("norm_hidden") is not None]
    if plt is None or not rows:
        return
    panels = sorted({(r["mode"], r["timer"]) for r in rows}, key=lambda p: (MODES.index(p[0]), p[1]))
    shapes = sorted({(r["K"], r["N"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6, 0.35 * len(shapes)) * len(panels), 4), squeeze=False)
    for ax, (mode, timer) in zip(axes[0], panels):
        for chain in CHAINS:
            for norm in NORMS:
                pts = sorted(((shapes.index((r["K"], r["N"])), r["norm_hidden"]) for r in rows
                              if (r["mode"], r["timer"], r["chain"], r["norm"]) == (mode, timer, chain, norm)))
                if pts:
                    ax.plot(*zip(*pts), "o-" if chain == "chain" else "s--", ms=3, lw=1, label=f"{chain} {norm}")
        ax.axhline(TARGETS[mode][0], color="k", ls=":", lw=0.8)
        ax.axhline(0.0, color="gray", lw=0.5)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{k}x{n}" for k, n in shapes], rotation=90, fontsize=6)
        ax.set_title(f"{mode}, {timer}", fontsize=9)
        ax.set_ylabel("norm_hidden")
        ax.legend(fontsize=6)
    m = data["meta"]
    fig.suptitle(f"deferred norm: share of the non-GEMM time fusenorm removes, M = {m.get('rows')}, {m.get('gpu')}, "
                 f"torch {m.get('torch')}, {m.get('date')}", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, path, dpi=110)


def report(data: dict, out: str, min_share: float, write: bool = True) -> None:
    data["summary"] = summarize(data["rows"], min_share)
    if write:
        common.write_json(out, data)
    print_table(data["rows"], data["summary"], min_share)
    plot(data, common.png_path(out))


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def meta_block(args, device: str, tuning: dict) -> dict:
    return {
        **common.environment(device), "script": "benchmarks/bench_deferred_norm.py", "device": device,
        "dtype": str(args.dtype).replace("torch.", ""), "rows": args.rows, "dry_run": args.dry_run,
        "grid": {"chains": args.chains, "shapes": args.shapes, "norms": args.norms, "modes": args.modes,
                 "bias": args.bias, "residual": args.residual},
        "timers": ({t: TIMER_TEXT[t] for t in args.timers} if device == "cuda"
                   else "wall clock, CPU (dry run: meaningless)"),
        "rounds": args.rounds, "rep_ms": args.rep_ms, "min_share": args.min_share,
        "compile": "torch.compile(model, backend=..., dynamic=False); FX graph / AOTAutograd caches off; each model "
                   "its own code object (an independent compile)",
        "fusenorm_tuning": tuning,
        "targets": {mode: {"median_norm_hidden": a, "min_norm_hidden": b} for mode, (a, b) in TARGETS.items()},
        "metrics": {
            "t_gemms_ms": "the chain's GEMMs alone, eager cuBLAS (train: forward and backward, 3 per linear)",
            "t_unfused_ms": "Inductor's compiled chain (train: the whole step)",
            "t_fused_ms": "fusenorm's compiled chain (train: the whole step)",
            "t_quack_ms": "quack's hand-called chain (gemm_rms + gemm_norm_act, autotuned on its first call): the RMSNorm "
                          "chain in inference without bias, where quack is installed",
            "fused_vs_quack": "median of per-round t_quack / t_fused (above 1: fusenorm faster)",
            "backend": "the kernel backends fusenorm's compiled chain launched its deferred GEMMs on",
            "aa_ms": "a second, independent Inductor compile", "aa_ratio": "median of per-round t_unfused / aa",
            "aa_spread": "max / min - 1 of t_unfused and aa_ms", "speedup": "median of per-round t_unfused / t_fused",
            "norm_share": "(t_unfused - t_gemms) / t_unfused",
            "norm_hidden": "(t_unfused - t_fused) / (t_unfused - t_gemms)",
            "peak_*_mib": "max_memory_allocated of one plain call above what was allocated before it",
            "fused": "non-canonical patterns in the fused compile's match reports, 'pattern xN' or 'none'",
            "max_abs_diff": "max |fused - unfused| of the output (infer) or the loss (train) of the first call",
        },
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--chains", default=",".join(CHAINS), help="comma list of chain, tower4")
    p.add_argument("--rows", type=int, default=None, help=f"M (default {DEFAULTS['rows']}; "
                   f"{DRY_DEFAULTS['rows']} with --dry-run)")
    p.add_argument("--shapes", default=None, help="KxN,KxN,... (default every pair of 256..4096; "
                   f"{DRY_DEFAULTS['shapes']} with --dry-run)")
    p.add_argument("--norms", default=",".join(NORMS), help="comma list of ln, rms")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of infer (no_grad forward) and train "
                   "(forward + MSE loss + backward, gradients set to None)")
    p.add_argument("--timers", default=DEFAULT_TIMERS, help="comma list of events (plain calls, do_bench), graphs "
                   "(CUDA-graph replays; skipped on the CPU) and b2b (back-to-back plain calls)")
    p.add_argument("--bias", default="on", help="comma list of on, off: the linears' bias")
    p.add_argument("--residual", default="off", help="comma list of off, on: a residual added before each norm")
    p.add_argument("--rounds", type=int, default=None, help=f"alternating rounds (default {DEFAULTS['rounds']})")
    p.add_argument("--rep-ms", type=float, default=None, help=f"Bench's rep_ms (default {DEFAULTS['rep_ms']})")
    p.add_argument("--kernels", type=int, default=0, metavar="CALLS",
                   help="also profile CALLS calls of the GEMMs, Inductor and fusenorm per point and record each "
                        "one's GPU time by kernel (kernels_ms); 0: off (CUDA only)")
    p.add_argument("--min-share", type=float, default=0.10, help="the summary's rows: norm_share >= this")
    p.add_argument("--out", default=None, help=f"JSON to write (default {DEFAULT_OUT}; {DRY_OUT} with --dry-run); "
                   "the PNG goes beside it")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out, measure the others")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge partial runs into --out, summarize, plot")
    p.add_argument("--plot-only", metavar="JSON", help="summarize and redraw the PNG of a finished run; no timing")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (times meaningless)")
    a = p.parse_args(argv)
    sizes = DRY_DEFAULTS if a.dry_run else DEFAULTS
    a.chains = common.choices(p, "--chains", a.chains, CHAINS)
    a.norms = common.choices(p, "--norms", a.norms, NORMS)
    a.modes = common.choices(p, "--modes", a.modes, MODES)
    a.timers = common.choices(p, "--timers", a.timers, tuple(TIMERS))
    a.bias = common.choices(p, "--bias", a.bias, ("on", "off"))
    a.residual = common.choices(p, "--residual", a.residual, ("on", "off"))
    a.rows = a.rows or sizes["rows"]
    a.shapes = a.shapes or sizes["shapes"]
    try:
        a.shape_list = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",") if s.strip()]
        assert a.shape_list and all(len(s) == 2 and min(s) > 0 for s in a.shape_list)
    except (ValueError, AssertionError):
        p.error(f"--shapes: {a.shapes!r} is not a list KxN,KxN,...")
    if a.kernels < 0:
        p.error(f"--kernels: {a.kernels} is not a number of calls (0: off)")
    a.rounds = a.rounds or sizes["rounds"]
    a.rep_ms = a.rep_ms or sizes["rep_ms"]
    a.out = a.out or (DRY_OUT if a.dry_run else DEFAULT_OUT)
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge:
        data = common.merge(args.merge, key=row_key)
        report(data, args.out, args.min_share)
        return data
    if args.plot_only:
        with open(args.plot_only) as f:
            data = json.load(f)
        report(data, args.plot_only, args.min_share, write=False)
        return data
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_deferred_norm needs a CUDA device (--dry-run runs it on the CPU, tiny shapes)")
    if device == "cpu" and "graphs" in args.timers:
        print("note: no CUDA graphs on the CPU: timer 'graphs' skipped")
        args.timers = [t for t in args.timers if t != "graphs"] or ["events"]
    args.dtype = torch.bfloat16
    if args.dry_run:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.vec_isa_ok = False  # scalar C++ kernels compile faster; CPU times mean nothing
    tuning = gn.setup_torch()  # fusenorm registered, not enabled globally: the baseline stays plain Inductor
    meta = meta_block(args, device, tuning)
    done = common.read_rows(args.out, row_key, _ok) if args.resume else {}
    rows = list(done.values())
    points = [{"chain": c, "norm": nm, "K": k, "N": n, "mode": mode, "bias": b, "residual": res}
              for c in args.chains for mode in args.modes for k, n in args.shape_list for nm in args.norms
              for b in args.bias for res in args.residual]
    t_start = time.time()
    for i, pt in enumerate(points):
        if all((*point_key({**pt, "M": args.rows}), t) in done for t in args.timers):
            continue
        t0 = time.time()
        new = measure_point(pt, args, device)
        keys = {row_key(r) for r in new}
        rows = [r for r in rows if row_key(r) not in keys] + new
        for r in new:
            state = f"ERROR {r['error']}" if not _ok(r) else (
                f"gemms {r['t_gemms_ms']:.3f} unfused {r['t_unfused_ms']:.3f} fused {r['t_fused_ms']:.3f} "
                f"(A/A {r['aa_ms']:.3f}) ms, hidden {_f(r['norm_hidden'], '.0%')}, fused: {r['fused']}")
            print(f"[{i + 1}/{len(points)}] {pt['chain']} {pt['norm']} {pt['K']}x{pt['N']} {pt['mode']} "
                  f"{r['timer']}: {state} ({time.time() - t0:.0f} s)", flush=True)
        if new and _ok(new[0]):
            print_kernels(new[0])
        common.write_json(args.out, {"meta": {**meta, "partial": True}, "rows": rows}, quiet=True)
    meta["wall_s"] = time.time() - t_start
    data = {"meta": meta, "rows": rows}
    report(data, args.out, args.min_share)
    return data


if __name__ == "__main__":
    main()
