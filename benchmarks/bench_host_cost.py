"""Host cost and the regressions of issue 16 on CUDA: what a fused call costs the CPU, and whole steps with and
without CUDA graphs, fusenorm against plain Inductor.

Parts (``--parts``, default all):
    ops      host time per call (wall time of a loop of calls on tiny inputs, GPU idle: the CPU is the bound):
             torch.mm (cuBLAS), one Triton kernel launch, the unfused pair, a custom op wrapping one Triton
             launch, and each fused op (fusenorm::mm_norm, norm_mm, mm_norm_backward) as the compiled graph
             calls it; plus a cProfile of the fused forward's and backward's graph calls (top functions, in the JSON).
    steps    a stack of ``--layers`` (8) x (Linear -> LayerNorm) blocks, d = 256, compiled ``dynamic=False``
             by Inductor, by fusenorm, and by fusenorm with every match fused (the decision not asked: a
             step of many small fused calls): time per step (forward under no_grad, and forward + backward) at
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
import io
import json
import os
import pstats
import sys

import torch
import torch.nn as nn

import fusenorm_inductor  # noqa: F401  (registers the ops and the backend)
from fusenorm_inductor import config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the shared harness: host and step timers, alternating rounds, environment, JSON)


def wall_us_per_call(fns: dict, calls: int = 1000, rounds: int = 9) -> dict:
    """Per function, the median over rounds of the wall time per call of a loop of ``calls`` calls
    (``common.host_us``: synchronized at the ends) after one untimed call each; the functions take turns within
    each round, so a drift of the host's speed (it moved the same call by up to 1.6x between runs) touches them
    all alike."""
    return common.medians(common.alternating(fns, lambda fn: common.host_us(fn, calls), rounds, warmup=1))


def alternating(fns: dict, rounds: int = 7, steps: int = 30) -> dict:
    """Median step time of each function (``common.events_ms`` over ``steps`` back-to-back steps: CUDA events, no
    sync inside, so the host cost counts when the GPU waits for it), timed in alternating rounds after 3 untimed
    steps each."""
    return common.medians(common.alternating(fns, lambda f: common.events_ms(f, steps), rounds, warmup=3))


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
    # What a compiled graph calls since graph_calls: the launcher, without the dispatcher and autograd layer.
    from torch._inductor.select_algorithm import extern_kernels

    from fusenorm_inductor import graph_calls
    from fusenorm_inductor.tuning import measure
    from fusenorm_inductor.kernels.triton.mm_norm import _outputs

    graph_calls.install()
    g_mm_norm = getattr(extern_kernels, graph_calls.call_name("mm_norm"))
    g_bwd = getattr(extern_kernels, graph_calls.call_name("mm_norm_backward"))
    g_norm_mm = getattr(extern_kernels, graph_calls.call_name("norm_mm"))
    fns.update({
        "graph call: norm_mm (RMSNorm, affine)": lambda: g_norm_mm(a, b, None, lw, None, 1e-6, True, dt),
        "graph call: norm_mm (LayerNorm, affine, bias)": lambda: g_norm_mm(a, b, lw, lw, lw, 1e-5, False, dt),
        "graph call: mm_norm (RMSNorm, affine, no_grad)": lambda: g_mm_norm(a, b, None, None, lw, None, 1e-6, True, dt,
                                                                           False),
        "graph call: mm_norm (LayerNorm, affine, save hh)": lambda: g_mm_norm(a, b, None, None, lw, lw, 1e-5, False,
                                                                             dt, True),
        "graph call: mm_norm_backward (RMSNorm)": lambda: g_bwd(h, w, None, h, lw, None, rstd, True, True, False, dt),
        # parts of the graph call (RMSNorm, no_grad)
        "part: plan key": lambda: measure.plan_key((a, b, None, None, lw, None), 1e-6, True, dt, False, True, None),
        "part: the four outputs (torch.empty)": lambda: _outputs(m, n, dt, dt, True, False, a.device),
        "part: one torch.empty": lambda: torch.empty((m, n), dtype=dt, device=a.device),
    })
    out = wall_us_per_call(fns)
    profiles = {}
    for key, name in (("profile_mm_norm_500_calls", "graph call: mm_norm (RMSNorm, affine, no_grad)"),
                      ("profile_mm_norm_backward_500_calls", "graph call: mm_norm_backward (RMSNorm)"),
                      ("profile_norm_mm_500_calls", "graph call: norm_mm (LayerNorm, affine, bias)")):
        prof = cProfile.Profile()
        fn = fns[name]
        prof.enable()
        for _ in range(500):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        profiles[key] = s.getvalue()
    return {"us_per_call": out, **profiles}


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


ALL_FUSED = "fusenorm, every match fused"


def _every_match_fused(gm, example_inputs, **kwargs):
    """fusenorm's backend under another name: Dynamo keeps one compiled version per backend, so this one sits
    beside the default-config "fusenorm" version of the same model."""
    return fusenorm_inductor.fusenorm_backend(gm, example_inputs, **kwargs)


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
                fns, fused = {}, {}
                # Dynamo keeps the compiled versions side by side (one per backend). Training under CUDA graphs:
                # two versions' graph trees overwrote each other's outputs, so each is compiled alone (a reset
                # before it) and the every-match-fused version, which must compile under its config, is left out.
                alone = graphs and kind == "training"
                names = ("inductor", "fusenorm") if alone else ("inductor", "fusenorm", ALL_FUSED)
                torch._dynamo.reset()
                for name in names:
                    if alone:
                        torch._dynamo.reset()
                    torch._dynamo.utils.counters["fusenorm"].clear()
                    # "every match fused": the decision is not asked (tuning.measure off), so the step is one
                    # of many small fused calls, the host cost of each counting wherever the GPU waits for it.
                    with config.patch({"tuning.measure": name != ALL_FUSED}):
                        backend = _every_match_fused if name == ALL_FUSED else name
                        compiled = torch.compile(model, backend=backend, dynamic=False, mode=mode)
                        step = _step_fn(compiled, x, kind)
                        torch.compiler.cudagraph_mark_step_begin()
                        step()
                    fns[name] = (lambda s=step: (torch.compiler.cudagraph_mark_step_begin(), s())) if graphs else step
                    fused[name] = dict(torch._dynamo.utils.counters["fusenorm"])
                # Three compiled versions of one model: each was compiled above; Dynamo's cache holds them all.
                t = alternating(fns)
                rows.append({"M": m, "layers": layers, "d": d, "kind": kind, "cuda_graphs": graphs,
                             "t_inductor_ms": t["inductor"], "t_fusenorm_ms": t["fusenorm"],
                             "ratio": t["fusenorm"] / t["inductor"],
                             "t_all_fused_ms": t.get(ALL_FUSED),
                             "ratio_all_fused": t[ALL_FUSED] / t["inductor"] if ALL_FUSED in t else None,
                             "fused": fused["fusenorm"], "fused_all": fused.get(ALL_FUSED)})
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
    data = {"meta": common.environment(commit=False, date="day")}  # gpu, torch, triton, python, date
    parts = args.parts.split(",")
    if "ops" in parts:
        data["ops"] = part_ops()
        print(json.dumps(data["ops"]["us_per_call"], indent=1), flush=True)
    if "regress" in parts:
        data["regress"] = part_regress()
    if "steps" in parts:
        data["steps"] = part_steps(args.layers)
    if args.out:
        common.write_json(args.out, data, quiet=True, rounded=False)
    return data


if __name__ == "__main__":
    main()
