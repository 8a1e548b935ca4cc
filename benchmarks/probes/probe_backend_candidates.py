"""Every kernel backend's candidates for the GEMMs of a deferred norm, timed side by side (GPU).

Why: the dispatch (tuning/deferred_norm.py) keeps, per GEMM of a site, the fastest candidate of every backend that
takes it (backends/: our Gluon kernels, quack's where installed); this shows each candidate's time per role
beside cuBLAS's plain GEMM of the same shape, and any candidate refused or failed, with its reason.

Roles (M x K x N, bf16, b = W.t()): ``prod`` a GEMM writing RMSNorm statistics (tiles of 128), ``prod_bias`` the
same with a bias, ``cons_rms`` / ``cons_ln`` a GEMM applying RMSNorm / LayerNorm from partial statistics of its
input (the affine folded), ``link_rms`` both. Each candidate through its launch plan (the op's hot path), timed
with triton's do_bench (CUDA events, median), every candidate of a role in alternating rounds.

    python benchmarks/probes/probe_backend_candidates.py --shapes 1024x1024 --rows 262144 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

ROLES = ("prod", "prod_bias", "cons_rms", "cons_ln", "link_rms")


def role_args(role: str, m: int, k: int, n: int, dev="cuda", dtype=torch.bfloat16) -> tuple:
    from fusenorm_inductor.kernels import deferred as dk

    a = torch.randn(m, k, device=dev, dtype=dtype)
    b = (torch.randn(n, k, device=dev) / math.sqrt(k)).to(dtype).t()
    bias = torch.randn(n, device=dev, dtype=dtype) if role == "prod_bias" else None
    a_norm = {"cons_rms": dk.RMS, "cons_ln": dk.LN, "link_rms": dk.RMS}.get(role, dk.NONE)
    out_norm = dk.RMS if role in ("prod", "prod_bias", "link_rms") else dk.NONE
    stats = dk.partial_stats(a, a_norm, 128) if a_norm else None
    w = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype) if a_norm else None
    nb = (0.1 * torch.randn(k, device=dev)).to(dtype) if a_norm == dk.LN else None
    return (a, b, bias, None, stats, w, nb, 1e-5, a_norm, 128 if a_norm else 0, out_norm, 128 if out_norm else 0,
            True, None)


def main(argv=None) -> None:
    from triton.testing import do_bench

    from fusenorm_inductor import backends
    from fusenorm_inductor.backends import DeferredCase

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="512x512,1024x1024,2048x2048")
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--roles", default=",".join(ROLES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/probe_backend_candidates.json")
    args = p.parse_args(argv)
    alloc = lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for role in args.roles.split(","):
            torch.manual_seed(0)
            op_args = role_args(role, args.rows, k, n)
            case = DeferredCase.of(op_args)
            fns, row = {}, {"role": role, "M": args.rows, "K": k, "N": n, "refused": {}}
            a, b = op_args[0], op_args[1]
            fns["cublas mm"] = lambda a=a, b=b: torch.mm(a, b)
            for backend in backends.BACKENDS:
                why = backend.deferred_unsupported(case)
                if why is not None:
                    row["refused"][backend.name] = why
                    continue
                for cfg in backend.deferred_candidates(case):
                    made: list = []
                    try:
                        backend.deferred_launch(op_args, cfg, alloc, made)
                        torch.cuda.synchronize()
                        fns[cfg.label()] = lambda made=made, op_args=op_args: made[0](*op_args)
                    except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
                        row["refused"][cfg.label()] = f"{type(e).__name__}: {str(e)[:300]}"
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(do_bench(fn, warmup=10, rep=50, return_mode="median"))
            row["ms"] = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
            rows.append(row)
            base = row["ms"]["cublas mm"]
            best = sorted(row["ms"].items(), key=lambda kv: kv[1])
            print(f"{role:>9} {k}x{n}: cublas {base:.3f} ms | " +
                  " | ".join(f"{name} {t:.3f} ({t / base:.2f}x)" for name, t in best if name != "cublas mm")[:900])
            for name, why in row["refused"].items():
                print(f"          refused {name}: {why[:200]}")
            with open(args.out, "w") as f:
                json.dump({"meta": common.environment("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
