"""Probe: the GDPA forward op alone, Gluon kernel (kernels/hopper/gdpa.py, issue 19) against the Triton kernel
it replaces on sm_90, on the FlashNormAttention benchmark's inputs (bench_flash_norm_attention.Case: B = 768,
S = 128, D = 128, Q lengths uniform in [1, Lmax], bf16, fast_gelu).

Per point: CUDA-graph medians of both kernels in alternating rounds (``--rounds``), TFLOP/s on the real
(unpadded) FLOPs and their share of the bf16 matmul rate measured in the same run (cuBLAS 8192^3), bytes
moved over the copy bandwidth (the memory floor: q read and O written once, K and V read once), and max
|gluon - triton|. ``--configs`` times several Gluon configurations (the row's t_gluon_ms is the best).

    python benchmarks/probes/probe_gdpa_gluon.py --out /tmp/gdpa.json
    python benchmarks/probes/probe_gdpa_gluon.py --dir bwd --out /tmp/gdpa_bwd.json    # the Gluon backward (dQ, dK/dV)

Results of the H200 runs: benchmarks/results/gdpa_gluon_h200.json (fwd) and gdpa_gluon_bwd_h200.json (bwd).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_flash_norm_attention as fna  # noqa: E402  (the inputs: Case)
import bench_gemm_norm as gn  # noqa: E402  (ceilings, max_abs_diff)
import common  # noqa: E402


def main() -> None:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--H", default="1,2,4,8")
    p.add_argument("--lmax", default="512,1024,3000")
    p.add_argument("--batch", type=int, default=768)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--configs", default="auto",
                   help="Gluon configs, comma-separated: auto (the dispatch's choice per point) or "
                        "BMxCHUNKqSTAGES[p] (p: persistent)")
    p.add_argument("--dir", choices=["fwd", "bwd"], default="fwd",
                   help="bwd: the Gluon backward (dQ and dK/dV) against the Triton backward (--configs unused)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from fusenorm_inductor.kernels.hopper import gdpa as hopper
    from fusenorm_inductor.kernels.triton import gdpa as gk
    from fusenorm_inductor.activations import activation_code

    def parse(spec: str, lmax: int):
        if spec == "auto":
            return hopper.choose_config(lmax)
        bm, rest = spec.split("x")
        ch, nq = rest.split("q")
        return hopper.GdpaGluonConfig(int(bm), int(ch), int(nq.rstrip("p")), nq.endswith("p"))

    bench = common.Bench("cudagraph", args.rep_ms, "cuda")
    ceilings = gn.measure_ceilings(bench, "cuda", False)
    rows = []
    for h in (int(x) for x in args.H.split(",")):
        for lmax in (int(x) for x in args.lmax.split(",")):
            configs = [parse(spec, lmax) for spec in args.configs.split(",")]
            case = fna.Case(args.batch, 128, h, args.dim, lmax, 0.5, "cuda")
            q, k, v, offs = case.q, case.k, case.v, case.offsets
            o = torch.empty_like(q)
            act = activation_code("fast_gelu")
            if args.dir == "fwd":
                cfg = gk.fwd_config(lmax, 128, args.dim, q.dtype)
                fns = {"triton": lambda: gk.gdpa_fwd_triton(q, k, v, offs, lmax, "fast_gelu", 1.0, cfg)}
                for c in configs:
                    fns[c.label()] = lambda c=c: hopper.gdpa_fwd_gluon(q, k, v, offs, o, lmax, act, 1.0, c)
                ref = fns["triton"]()
                diff = 0.0
                for c in configs:
                    o.fill_(float("nan"))
                    fns[c.label()]()
                    diff = max(diff, gn.max_abs_diff(o, ref))
                nbytes = 2 * q.numel() * 2 + 2 * k.numel() * 2  # q read, O written, K and V read once
            else:
                dout = torch.randn_like(q)
                cfgs = (gk.dq_config(lmax, 128, args.dim, q.dtype),
                        gk.dkdv_config(lmax, 128, args.dim, q.dtype, args.batch * h, q.device))
                grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
                configs = [hopper.DQ_CONFIG]
                fns = {"triton": lambda: gk.gdpa_bwd_triton(dout, q, k, v, offs, lmax, "fast_gelu", 1.0, *cfgs),
                       configs[0].label(): lambda: hopper.gdpa_bwd_gluon(dout, q, k, v, offs, *grads, lmax, act, 1.0)}
                ref = fns["triton"]()
                for g in grads:
                    g.fill_(float("nan"))
                fns[configs[0].label()]()
                diff = max(gn.max_abs_diff(g, r) for g, r in zip(grads, ref))
                nbytes = 3 * q.numel() * 2 + 4 * k.numel() * 2  # q, dO read, dQ written; K, V read, dK, dV written
            times = common.alternating(fns, bench.ms, args.rounds)
            t = common.medians(times)
            best = min((c.label() for c in configs), key=lambda name: t[name])
            t["gluon"] = t[best]
            flops = case.gdpa_flops(args.dir)
            row = dict(H=h, Lmax=lmax, dir=args.dir, tokens=case.total, t_gluon_ms=t["gluon"], t_triton_ms=t["triton"],
                       gluon_config=best, configs_ms={c.label(): t[c.label()] for c in configs},
                       rounds_ms=times,
                       speedup=t["triton"] / t["gluon"], gdpa_tflops=flops / t["gluon"] / 1e9,
                       gdpa_peak_frac=flops / t["gluon"] / 1e9 / ceilings["matmul_tflops"],
                       triton_peak_frac=flops / t["triton"] / 1e9 / ceilings["matmul_tflops"],
                       memory_floor_ms=nbytes / ceilings["copy_gbps"] / 1e6, max_abs_diff=diff)
            rows.append(row)
            print(f"H={h} Lmax={lmax}: " + " ".join(f"{c.label()} {t[c.label()]:.3f}" for c in configs) +
                  f" | best {t['gluon']:.3f} ms ({row['gdpa_peak_frac']:.0%} of matmul) "
                  f"triton {t['triton']:.3f} ms ({row['triton_peak_frac']:.0%}) x{row['speedup']:.2f} "
                  f"floor {row['memory_floor_ms']:.3f} ms diff {diff:.3g}", flush=True)
            del case, q, k, v, o
    meta = dict(**common.environment(python=False, commit=False), ceilings=ceilings,  # gpu, torch, triton, date
                configs=args.configs, dir=args.dir, shape=dict(B=args.batch, S=128, D=args.dim, activation="fast_gelu",
                                                           lengths="uniform in [1, Lmax]", dtype="bfloat16"),
                timer="cudagraph median of --rounds alternating rounds, ms")
    common.write_json(args.out, {"meta": meta, "rows": rows}, quiet=True, rounded=False)
    fwd = [r["gdpa_peak_frac"] for r in rows]
    print(f"median share of matmul: gluon {statistics.median(fwd):.0%}, "
          f"triton {statistics.median(r['triton_peak_frac'] for r in rows):.0%}")


if __name__ == "__main__":
    main()
