"""Probe: where the Gluon pre-norm forward (kernels/hopper/norm_mm.py, issue 18) spends its time, under Nsight
Compute.

Runs ``fusenorm::norm_mm``'s Gluon kernel with one named configuration (``--config``, a label of
``kernels/hopper/norm_mm.candidates``) on the benchmark's inputs (bench_prenorm.py: M = 262144, bf16, an
affine norm, no linear bias), ``--iters`` times, for a profiler to pick the launches:

    ncu --clock-control none -k regex:norm_mm_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/probes/probe_norm_mm_gluon.py --K 256 --N 2048 --norm layer \\
        --config "gl_coop 128x256x64 s3 w8"

``--time`` prints its time and cuBLAS's for the same GEMM (do_bench medians) instead. Results of the H200 run:
benchmarks/results/probe_norm_mm_gluon_h200.txt.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import common  # noqa: E402


def main() -> None:
    args = common.kernel_probe_args(__doc__)

    from fusenorm_inductor.kernels.hopper import norm_mm as hopper
    from fusenorm_inductor.kernels.triton import norm_mm as nk

    torch.manual_seed(0)
    dt, dev, k, n = torch.bfloat16, "cuda", args.K, args.N
    is_rms = args.norm == "rms"
    a = torch.randn(args.rows, k, device=dev, dtype=dt)
    w = (torch.randn(n, k, device=dev) * k ** -0.5).to(dt)
    weight = (1 + 0.1 * torch.randn(k, device=dev)).to(dt)
    norm_bias = None if is_rms else (0.1 * torch.randn(k, device=dev)).to(dt)
    configs = {c.label(): c for c in hopper.candidates(a, w.t())}
    if args.config not in configs:
        raise SystemExit(f"--config must be one of {sorted(configs)}")
    cfg = configs[args.config]

    def fused():
        return nk.norm_mm_triton(a, w.t(), None, weight, norm_bias, 1e-5, is_rms, None, config=cfg)

    if args.time:
        print(f"fused {common.do_bench_ms(fused):.4f} ms, cuBLAS GEMM {common.do_bench_ms(lambda: a @ w.t()):.4f} ms")
        return
    for _ in range(args.iters):
        fused()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
