"""Probe (H200, issue 4): the Lazy Pre-Norm kernel candidates against cuBLAS and Inductor on a few shapes.

M = 262144, bf16, no affine; for each (K, N) and norm: cuBLAS GEMM, Inductor norm alone, Inductor norm ->
linear (dynamic=False), and every `prenorm_candidates` config of `norm_mm_triton` (the ``tl`` kernels), each with
the row sums reduced every K step ("red") and kept as [BLOCK_M, BLOCK_K] partials ("ts", through the kernel
module's TILE_SUMS_OVERRIDE hook) (time, hidden share, x cuBLAS, max |diff| vs Inductor). CUDA-graph medians
(common.cudagraph_ms, rep 20 ms). Run: python benchmarks/probes/probe_prenorm.py (one sm_90 GPU, ~4 minutes).
Results of the H200 run: benchmarks/results/probe_prenorm_h200.txt (probe_prenorm_race_h200.txt came from a
temporarily modified kernel, see its header).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import common  # noqa: E402

M = 262144
SHAPES = [(256, 256), (512, 512), (1024, 1024), (256, 2048), (2048, 256), (2048, 2048)]


def bench(f):
    return common.cudagraph_ms(f, rep=20)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

    from fusenorm_inductor import config
    from fusenorm_inductor.kernels.triton import norm_mm as nk
    from fusenorm_inductor.tuning import norm_mm as nk_tuning

    config.tuning.measure = False
    torch.manual_seed(0)
    for K, N in SHAPES:
        torch._dynamo.reset()  # a fresh compile per shape: past Dynamo's recompile limit it would run eager
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for is_rms in (False, True):
            eps = 1e-6 if is_rms else 1e-5

            def nf(x, K=K, is_rms=is_rms, eps=eps):
                return F.rms_norm(x, (K,), None, eps) if is_rms else F.layer_norm(x, (K,), None, None, eps)

            unf = torch.compile(lambda x, w: F.linear(nf(x), w), dynamic=False)
            nrm = torch.compile(nf, dynamic=False)
            unf(a, W)
            nrm(a)
            t_mm, t_u, t_n = bench(lambda: a @ W.t()), bench(lambda: unf(a, W)), bench(lambda: nrm(a))
            ref = unf(a, W).float()
            line = f"K={K} N={N} {'rms' if is_rms else 'ln '}: mm {t_mm:.4f} norm {t_n:.4f} unfused {t_u:.4f} |"
            for c in nk_tuning.prenorm_candidates(a, W.t(), torch.bfloat16):
                for tile_sums in (False, True):
                    nk.TILE_SUMS_OVERRIDE = tile_sums
                    label = f"{c.label()} {'ts' if tile_sums else 'red'}"

                    def fused(c=c, eps=eps, is_rms=is_rms):
                        return nk.norm_mm_triton(a, W.t(), None, None, None, eps, is_rms, None, config=c)

                    try:
                        err = (fused()[0].float() - ref).abs().max().item()
                        t = bench(fused)
                        line += f" {label}: {t:.4f} hid {(t_u - t) / t_n:+.2f} x{t / t_mm:.2f} err {err:.3g} |"
                    except Exception as e:  # noqa: BLE001 (a candidate that does not compile is reported)
                        line += f" {label}: FAILED {type(e).__name__} {str(e)[:80]} |"
            nk.TILE_SUMS_OVERRIDE = None
            print(line, flush=True)


if __name__ == "__main__":
    main()
