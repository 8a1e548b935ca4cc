"""Probe: every fused-kernel candidate of a shape, timed by the tuner, next to the GEMM base (norm off).

    python benchmarks/probes/probe_exchange.py 512x512,256x2048 ln,ln_aff,rms

For each K x N (M = 262144, bf16) and variant (ln, ln_aff = LayerNorm with weight and bias, rms), prints the
tuner's unfused estimate, each candidate's time (ms, CUDA-graph GPU time), the best, and the best config with
the norm switched off; forward (y = norm(a @ W.T)) and backward (dx = norm_backward(dz @ W2)). Used to choose
between the row-exchange designs (docs/history/design-history.md); results: benchmarks/results/probe_exchange_h200.txt.

The times are the tuner's own (``tuning.measure``: its candidates' times, and its timer for the GEMM base), so
that the base compares with the candidates; the tuning cache goes to /tmp/fusenorm-probe-cache.
"""

import argparse
import time

import torch

M = 262144
BF16 = torch.bfloat16
EPS = 1e-5


def line(tag: str, k: int, n: int, variant: str, entry: dict, t_base: float) -> str:
    cands = " ".join(f"[{c}]={t:.4f}" for c, t in entry["candidates"].items())
    return (f"{tag} K={k} N={n} {variant}: unfused_est={entry['t_unfused_ms']:.4f} fused={entry['t_fused_ms']:.4f} "
            f"gemm_only={t_base:.4f} {cands}")


def probe(k: int, n: int, variant: str) -> None:
    from fusenorm_inductor.kernels.triton import mm_norm as fk
    from fusenorm_inductor.kernels.triton import mm_norm_backward as bk
    from fusenorm_inductor.tuning import measure
    from fusenorm_inductor.tuning import mm_norm as fk_tuning
    from fusenorm_inductor.tuning import mm_norm_backward as bk_tuning

    is_rms, affine = variant.startswith("rms"), variant.endswith("aff")
    a = torch.randn(M, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16)
    weight = torch.ones(n, device="cuda") if affine else None
    nbias = torch.zeros(n, device="cuda") if affine and not is_rms else None
    t0 = time.time()
    e = fk_tuning.measure_forward(a, w.t(), None, None, weight, nbias, EPS, is_rms, BF16, affine)
    best = measure.config_of(e)
    args = (a, w.t(), None, None, None, None, EPS, is_rms, BF16, False)
    t_base = measure.time_ms(lambda: fk.mm_norm_triton(*args, config=best, gemm_only=True))
    print(line("FWD", k, n, variant, e, t_base) + f" ({time.time() - t0:.0f}s)", flush=True)
    # Backward: dz [M, K] @ W2 [K, N], from a saved normalized tensor.
    w2 = torch.randn(k, n, device="cuda", dtype=BF16)
    src = torch.randn(M, n, device="cuda", dtype=BF16)
    rstd = torch.rand(M, device="cuda") + 0.5
    e = bk_tuning.measure_backward(a, w2, None, src, weight, None, rstd, is_rms, True, nbias is not None, BF16)
    best = measure.config_of(e)
    bargs = (a, w2, None, src, None, None, rstd, is_rms, True, False, BF16)
    t_base = measure.time_ms(lambda: bk.mm_norm_backward_triton(*bargs, config=best, gemm_only=True))
    print(line("BWD", k, n, variant, e, t_base), flush=True)


def main() -> None:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", help="KxN comma list, e.g. 512x512,256x2048")
    p.add_argument("variants", help="comma list of ln, ln_aff, rms")
    args = p.parse_args()

    from fusenorm_inductor import config

    config.tuning.cache_dir = "/tmp/fusenorm-probe-cache"
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    for k, n in shapes:
        for variant in args.variants.split(","):  # ln, ln_aff, rms
            probe(k, n, variant)


if __name__ == "__main__":
    main()
