"""Probe: every Gluon candidate of the deferred GEMM (``fusenorm::deferred_mm``) at one shape after another,
against cuBLAS's addmm and an eager LayerNorm pass over the output, in one process.

Why: on tritons with Gluon's multi-CTA API (3.9 here) the candidates include the CTA-pair tiles
(kernels/hopper/pair_core.py); this says what each tile costs in each role of a chain, which the dispatch's
per-site decision (and its match report) only shows for the shapes a model has:

- ``prod_ln``: a producer (bias, LayerNorm statistics of its output in tiles of 128 columns);
- ``link_ln`` / ``link_rms``: a tower's link (the previous norm applied from its partial statistics, the fold of
  the norm's affine cached per weight version, bias, the next norm's statistics written);
- ``cons_ln`` / ``cons_rms``: a consumer (the norm applied, no statistics written);
- ``prod_rms``: a producer of RMSNorm statistics (sums of squares: one pass where LayerNorm's takes two);
- ``plain``: the same kernel with neither (bias only): what the epilogues' work is measured from.

Each candidate runs as compiled graphs call the op: the launch plan made once (``kernels.deferred.launch``),
then timed through it (do_bench medians, the L2 flushed). M = 262144, bf16, B an nn.Linear weight.

    python benchmarks/probes/probe_deferred_candidates.py --shapes 1024x1024,2048x2048 --out /tmp/c.json

Results (an H100, torch 2.11, 2026-12-06): benchmarks/results/deferred_mm_candidates_triton39_h100.json
(triton 3.9.0 carried), deferred_mm_candidates_rs_h100.json and deferred_mm_candidates_roles_h100.json
(triton 3.6.0); findings in docs/history/performance-log.md, "Deferred normalization".
"""

from __future__ import annotations

import math
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

ROLES = ("prod_ln", "link_ln", "link_rms", "cons_ln", "cons_rms", "prod_rms", "plain")
M = 262144


def role_args(role: str, a, w, bias):
    """The op's arguments (ops/deferred_norm.py order) of a role of the module docstring."""
    from fusenorm_inductor.ops import deferred_norm as op

    a_norm, out_norm = {"prod_ln": (op.NONE, op.LN), "link_ln": (op.LN, op.LN), "link_rms": (op.RMS, op.RMS),
                        "cons_ln": (op.LN, op.NONE), "cons_rms": (op.RMS, op.NONE), "prod_rms": (op.NONE, op.RMS),
                        "plain": (op.NONE, op.NONE)}[role]
    k = a.shape[1]
    nw = (1 + 0.5 * torch.randn(k, device=a.device)).to(a.dtype) if a_norm else None
    nb = (0.5 * torch.randn(k, device=a.device)).to(a.dtype) if a_norm == op.LN else None
    a_stats = op.partial_stats(a, a_norm, 128) if a_norm else None
    return (a, w.t(), bias, None, a_stats, nw, nb, 1e-5, a_norm, 128 if a_norm else 0, out_norm,
            128 if out_norm else 0, True, None)


def operands(k: int, n: int):
    """(a [M, K], an nn.Linear weight w [N, K], its bias), bf16 on CUDA, the same for a shape every run."""
    torch.manual_seed(0)
    a = torch.randn(M, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    return a, w, torch.randn(n, device="cuda").to(torch.bfloat16)


def plan(call: tuple, cfg):
    """The function that launches candidate ``cfg`` on the op's arguments ``call`` through its launch plan, as
    compiled graphs call the op (made, and launched once, here)."""
    from fusenorm_inductor.kernels import deferred as kernels

    made: list = []
    kernels.launch(call, cfg, lambda s, d, dev: torch.empty(s, dtype=d, device=dev), made)
    return made[0]


def main() -> None:
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    p = common.doc_parser(__doc__)
    p.add_argument("--shapes", default="1024x1024,2048x2048,512x512,4096x4096", help="KxN,KxN,...")
    p.add_argument("--roles", default="prod_ln,link_ln,link_rms", help=f"comma list of {', '.join(ROLES)}")
    p.add_argument("--out", required=True, help="JSON to write")
    args = p.parse_args()
    roles = common.choices(p, "--roles", args.roles, ROLES)
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        a, w, bias = operands(k, n)
        t_mm = do_bench(lambda: torch.addmm(bias, a, w.t()), rep=200)
        y = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
        gamma = torch.ones(n, device="cuda", dtype=torch.bfloat16)
        t_ln = do_bench(lambda: torch.nn.functional.layer_norm(y, (n,), gamma, gamma), rep=200)
        for role in roles:
            call = role_args(role, a, w, bias)
            times, outputs = {}, {}
            for cfg in hopper.candidates(a, call[1], call[11]):
                try:
                    again = plan(call, cfg)
                    outputs[cfg.label()] = again(*call)
                    torch.cuda.synchronize()
                    times[cfg.label()] = do_bench(lambda: again(*call), rep=200)
                except Exception as e:  # noqa: BLE001 - a candidate that cannot run says why
                    times[cfg.label()] = f"{type(e).__name__}: {str(e)[:200]}"
            # every candidate writes the same c and statistics (up to the statistics' order of summation)
            ref = next(iter(outputs.values()), None)
            diff = {label: [((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
                            for o, r in zip(out, ref) if r.numel()] for label, out in outputs.items()}
            rows.append(dict(shape=shape, role=role, t_addmm_ms=t_mm, t_layer_norm_ms=t_ln, candidates=times,
                             max_rel_diff_c_stats=diff))
            print(rows[-1], flush=True)
    common.write_json(args.out, {"meta": {**common.environment(), "script": "benchmarks/probes/"
                                          "probe_deferred_candidates.py", "rows_m": M}, "rows": rows})


if __name__ == "__main__":
    main()
