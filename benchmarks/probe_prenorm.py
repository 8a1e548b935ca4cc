"""Probe (H200, issue 4): the Lazy Pre-Norm kernel candidates against cuBLAS and Inductor on a few shapes.

M = 262144, bf16, no affine; for each (K, N) and norm: cuBLAS GEMM, Inductor norm alone, Inductor norm ->
linear (dynamic=False), and every `prenorm_candidates` config of `norm_mm_triton`, each with the row sums
reduced every K step ("red") and kept as [BLOCK_M, BLOCK_K] partials ("ts") (time, hidden share, x cuBLAS,
max |diff| vs Inductor). Run: python benchmarks/probe_prenorm.py (one sm_90 GPU, ~4 minutes).
"""
import torch
import torch.nn.functional as F
import triton

from fusenorm_inductor import config
from fusenorm_inductor.kernels.triton import norm_mm as nk

config.tuning.measure = False
torch.manual_seed(0)
M = 262144


def bench(f):
    return triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median")



for K, N in [(256, 256), (512, 512), (1024, 1024), (256, 2048), (2048, 256), (2048, 2048)]:
    torch._dynamo.reset()  # a fresh compile per shape: past Dynamo's recompile limit it would run eager
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    for is_rms in (False, True):
        eps = 1e-6 if is_rms else 1e-5

        def nf(x):
            return F.rms_norm(x, (K,), None, eps) if is_rms else F.layer_norm(x, (K,), None, None, eps)

        unf = torch.compile(lambda x, w: F.linear(nf(x), w), dynamic=False)
        nrm = torch.compile(nf, dynamic=False)
        unf(a, W)
        nrm(a)
        t_mm, t_u, t_n = bench(lambda: a @ W.t()), bench(lambda: unf(a, W)), bench(lambda: nrm(a))
        ref = unf(a, W).float()
        line = f"K={K} N={N} {'rms' if is_rms else 'ln '}: mm {t_mm:.4f} norm {t_n:.4f} unfused {t_u:.4f} |"
        for c in nk.prenorm_candidates(a, W.t(), torch.bfloat16):
            for tile_sums in (False, True):
                nk.TILE_SUMS_OVERRIDE = tile_sums
                label = f"{c.label()} {'ts' if tile_sums else 'red'}"

                def fused(c=c):
                    return nk.norm_mm_triton(a, W.t(), None, None, None, eps, is_rms, None, config=c)

                try:
                    err = (fused()[0].float() - ref).abs().max().item()
                    t = bench(fused)
                    line += f" {label}: {t:.4f} hid {(t_u - t) / t_n:+.2f} x{t / t_mm:.2f} err {err:.3g} |"
                except Exception as e:  # noqa: BLE001 (a candidate that does not compile is reported)
                    line += f" {label}: FAILED {type(e).__name__} {str(e)[:80]} |"
        nk.TILE_SUMS_OVERRIDE = None
        print(line, flush=True)
