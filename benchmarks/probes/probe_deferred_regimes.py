"""Probe: the deferred chain's time under three ways of running it, and its GEMMs alone against cuBLAS.

bench_deferred_norm's ``events`` timer (triton's do_bench: the L2 flushed before each call, a short idle gap
between calls) showed the deferred chain hiding about half of its norm, where back-to-back calls and CUDA-graph
replays (how a serving or training loop runs) showed nothing hidden or worse. This probe measures each regime
on the chain ``x -> linear (+bias) -> norm -> linear (+bias)``, K = N = 1024 (``--shape``), bf16, M = 262144
unless given:

``--part regimes``   per norm (LayerNorm, RMSNorm) and M (262144, 16384): cuBLAS's GEMMs alone, Inductor, fusenorm,
                     each timed as do_bench (flushed), a CUDA-graph replay, 50 back-to-back calls between two
                     syncs (wall per call) and their host time per call (the loop before the final sync); one
                     call under ``torch.cuda.set_sync_debug_mode("warn")``; for LayerNorm at the large M a
                     cProfile of 30 calls (the host path of the deferred GEMMs); then the match report of a
                     training step per norm (what the dispatch chose, with its measured times).
``--part kernels``   the deferred GEMM alone (plain epilogue, producer writing LayerNorm statistics, consumer
                     applying them) for every Gluon candidate, against cuBLAS's ``F.linear``: flushed (do_bench)
                     and sustained (600 back-to-back calls between two events), with the SM clock and board power
                     sampled by nvidia-smi during the sustained loop; two rounds.
``--part span``      LayerNorm: 40 back-to-back calls of each under torch.profiler: the GPU's busy time per call
                     (the kernels' sum) against the span from the first kernel's start to the last one's end;
                     the difference is time the GPU waited for the host. Two rounds.
``--part tuner``     the producer and consumer GEMMs (LayerNorm) of the first two Gluon candidates and cuBLAS's
                     ``F.linear``, each called the way the dispatch times candidates (``kernels.deferred.launch``:
                     a plan made and the fold run per call) and through the op's cached plan: the dispatch's
                     timer (``measure.time_ms``, CUDA-graph replays), do_bench, 200 back-to-back calls, the
                     host time per call; and the kernels of a CUDA graph of 10 calls, by name. Two rounds.
``--part graph``     LayerNorm: each call captured in a CUDA graph (``torch.cuda.graph``) and replayed 40 times
                     under torch.profiler, then 40 eager calls the same way: GPU time per call by kernel in
                     each, and the replays' time per call between two events. Two rounds.

    python benchmarks/probes/probe_deferred_regimes.py --part kernels --out /tmp/kernels.txt

Results (2026-12-05): benchmarks/results/probe_deferred_regimes_h200.txt (regimes, kernels, span; an H200;
the regimes part with ``--tuning-rep 10``, as bench_deferred_norm runs) and probe_deferred_regimes_graph_h100.txt
(graph; an H100). Findings: docs/history/performance-log.md,
"Deferred normalization".
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _common  # noqa: E402
import bench_deferred_norm as bd  # noqa: E402  (the Chain model, the GEMMs-alone call)
import common  # noqa: E402

K = N = 1024  # --shape


class Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "w")

    def __call__(self, *parts) -> None:
        s = " ".join(str(p) for p in parts)
        print(s, flush=True)
        self.f.write(s + "\n")
        self.f.flush()


def chain_calls(norm: str, m: int, mode: str = "infer"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    proto = bd.Chain("chain", K, N, norm, True, False, "cuda", torch.bfloat16)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "train")
    fused = _common.compile_model(common.own_code(copy.deepcopy(proto)), "fusenorm", reset=False)
    if mode == "train":
        return fused, x
    unfused = _common.compile_model(common.own_code(copy.deepcopy(proto)), "inductor", reset=False)
    return {"gemms": bd.gemm_call(proto, x, None, "infer"), "unfused": lambda: unfused(x), "fused": lambda: fused(x)}


def part_regimes(P, rows: list[int]) -> None:
    import fusenorm_inductor

    for m in rows:
        for norm in ("ln", "rms"):
            calls = chain_calls(norm, m)
            with torch.no_grad():
                for f in calls.values():
                    f()
                torch.cuda.synchronize()
                for rep in fusenorm_inductor.reports()[-1:]:
                    P(rep.to_markdown()[:1500])
                for name, f in calls.items():
                    flushed = common.do_bench_ms(f, rep=100, warmup=25)
                    try:
                        graph = f"{common.cudagraph_ms(f, rep=10):.3f}"
                    except Exception as e:  # noqa: BLE001 - say why, go on
                        graph = f"failed ({type(e).__name__})"
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        f()
                    host_us = (time.perf_counter() - t0) / 50 * 1e6
                    torch.cuda.synchronize()
                    wall_ms = (time.perf_counter() - t0) / 50 * 1e3
                    P(f"M={m} {norm} {name}: events {flushed:.3f} graph {graph} back2back {wall_ms:.3f} ms "
                      f"host {host_us:.0f} us/call")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    calls["fused"]()
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode(0)
                P("sync warnings:", [str(w.message)[:200] for w in caught][:5])
                if m == rows[0] and norm == "ln":
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(30):
                        calls["fused"]()
                    prof.disable()
                    torch.cuda.synchronize()
                    for order, top in (("tottime", 30), ("cumulative", 40)):
                        s = io.StringIO()
                        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(top)
                        P(s.getvalue()[:8000])
    for norm in ("rms", "ln"):  # training: what the dispatch chose, and why
        fused, x = chain_calls(norm, rows[0], "train")
        target = torch.randn_like(x)
        n0 = len(fusenorm_inductor.reports())
        fused(x, None, target).backward()
        torch.cuda.synchronize()
        for rep in fusenorm_inductor.reports()[n0:]:
            P(f"--- train {norm} report")
            P(rep.to_markdown()[:5000])


def sustained(fn, calls: int) -> tuple[float, float, float]:
    """(ms per call of ``calls`` back-to-back calls between two events, mean SM clock MHz, mean power W over
    the loop's last two thirds of nvidia-smi samples)."""
    mon = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    torch.cuda.synchronize()
    ms = common.events_ms(fn, calls)
    mon.terminate()
    samples = [tuple(float(v) for v in line.split(",")) for line in mon.communicate()[0].strip().splitlines()
               if "," in line]
    samples = samples[len(samples) // 3:] or samples
    n = max(1, len(samples))
    return ms, sum(s[0] for s in samples) / n, sum(s[1] for s in samples) / n


def gemm_operands(m: int) -> tuple:
    """(a [m, K], w [N, K], b = w.t(), bias, norm weight and bias [K], a's LayerNorm statistics in 128-column
    tiles): one GEMM of the chain, bf16, seeded."""
    from fusenorm_inductor.kernels.deferred import LN, partial_stats

    torch.manual_seed(0)
    dt = torch.bfloat16
    a = torch.randn(m, K, device="cuda", dtype=dt)
    w = torch.randn(N, K, device="cuda", dtype=dt) / 32
    bias = torch.randn(N, device="cuda", dtype=dt)
    nw = 1 + 0.1 * torch.randn(K, device="cuda", dtype=dt)
    nb = 0.1 * torch.randn(K, device="cuda", dtype=dt)
    return a, w, w.t(), bias, nw, nb, partial_stats(a, LN, 128)


def kernel_ms(prof, calls: int) -> dict:
    """GPU ms per call of each kernel name (cut to 48 characters) in a torch.profiler run of ``calls`` calls."""
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:48]] = out.get(e.name[:48], 0.0) + e.device_time / calls / 1e3
    return out


