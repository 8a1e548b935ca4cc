"""Probe: two questions about the quack backend, answered on the GPU in one run.

1. LayerNorm applied by quack in a compiled block (LayerNorm of a residual sum read by two linears) came out
   20% off an fp32 reference at |mean| / std = 100. Is it quack, the statistics, or the rounding of the sum
   to bf16 before the GEMMs read it (which eager bf16 does too, and Inductor's fused kernel does not)? Errors
   of eager, Inductor, fusenorm on Gluon and fusenorm on quack, at mean 0 and at a large mean.
2. Where the host time of a fused call goes: a small chain (host-bound), per-call wall time of Inductor,
   fusenorm on Gluon and on quack, and cProfile's top functions for each fused call.

    python benchmarks/probes/probe_quack_diag.py --out $OUT/quack_diag.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import common  # noqa: E402
from bench_deferred_norm import Chain, launched_backends  # noqa: E402

import fusenorm_inductor as fi  # noqa: E402
from fusenorm_inductor import config  # noqa: E402
from tests.models import LayerNormOfSum  # noqa: E402

BF16 = torch.bfloat16
VARIANTS = {
    "gluon": {"gluon": True, "quack": False, "tuning.measure": False},
    "quack": {"gluon": False, "quack": True, "tuning.measure": False},
}


def _err(o, ref):
    return float((o.float() - ref).norm() / ref.norm())


def layernorm_errors(d: int = 256) -> list[dict]:
    rows = []
    for mean, std in ((0.0, 1.0), (400.0, 4.0), (4000.0, 4.0)):
        torch.manual_seed(3)
        m = LayerNormOfSum(d).cuda().to(BF16)
        x = torch.randn(3, 87, d, device="cuda", dtype=BF16) * std + mean
        h = torch.randn(3, 87, d, device="cuda", dtype=BF16)
        with torch.no_grad():
            ref = copy.deepcopy(m).float()(x.float(), h.float())
            # eager with the sum rounded to bf16 first, what every graph that stores the sum computes
            row = {"mean": mean, "std": std, "eager": _err(m(x, h), ref)}
            s = (x + h).float()  # rounded sum, then an fp32 model: the rounding alone
            fm = copy.deepcopy(m).float()
            row["sum_rounded_fp32"] = _err(fm.a(fm.norm(s)) * fm.b(fm.norm(s)), ref)
            torch._dynamo.reset()
            row["inductor"] = _err(torch.compile(m)(x, h), ref)
            for name, patch in VARIANTS.items():
                torch._dynamo.reset()
                with config.patch({**patch, "patterns.norm_linear_fwd": False, "patterns.linear_norm_fwd": False}):
                    cm = torch.compile(m, backend="fusenorm")
                    out = cm(x, h)
                    rep = fi.last_report()
                    row[name] = _err(out, ref)
                    row[name + "_launched"] = launched_backends(lambda: cm(x, h))
                    row[name + "_rewrites"] = [r.pattern for r in rep.rewrites]
        print(row, flush=True)
        rows.append(row)
    return rows


def _top(fn, calls: int = 200, top: int = 25) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def host_costs(rows_m: int = 512) -> list[dict]:
    out = []
    for norm in ("rms", "ln"):
        torch.manual_seed(0)
        model = Chain("chain", 1024, 1024, norm, False, False, "cuda", BF16)
        x = torch.randn(rows_m, 1024, device="cuda", dtype=BF16)
        row = {"norm": norm, "M": rows_m}
        with torch.no_grad():
            torch._dynamo.reset()
            ind = torch.compile(common.own_code(model))
            ind(x)
            row["inductor_us"] = common.host_us(lambda: ind(x))
            for name, patch in VARIANTS.items():
                torch._dynamo.reset()
                with config.patch(patch):
                    cm = torch.compile(model, backend="fusenorm")
                    for _ in range(3):
                        cm(x)
                    row[name + "_launched"] = launched_backends(lambda: cm(x))
                    cm(x)
                    row[name + "_us"] = common.host_us(lambda: cm(x))
                    row[name + "_profile"] = _top(lambda: cm(x))
        print({k: v for k, v in row.items() if not k.endswith("_profile")}, flush=True)
        for k, v in row.items():
            if k.endswith("_profile"):
                print(f"--- {norm} {k}\n{v}", flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--skip", default="", help="comma list of errors, host")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    data = {"meta": common.environment("cuda")}
    if "errors" not in skip:
        data["layernorm_errors"] = layernorm_errors()
    if "host" not in skip:
        data["host"] = host_costs()
    common.write_json(args.out, data)


if __name__ == "__main__":
    main()
