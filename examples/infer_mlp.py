"""Serve an ads-style MLP tower (Linear -> norm blocks) in batches under ``torch.inference_mode()`` with
backend="fusenorm" and with plain Inductor; print fusenorm's match report, both latencies per batch and how
far the outputs are apart.

    python examples/infer_mlp.py                              # CPU: small sizes, seconds after compiling
    python examples/infer_mlp.py --rows 262144 --width 1024   # CUDA (bf16 by default): a serving batch

Serving is where a norm between GEMMs costs most relative to the step (no backward to share it with): each
norm of the tower sits between two linears, so fusenorm can defer it (the linear before it writes per-row
partial statistics, the linear after it applies the norm in its epilogue) or, where a row fits one tile, fuse
it whole into the linear before it. The dispatch measures each site on CUDA and keeps what wins; the report
says what it chose and why. Latencies are medians of CUDA events around plain calls (no CUDA graphs: the
host's work counts, as in a serving loop without them) on CUDA, of wall-clock time on the CPU.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from train_mlp import MLP  # noqa: E402


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = _common.make_parser(__doc__)
    p.add_argument("--rows", type=int, default=262144 if cuda else 512, help="rows per served batch (M)")
    p.add_argument("--width", type=int, default=1024 if cuda else 64, help="every layer's width (d)")
    p.add_argument("--depth", type=int, default=4 if cuda else 3, help="Linear -> norm blocks")
    p.add_argument("--norm", default="layer", choices=["layer", "rms"], help="LayerNorm (default) or RMSNorm")
    p.add_argument("--batches", type=int, default=50 if cuda else 5, help="batches served per backend (after one "
                                                                           "warm-up batch, which compiles)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present)")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default), float16 or float32 (CPU default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default="full", choices=["full", "summary", "none"], help="how much of the match "
                                                                                         "report to print")
    return p.parse_args(argv)


def serve(model, batches, device: str) -> tuple[list, list[float]]:
    """Each batch's output and latency (ms): CUDA events around the call on CUDA, wall clock on the CPU."""
    outs, times = [], []
    with torch.inference_mode():
        for x in batches:
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                y = model(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                y = model(x)
                times.append((time.perf_counter() - t0) * 1e3)
            outs.append(y)
    return outs, times


def run(base, backend: str, warm, batches, device: str) -> dict:
    import copy

    import fusenorm_inductor

    seen = {id(r) for r in fusenorm_inductor.reports()}
    with _common.no_graph_caches():
        model = _common.compile_model(copy.deepcopy(base), backend)
        t0 = time.perf_counter()
        serve(model, [warm], device)  # compiles (and, on CUDA, measures each fusenorm site once)
        first_s = time.perf_counter() - t0
        outs, times = serve(model, batches, device)
    out = {"backend": backend, "outs": outs, "median_ms": statistics.median(times), "first_batch_s": first_s}
    if backend == "fusenorm":
        out["reports"] = [r for r in fusenorm_inductor.reports() if id(r) not in seen]
        out["report"] = fusenorm_inductor.report.summarize(out["reports"])
    torch._dynamo.reset()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = _common.pick_device(args.dtype, args.device)
    _common.warm_up_compiler(device)
    torch.manual_seed(args.seed)
    base = MLP(args.width, args.width, args.depth, "none", args.norm).to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    batches = [torch.randn(args.rows, args.width, generator=gen).to(device, dtype) for _ in range(args.batches + 1)]
    runs = {b: run(base, b, batches[0], batches[1:], device) for b in ("fusenorm", "inductor")}
    fused, plain = runs["fusenorm"], runs["inductor"]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused["outs"], plain["outs"]))
    scale = max(b.float().abs().max().item() for b in plain["outs"])
    _common.print_report(fused, args.report)
    norm = {"layer": "LayerNorm", "rms": "RMSNorm"}[args.norm]
    print(f"\n{args.depth} x (Linear -> {norm}) -> head, {args.rows} rows x width {args.width}, {dtype}, {device}, "
          f"inference_mode, {args.batches} batches")
    print(f"  median latency per batch: fusenorm {fused['median_ms']:.3f} ms, Inductor {plain['median_ms']:.3f} ms "
          f"({plain['median_ms'] / fused['median_ms']:.3f}x)")
    print(f"  first batch (compile): fusenorm {fused['first_batch_s']:.1f} s, Inductor {plain['first_batch_s']:.1f} s")
    print(f"  outputs: max |fusenorm - Inductor| = {diff:.3g} (largest |output| {scale:.3g})")
    return {"median_ms": {k: r["median_ms"] for k, r in runs.items()}, "max_abs_diff": diff, "scale": scale,
            "report": fused["report"], "first_batch_s": {k: r["first_batch_s"] for k, r in runs.items()}}


if __name__ == "__main__":
    main()