def part_kernels(P, m: int) -> None:
    from fusenorm_inductor.kernels.deferred import LN, NONE
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper
    from fusenorm_inductor.ops.deferred_norm import deferred_mm_tuned

    a, w, b, bias, nw, nb, stats = gemm_operands(m)
    calls = {"cublas": lambda: F.linear(a, w, bias)}
    for cfg in hopper.candidates(a, b, 128):
        label = cfg.label()
        plain = (a, b, bias, None, None, None, None, 0.0, NONE, 0, NONE, 0, False, None)
        prod = (a, b, bias, None, None, None, None, 0.0, NONE, 0, LN, 128, False, None)
        cons = (a, b, bias, None, stats, nw, nb, 1e-5, LN, 128, NONE, 0, True, None)
        for kind, args in (("plain", plain), ("prod", prod), ("cons", cons)):
            calls[f"{kind} {label}"] = lambda c=cfg, args=args: deferred_mm_tuned(args, c)
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    for rnd in range(2):
        for name, fn in calls.items():
            flushed = common.do_bench_ms(fn, rep=100, warmup=25)
            ms, clk, watts = sustained(fn, 600)
            time.sleep(1.0)
            P(f"round {rnd} {name:28s} flushed {flushed:.3f} ms  sustained {ms:.3f} ms  sm_clk {clk:.0f} MHz  "
              f"power {watts:.0f} W")


