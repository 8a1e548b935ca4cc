"""Probe: one launch of one deferred-GEMM candidate per role, under a profiler, for ncu or nsys.

Why: ``probe_deferred_candidates.py`` says how long each candidate takes; this says where a kernel's time
goes. Each role's launch plan is made and warmed up first, then only the timed launches run between
``cudaProfilerStart`` and ``cudaProfilerStop``, so a profiler started with ``--profile-from-start off`` sees
exactly one launch per role, in the order given (roles as in ``probe_deferred_candidates.py``).

    ncu --profile-from-start off -k regex:deferred --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/probes/profile_deferred_once.py --roles plain,prod_ln,link_ln --kind gl_pp

Figures (an H100, triton 3.6, 2026-12-06, from an uncommitted script that launched the same): in the meta of
benchmarks/results/deferred_mm_candidates_roles_h100.json; findings in docs/history/performance-log.md, "Output
statistics summed in registers".
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from probe_deferred_candidates import ROLES, operands, plan, role_args  # noqa: E402


def main() -> None:
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    p = common.doc_parser(__doc__)
    p.add_argument("--shape", default="1024x1024", help="KxN")
    p.add_argument("--roles", default="plain,prod_ln,link_ln", help=f"comma list of {', '.join(ROLES)}")
    p.add_argument("--kind", default="gl_pp", help="the candidate's kind (its first config of that kind)")
    p.add_argument("--stats-regs", action="store_true", help="the candidate whose statistics are summed in "
                                                              "registers (``rs``)")
    args = p.parse_args()
    roles = common.choices(p, "--roles", args.roles, ROLES)
    k, n = (int(v) for v in args.shape.split("x"))
    a, w, bias = operands(k, n)
    runs = []
    for role in roles:
        call = role_args(role, a, w, bias)
        stats_regs = args.stats_regs and call[10] != 0
        cfgs = [c for c in hopper.candidates(a, call[1], call[11])
                if c.kind == args.kind and c.stats_regs == stats_regs]
        if not cfgs:
            p.error(f"{role}: no candidate of kind {args.kind!r} (stats_regs={stats_regs}) at {args.shape}")
        again = plan(call, cfgs[0])
        for _ in range(3):
            again(*call)
        runs.append((role, cfgs[0], again, call))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, _, again, call in runs:
        again(*call)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for role, cfg, _, _ in runs:
        print(f"{role}: {cfg.label()}")


if __name__ == "__main__":
    main()
