"""First timing of post-norm fusion on CUDA: fusenorm vs plain Inductor, forward and forward+backward.

For each (K, N) at M rows, bf16, it compiles (``dynamic=False``, Dynamo reset per point):
- ``linear -> norm``              forward (under no_grad) and forward+backward;
- ``linear -> norm -> linear``    forward+backward (the norm backward regrouped into the next linear's
                                  data-gradient GEMM);
with ``backend="inductor"`` and ``backend="fusenorm"``, and reports the median time (``--timer events``:
``triton.testing.do_bench``, which includes CPU launch overhead whenever the GPU waits for it;
``--timer cudagraph``: ``do_bench_cudagraph``, GPU time alone) and the peak memory of each, plus cuBLAS's
GEMM alone for scale.

    python benchmarks/bench_post_norm.py --out benchmarks/results/post_norm_first_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the shared harness: timers, peak memory, environment, JSON)

SHAPES = [(256, 256), (512, 512), (1024, 1024)]
CASES = ["fwd", "fwdbwd", "fwdbwd_next"]


class PostNorm(nn.Module):
    def __init__(self, k, n, rms, affine, next_linear):
        super().__init__()
        self.lin = nn.Linear(k, n, bias=False)
        self.norm = nn.RMSNorm(n, elementwise_affine=affine) if rms else nn.LayerNorm(n, elementwise_affine=affine)
        self.out = nn.Linear(n, n, bias=False) if next_linear else None

    def forward(self, x):
        y = self.norm(self.lin(x))
        return self.out(y) if self.out is not None else y


AA = False  # also time a second, independent Inductor compile (--aa)
TIMER = "events"  # or "cudagraph": replay a captured CUDA graph, which leaves out the CPU's launch overhead


def measure(fn):
    """(median ms, peak MiB above what was allocated before the timed calls) of ``fn``, after one untimed call."""
    fn()  # compile / warm up
    with common.PeakMemory() as pm:
        if TIMER == "cudagraph":
            ms = common.cudagraph_ms(fn, rep=300)
        else:
            ms = common.do_bench_ms(fn, rep=300, warmup=50)
    return ms, pm.mib


def bench_point(m, k, n, rms, affine, dtype):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    row = {"M": m, "K": k, "N": n, "norm": "rms" if rms else "layer", "affine": affine}
    row["mm_ms"], _ = measure(lambda: torch.mm(x, w.t()))
    for backend in ("inductor", "fusenorm") + (("inductor_aa",) if AA else ()):
        for case, next_linear, train in (("fwd", False, False), ("fwdbwd", False, True), ("fwdbwd_next", True, True)):
            if case not in CASES:
                continue
            torch._dynamo.reset()
            model = PostNorm(k, n, rms, affine, next_linear).to("cuda", dtype)
            compiled = torch.compile(model, backend=backend.removesuffix("_aa"), dynamic=False)
            xg = x.detach().requires_grad_(train)
            if train:
                g = torch.randn(m, n, device="cuda", dtype=dtype)

                def step():
                    compiled(xg).backward(g)
            else:

                def step():
                    with torch.no_grad():
                        compiled(xg)

            ms, peak = measure(step)
            row[f"{backend}_{case}_ms"], row[f"{backend}_{case}_peak_mib"] = round(ms, 4), round(peak, 1)
            if backend == "fusenorm":  # what the dispatch decided, and why
                import fusenorm_inductor

                rep = fusenorm_inductor.last_report()
                row[f"fusenorm_{case}_decision"] = [f"{r.pattern}: fused, {r.kernel}" for r in rep.rewrites
                                                    if not r.pattern.startswith("canonical")] + \
                    [f"{k.pattern}: {k.reason}" for k in rep.skips if k.pattern in ("linear_norm_fwd", "norm_prospects")]
    for case in CASES:
        row[f"speedup_{case}"] = round(row[f"inductor_{case}_ms"] / row[f"fusenorm_{case}_ms"], 3)
        if AA:  # Inductor against itself, compiled and timed the same way: the noise beside the speedup
            row[f"aa_{case}"] = round(row[f"inductor_{case}_ms"] / row[f"inductor_aa_{case}_ms"], 3)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,KxN,...")
    p.add_argument("--norms", default="layer,rms")
    p.add_argument("--affine", action="store_true")
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--timer", choices=["events", "cudagraph"], default="events",
                   help="events: do_bench (includes CPU launch overhead when the GPU waits for it); "
                        "cudagraph: do_bench_cudagraph (GPU time of the kernels alone)")
    p.add_argument("--cases", default="fwd,fwdbwd,fwdbwd_next")
    p.add_argument("--aa", action="store_true", help="also compile and time Inductor a second time (aa_<case>: "
                                                      "Inductor / Inductor, the spread beside each speedup)")
    args = p.parse_args()
    global TIMER, CASES, AA
    TIMER, CASES, AA = args.timer, args.cases.split(","), args.aa
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    import fusenorm_inductor  # noqa: F401

    rows = []
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for norm in args.norms.split(","):
            r = bench_point(args.rows, k, n, norm == "rms", args.affine, torch.bfloat16)
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = {
        **common.environment(commit=False, date="day"),  # gpu, torch, triton, python, date
        "dtype": "bfloat16",
        "timer": f"triton.testing.{'do_bench_cudagraph' if TIMER == 'cudagraph' else 'do_bench'} median, ms",
        "peak": "max_memory_allocated above the inputs during the timed calls, MiB",
    }
    cols = " | ".join(f"{c + ' ind':>14} {c + ' fn':>14} {'x':>5}" for c in CASES)
    print(f"\n{'K':>5} {'N':>5} {'norm':>5} | {'mm':>6} | " + cols)
    for r in rows:
        print(f"{r['K']:5d} {r['N']:5d} {r['norm']:>5} | {r['mm_ms']:6.3f} | " + " | ".join(
            f"{r[f'inductor_{c}_ms']:14.3f} {r[f'fusenorm_{c}_ms']:14.3f} {r[f'speedup_{c}']:5.2f}" for c in CASES))
    if args.out:
        common.write_json(args.out, {"meta": meta, "rows": rows}, quiet=True, rounded=False)


if __name__ == "__main__":
    main()