def part_span(P, m: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    calls = chain_calls("ln", m)
    with torch.no_grad():
        for f in calls.values():
            f()
            f()
        for rnd in range(2):
            for name, f in calls.items():
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(40):
                        f()
                    torch.cuda.synchronize()
                ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                busy = sum(e.device_time for e in ev) / 40 / 1e3
                span = (max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)) / 40 / 1e3
                top = sorted(kernel_ms(prof, 40).items(), key=lambda kv: -kv[1])[:4]
                P(f"round {rnd} {name}: busy {busy:.3f} ms/call, span {span:.3f} ms/call, idle {span - busy:.3f}; "
                  + ", ".join(f"{k} {v:.3f}" for k, v in top))


def part_graph(P, m: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    calls = chain_calls("ln", m)
    with torch.no_grad():
        graphs = {}
        for name, f in calls.items():
            f()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            graphs[name] = g
        for rnd in range(2):
            for name, f in calls.items():
                for how, fn in (("graph", graphs[name].replay), ("eager", f)):
                    fn()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        e0.record()
                        for _ in range(40):
                            fn()
                        e1.record()
                        torch.cuda.synchronize()
                    by_name = kernel_ms(prof, 40)
                    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:4]
                    P(f"round {rnd} {name} {how}: {e0.elapsed_time(e1) / 40:.3f} ms/call (events); kernels "
                      f"{sum(by_name.values()):.3f}: " + ", ".join(f"{k} {v:.3f}" for k, v in top))


def part_tuner(P, m: int) -> None:
    """The deferred GEMMs as the dispatch times them against the other timers, per kernel."""
    from torch.profiler import ProfilerActivity, profile

    from fusenorm_inductor.kernels import deferred as op
    from fusenorm_inductor.kernels.deferred import LN, NONE
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper
    from fusenorm_inductor.ops.deferred_norm import _alloc
    from fusenorm_inductor.tuning import measure

    a, w, b, bias, nw, nb, stats = gemm_operands(m)
    calls = {"cublas": lambda: F.linear(a, w, bias)}
    for cfg in hopper.candidates(a, b, 128)[:2]:
        prod = (a, b, bias, None, None, None, None, 0.0, NONE, 0, LN, 128, False, None)
        cons = (a, b, bias, None, stats, nw, nb, 1e-5, LN, 128, NONE, 0, False, None)
        for kind, args in (("prod", prod), ("cons", cons)):
            made: list = []
            op.launch(args, cfg, _alloc, made)
            # the tuner's call (a plan made per call, the fold per call) and the op's cached plan
            calls[f"{kind} {cfg.label()} tuner"] = lambda c=cfg, args=args: op.launch(args, c, _alloc)
            calls[f"{kind} {cfg.label()} plan"] = lambda args=args, made=made: made[0](*args)
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    for rnd in range(2):
        for name, fn in calls.items():
            tuner = measure.time_ms(fn)
            flushed = common.do_bench_ms(fn, rep=50, warmup=10)
            b2b = common.events_ms(fn, 200)
            host = measure.host_us(fn)
            P(f"round {rnd} {name:34s} time_ms {tuner:.3f} flushed {flushed:.3f} b2b {b2b:.3f} ms host {host:.0f} us")
            if rnd == 0:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(10):
                        fn()
                g.replay()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    g.replay()
                    torch.cuda.synchronize()
                P("    graph of 10 by kernel (ms per fn call): "
                  + "; ".join(f"{k} {t:.3f}" for k, t in sorted(kernel_ms(prof, 10).items(), key=lambda kv: -kv[1])))


def main() -> None:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("regimes", "kernels", "span", "graph", "tuner"), required=True)
    p.add_argument("--rows", default="262144,16384", help="M: comma list (kernels and span take the first)")
    p.add_argument("--shape", default="1024x1024", help="KxN of the chain (the kernels part: of its one GEMM)")
    p.add_argument("--tuning-rep", type=float, default=10.0, help="fusenorm's tuning rep_ms (bench_deferred_norm's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    global K, N
    K, N = (int(v) for v in args.shape.split("x"))
    bd.gn.setup_torch(args.tuning_rep)
    log = Log(args.out)
    {"regimes": lambda: part_regimes(log, rows), "kernels": lambda: part_kernels(log, rows[0]),
     "span": lambda: part_span(log, rows[0]), "graph": lambda: part_graph(log, rows[0]),
     "tuner": lambda: part_tuner(log, rows[0])}[args.part]()


if __name__ == "__main__":
    main()
