"""Quick probe of the Gluon post-norm forward on the H200: every candidate configuration of a few shapes.

Per shape (M = 262144 by default, bf16, forward): cuBLAS ``a @ W.T``; Inductor's norm alone and Inductor's
``norm(linear(a))`` (dynamic=False); for each Gluon candidate its GEMM base (plain epilogue) and the fused
op (y only; --save-normed: y and hh). Timed in interleaved rounds (``--rounds``), CUDA-graph medians
(common.cudagraph_ms with rep = ``--rep-ms``); one JSON object per line to stdout and ``--out`` (appended). This is
the fast loop for choosing candidates; the targets are measured by bench_gemm_norm.py.

    python benchmarks/probes/probe_gluon_mm_norm.py --shapes 256x128,1024x512 --norms rms,layer --affine on

Results of the H200 run: benchmarks/results/probe_gluon_mm_norm_h200.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import common  # noqa: E402


def main():
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--shapes", default="256x128,512x256,1024x512,1024x1024,1024x2048,2048x4096",
                   help="KxN comma list")
    p.add_argument("--norms", default="rms,layer")
    p.add_argument("--affine", default="on")
    p.add_argument("--save-normed", action="store_true", help="affine: also write hh (a training forward)")
    p.add_argument("--configs", default="",
                   help="extra configs to time beside the candidates, comma list of kind:BMxBNxBK:stages:warps")
    p.add_argument("--allow-spills", action="store_true", help="time specializations that spill registers too")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from fusenorm_inductor.kernels.hopper import common as hopper_common
    from fusenorm_inductor.kernels.hopper import mm_norm as hopper
    from fusenorm_inductor.kernels.triton import mm_norm as fk

    hopper_common.ALLOW_SPILLS = args.allow_spills
    out = open(args.out, "a") if args.out else None
    m = args.rows
    dev = "cuda"
    print(json.dumps(common.environment(python=False, commit=False, date="day")), flush=True)
    for shape in args.shapes.split(","):
        k, n = (int(x) for x in shape.split("x"))
        torch.manual_seed(0)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        W = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        for norm in args.norms.split(","):
            for aff in args.affine.split(","):
                affine = aff == "on"
                is_rms = norm == "rms"
                eps = 1e-6 if is_rms else 1e-5
                w = (1 + 0.1 * torch.randn(n, device=dev)).to(torch.bfloat16) if affine else None
                nb = (0.1 * torch.randn(n, device=dev)).to(torch.bfloat16) if affine and not is_rms else None
                if is_rms:
                    normf = lambda h: F.rms_norm(h, (n,), w, eps)  # noqa: E731
                else:
                    normf = lambda h: F.layer_norm(h, (n,), w, nb, eps)  # noqa: E731
                torch._dynamo.reset()
                c_norm = torch.compile(normf, dynamic=False)
                c_unf = torch.compile(lambda a, W: normf(F.linear(a, W)), dynamic=False)
                h = F.linear(a, W)
                with torch.no_grad():
                    ref = c_unf(a, W)
                    c_norm(h)
                fns = {"cublas": lambda: torch.mm(a, W.t()), "norm": lambda: c_norm(h), "unfused": lambda: c_unf(a, W)}
                save = affine and args.save_normed
                args_op = (a, W.t(), None, None, w, nb, eps, is_rms, None, save)
                cands = hopper.candidates(a, W.t(), save)
                cands += [c for c in _extra(args.configs, n) if c not in cands]
                errs = {}
                for cfg in cands:
                    lab = cfg.label()
                    try:
                        y = fk.mm_norm_triton(*args_op, config=cfg)[0]
                        torch.cuda.synchronize()
                        errs[lab] = float((y.float() - ref.float()).abs().max())
                        fns[f"fused|{lab}"] = (lambda c=cfg: fk.mm_norm_triton(*args_op, config=c))
                        fns[f"base|{lab}"] = (lambda c=cfg: fk.mm_norm_triton(*args_op, config=c, gemm_only=True))
                    except Exception as e:  # noqa: BLE001
                        errs[lab] = f"{type(e).__name__}: {str(e)[:300]}"
                with torch.no_grad():
                    times = common.alternating(fns, lambda fn: common.cudagraph_ms(fn, rep=args.rep_ms), args.rounds)
                med = common.medians(times)
                t_mm, t_norm, t_unf = med["cublas"], med["norm"], med["unfused"]
                rows = []
                for cfg in cands:
                    lab = cfg.label()
                    if f"fused|{lab}" not in med:
                        rows.append({"config": lab, "error": errs[lab]})
                        continue
                    tf, tb = med[f"fused|{lab}"], med[f"base|{lab}"]
                    rows.append({"config": lab, "t_fused_ms": tf, "t_base_ms": tb, "base_over_mm": tb / t_mm,
                                 "fused_over_mm": tf / t_mm, "hidden": (t_unf - tf) / t_norm,
                                 "max_abs_diff": errs[lab]})
                rec = {"M": m, "K": k, "N": n, "norm": norm, "affine": affine, "t_mm_ms": t_mm, "t_norm_ms": t_norm,
                       "t_unfused_ms": t_unf, "candidates": rows}
                line = json.dumps(rec)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                    out.flush()
                del fns, h, ref
                torch.cuda.empty_cache()


def _extra(spec: str, n: int) -> list:
    """--configs entries that apply to rows of n columns (a cluster config only where cluster_size allows)."""
    from fusenorm_inductor.kernels.hopper import mm_norm as hopper
    from fusenorm_inductor.kernels.triton.common import GemmConfig

    out = []
    for item in filter(None, spec.split(",")):
        kind, tile, st, w = item.split(":")
        bm, bn, bk = (int(x) for x in tile.split("x"))
        cfg = GemmConfig(kind, bm, bn, bk, int(st), int(w))
        c = hopper.cluster_size(n, bn)
        if (kind == "gl_cluster") == (c is not None and c > 1) and (c is not None):
            out.append(cfg)
    return out


if __name__ == "__main__":
    main()
