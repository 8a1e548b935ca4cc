"""Host cost and the regressions of issue 16 on CUDA: what a fused call costs the CPU, and whole steps with and
without CUDA graphs, fusenorm against plain Inductor.

Parts (``--parts``, default all):
    ops      host time per call (wall time of a loop of calls on tiny inputs, GPU idle: the CPU is the bound):
             torch.mm (cuBLAS), one Triton kernel launch, the unfused pair, a custom op wrapping one Triton
             launch, and each fused op (fusenorm::mm_norm, norm_mm, mm_norm_backward) as the compiled graph
             calls it; plus a cProfile of the fused forward's call (top functions, in the JSON).
    steps    a stack of ``--layers`` (8) x (Linear -> LayerNorm) blocks, d = 256, compiled ``dynamic=False``
             by Inductor and by fusenorm: time per step (forward under no_grad, and forward + backward) at
             M = 512 rows (host-bound) and M = 131072 (GPU-bound), without CUDA graphs and with them
             (``mode="reduce-overhead"``), alternating rounds, medians.
    regress  the inference regressions of issue 16, "Why" 1: ``Linear(256, 256, bias=False) -> RMSNorm(256)``
             and ``-> LayerNorm(256)``, and ``RMSNorm(256) -> Linear(256, 256)``, M = 262144, bf16, forward under
             no_grad compiled after the same module was compiled and run for training; and the training step
             of ``LayerNorm(256) -> Linear(256, 256)``. fusenorm / Inductor time, alternating rounds, next to
             Inductor against a second compile of itself (``ratio_aa``: the noise).

    python benchmarks/bench_host_cost.py --out benchmarks/results/host_cost_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import time

import torch
import torch.nn as nn

import fusenorm_inductor  # noqa: F401  (registers the ops and the backend)


def wall_us_per_call(fn, calls: int = 2000, rounds: int = 5) -> float:
    """Median over rounds of the wall time per call of a loop of ``calls`` calls (synchronized at the ends)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def step_ms(fn, steps: int = 30) -> float:
    """Time per step of ``steps`` back-to-back steps (CUDA events; no sync inside: the host cost counts when
    the GPU waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def alternating(fns: dict, rounds: int = 7, steps: int = 30) -> dict:
    """Median step time of each function, timed in alternating rounds."""
    for f in fns.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(step_ms(f, steps))
    return {k: statistics.median(v) for k, v in times.items()}


# ---- ops ------------------------------------------------------------------------------------------------------


def part_ops() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    @torch.library.custom_op("fusenorm_bench::copy", mutates_args=())
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        _copy[(1,)](x, y, x.numel(), BLOCK=1024)
        return y

    dev, dt = "cuda", torch.bfloat16
    m, k, n = 256, 256, 256
    a = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
    b = w.t()
    lw = torch.randn(n, device=dev, dtype=dt)
    x = torch.randn(m * k, device=dev, dtype=dt)
    y = torch.empty_like(x)
    mm_norm = torch.ops.fusenorm.mm_norm.default
    norm_mm = torch.ops.fusenorm.norm_mm.default
    mm_norm_bwd = torch.ops.fusenorm.mm_norm_backward.default
    h = torch.randn(m, n, device=dev, dtype=dt)
    rstd = torch.rand(m, device=dev) + 0.5
    fns = {
        "torch.mm": lambda: torch.mm(a, b),
        "triton launch": lambda: _copy[(1,)](x, y, x.numel(), BLOCK=1024),
        "unfused pair (mm + triton launch)": lambda: (torch.mm(a, b), _copy[(1,)](x, y, x.numel(), BLOCK=1024)),
        "custom op wrapping one triton launch": lambda: wrapped(x),
        "fusenorm::mm_norm (RMSNorm, affine, no_grad)": lambda: mm_norm(a, b, None, None, lw, None, 1e-6, True, dt,
                                                                         False),
        "fusenorm::mm_norm (LayerNorm, affine, save hh)": lambda: mm_norm(a, b, None, None, lw, lw, 1e-5, False, dt,
                                                                           True),
        "fusenorm::norm_mm (RMSNorm, affine)": lambda: norm_mm(a, b, None, lw, None, 1e-6, True, dt),
        "fusenorm::mm_norm_backward (RMSNorm)": lambda: mm_norm_bwd(h, w, None, h, lw, None, rstd, True, True,
                                                                      False, dt),
    }
    out = {name: wall_us_per_call(fn) for name, fn in fns.items()}
    prof = cProfile.Profile()
    fn = fns["fusenorm::mm_norm (RMSNorm, affine, no_grad)"]
    prof.enable()
    for _ in range(500):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    return {"us_per_call": out, "profile_mm_norm_500_calls": s.getvalue()}


# ---- steps ----------------------------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, layers: int, d: int, rms: bool = False):
        super().__init__()
        norm = (lambda: nn.RMSNorm(d)) if rms else (lambda: nn.LayerNorm(d))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d, bias=False), norm()) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _step_fn(f, x, kind: str):
    """One step of the compiled model: a forward under no_grad, or a forward and backward."""
    if kind == "inference":
        def step():
            with torch.no_grad():
                return f(x)
    else:
        def step():
            f(x).float().sum().backward()
    return step


def _compiled(backend: str, model: nn.Module, mode=None):
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, dynamic=False, mode=mode)


def part_steps(layers: int) -> list:
    rows = []
    d = 256
    for m in (512, 131072):
        for kind in ("inference", "training"):
            for graphs in (False, True):
                torch.manual_seed(0)
                model = Stack(layers, d).cuda().to(torch.bfloat16)
                x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=kind == "training")
                mode = "reduce-overhead" if graphs else None
                fns = {}
                for backend in ("inductor", "fusenorm"):
                    step = _step_fn(_compiled(backend, model, mode), x, kind)
                    torch.compiler.cudagraph_mark_step_begin()
                    step()
                    fns[backend] = (lambda s=step: (torch.compiler.cudagraph_mark_step_begin(), s())) if graphs else step
                # Two compiled versions of one model: each was compiled above; Dynamo's cache holds both.
                t = alternating(fns)
                rows.append({"M": m, "layers": layers, "d": d, "kind": kind, "cuda_graphs": graphs,
                             "t_inductor_ms": t["inductor"], "t_fusenorm_ms": t["fusenorm"],
                             "ratio": t["fusenorm"] / t["inductor"],
                             "fused": dict(torch._dynamo.utils.counters["fusenorm"])})
                torch._dynamo.utils.counters["fusenorm"].clear()
                print(rows[-1], flush=True)
    return rows


# ---- regressions ----------------------------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self, order: str, norm: str, d: int = 256):
        super().__init__()
        self.order = order
        self.lin = nn.Linear(d, d, bias=False)
        self.norm = nn.RMSNorm(d) if norm == "rms" else nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.lin(x)) if self.order == "linear_norm" else self.lin(self.norm(x))


def part_regress() -> list:
    rows = []
    m, d = 262144, 256
    cases = [("linear_norm", "rms", "inference"), ("linear_norm", "ln", "inference"),
             ("norm_linear", "rms", "inference"), ("norm_linear", "ln", "training")]
    for order, norm, kind in cases:
        torch.manual_seed(0)
        model = Pair(order, norm, d).cuda().to(torch.bfloat16)
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fns = {}
        for backend in ("inductor", "fusenorm", "inductor (A/A)"):
            torch._dynamo.reset()
            f = torch.compile(model, backend=backend.split()[0], dynamic=False)
            f(x).float().sum().backward()  # compiled and run for training first, as in issue 16
            step = _step_fn(f, x, kind)
            step()
            fns[backend] = step
        t = alternating(fns)
        rows.append({"case": f"{order} {norm} {kind}", "M": m, "d": d, "t_inductor_ms": t["inductor"],
                     "t_fusenorm_ms": t["fusenorm"], "ratio": t["fusenorm"] / t["inductor"],
                     "ratio_aa": t["inductor (A/A)"] / t["inductor"],
                     "fused": dict(torch._dynamo.utils.counters["fusenorm"])})
        torch._dynamo.utils.counters["fusenorm"].clear()
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="ops,steps,regress")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import triton

    data = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version(), "date": datetime.date.today().isoformat()}}
    parts = args.parts.split(",")
    if "ops" in parts:
        data["ops"] = part_ops()
        print(json.dumps(data["ops"]["us_per_call"], indent=1), flush=True)
    if "regress" in parts:
        data["regress"] = part_regress()
    if "steps" in parts:
        data["steps"] = part_steps(args.layers)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return data


if __name__ == "__main__":
    main()
