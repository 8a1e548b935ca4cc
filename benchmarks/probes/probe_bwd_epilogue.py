"""Probe: where the Gluon regrouped backward's epilogue spends its time (issue 17), under Nsight Compute.

Runs ``fusenorm::mm_norm_backward``'s Gluon kernel with one named configuration (``--config``, a label of
``kernels/hopper/mm_norm_backward.candidates``) on the benchmark's inputs (bench_gemm_norm.py: M = 262144,
bf16, the saved hh as src, an affine norm), and the same configuration's GEMM core with the plain epilogue
("base"), ``--iters`` times each, for a profiler to pick the launches:

    ncu --clock-control none -k regex:mm_norm --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
        python3 benchmarks/probes/probe_bwd_epilogue.py --K 4096 --N 256 --norm rms \\
        --config "gl_coop 128x256x64 s3 w8"

``--time`` prints the two kernels' times (do_bench medians, rep 50 ms) instead. Results of the H200 run:
benchmarks/results/probe_bwd_epilogue_h200.txt.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_gemm_norm as bench  # noqa: E402  (the post-norm benchmark's point, inputs and op arguments)
import common  # noqa: E402


def main() -> None:
    args = common.kernel_probe_args(__doc__)

    from fusenorm_inductor.kernels.hopper import mm_norm_backward as hopper
    from fusenorm_inductor.kernels.triton import mm_norm_backward as bk

    torch.manual_seed(0)
    point = bench.Point("bwd", args.K, args.N, args.norm, True)
    case = bench.Case(point, args.rows, "cuda")
    _, op_args = bench.fused_op_args(point, case)
    cfg = next((c for c in hopper.candidates(op_args[0], op_args[1]) if c.label() == args.config), None)
    if cfg is None:
        raise SystemExit(f"{args.config!r} is not a candidate: {[c.label() for c in hopper.candidates(*op_args[:2])]}")
    fused = lambda: bk.mm_norm_backward_triton(*op_args, config=cfg)  # noqa: E731
    base = bench.plain_core(op_args[0], op_args[1], cfg)
    for fn in (fused, base):
        for _ in range(args.iters):
            fn()
    torch.cuda.synchronize()
    if args.time:
        print(f"{args.config} K={args.K} N={args.N} {args.norm}: fused {common.do_bench_ms(fused, rep=50):.4f} ms, "
              f"base {common.do_bench_ms(base, rep=50):.4f} ms")


if __name__ == "__main__":
    main()
