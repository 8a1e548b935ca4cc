"""Probe (CPU now, GPU later): the deferred RMSNorm link on the multicast pair mainloop, triton >= 3.9.

Why: ``probe_multicast_gemm.py`` ran at cuBLAS's time from K = N = 1024 on an H100 (results
``probe_multicast_run_h100.txt``), where the deferred kernels on triton 3.6's mainloop run 13-26% over it
(docs/history/performance-log.md). Deferral hides a norm only if its GEMMs keep that speed with the deferred epilogue
added. This is the costliest epilogue of a chain, the link ``linear -> RMSNorm -> linear -> RMSNorm``'s
middle GEMM, on the same mainloop (``probe_multicast_gemm.mainloop``):

- in: a [M, K] (the previous GEMM's output, not normalized), its partial statistics ``a_stats`` [M, K / 256]
  fp32 (per row, the sum of squares of each 256-column tile), b' [N, K] = the next linear's weight with the
  norm's weight folded in (host side, once per weight version), bias [N] fp32;
- epilogue: the row's statistics merged, ``acc * rsqrt(sum / K + eps) + bias``, rounded to bf16 and stored
  by TMA; then the *stored* values' sum of squares per row of this 256-column tile into ``stats`` [M, N / 256]
  (the next norm's partial statistics).

Each CTA of a pair holds its own BM rows of the [2 * BM, BN] tile, so every per-row sum stays inside a CTA:
no exchange, only the epilogue's extra loads (K / 256 floats per row) and stores (one float per row and tile).
It prints what compiled (shared memory, the PTX's multicast copies, the epilogue's loads and stores); with
``--run`` (a GPU with this triton), checks c and stats against an fp32 reference and times it against the
plain pair GEMM, cuBLAS's ``mm`` on the same operands and the norm's own pass over c that deferral removes
(do_bench medians, three rounds).

    PYTHONPATH=. .venv-next/bin/python benchmarks/probes/probe_multicast_deferred.py   # compile for sm_90a (CPU)
    python benchmarks/probes/probe_multicast_deferred.py --run --shape 1024x1024   # GPU, triton >= 3.9, fusenorm installed

(The reference and the input statistics are the product's, kernels/deferred.py: fusenorm must be importable.)
"""

from __future__ import annotations

import os
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_multicast_gemm as pair  # noqa: E402 - the mainloop, loader and layouts this probe shares

from fusenorm_inductor.kernels.deferred import RMS, merge_stats, partial_stats  # noqa: E402 - the product's

if pair.HAVE_MULTI_CTA:  # else probe_main says so and compiles nothing
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

TILE = 256  # columns per statistics tile (= the pair tile's BN: one partial per row and N tile)
EPS = 1e-6


@gluon.jit
def _row_rstd(a_stats_ptr, rows, M, K, eps, T_IN: gl.constexpr):
    """rsqrt(mean of squares + eps) per row, from the row's T_IN partial sums of squares."""
    ok = rows < M
    ss = gl.load(a_stats_ptr + rows * T_IN, mask=ok, other=0.0)
    for j in gl.static_range(1, T_IN):
        ss += gl.load(a_stats_ptr + rows * T_IN + j, mask=ok, other=0.0)
    return gl.rsqrt(ss / K + eps)


@gluon.jit
def _link_consumer(a_bufs, b_bufs, ready, empty_a, empty_b, c_desc, c_smem, a_stats_ptr, bias_ptr, stats_ptr,
                   M, N, K, eps, T_IN: gl.constexpr, WARPS: gl.constexpr):
    BM2: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = pair.acc_layout(BN, WARPS)
    t_out = gl.cdiv(N, BN)
    c = 0
    for t in range(gl.program_id(0), pair._tiles(M, N, BM2, BN), gl.num_programs(0)):
        pm, pn = pair._coords(t, N, BN)
        # the row statistics before the mainloop: their loads overlap the first stages' wait
        rows = pm * BM2 + gl.arange(0, BM2, layout=gl.SliceLayout(1, layout))
        cols = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        rstd = _row_rstd(a_stats_ptr, rows, M, K, eps, T_IN)
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        acc, c = pair.mainloop(a_bufs, b_bufs, ready, empty_a, empty_b, c, K, layout)
        out = (acc * gl.expand_dims(rstd, 1) + gl.expand_dims(bias, 0)).to(c_desc.dtype)
        # the next norm's partial statistics, of the values as stored (columns past N are zero: TMA's padding
        # of b' and the masked bias)
        stored = out.to(gl.float32)
        gl.store(stats_ptr + rows * t_out + pn, gl.sum(stored * stored, axis=1), mask=rows < M)
        tma.store_wait(0)  # the previous tile's store has left c_smem
        c_smem.store(out)
        fence_async_shared()
        tma.async_store(c_desc, [pm * BM2, pn * BN], c_smem)
    tma.store_wait(0)


@gluon.jit
def pair_link(a_desc, b_desc, c_desc, a_stats_ptr, bias_ptr, stats_ptr, M, N, K, eps, T_IN: gl.constexpr,
              STAGES: gl.constexpr, num_warps: gl.constexpr):
    """c = bf16(rstd(a) * (a @ b'^T) + bias) and its partial statistics (the module docstring)."""
    a_bufs, b_bufs, c_bufs, ready, empty_a, empty_b, _ = pair.pair_buffers(a_desc, b_desc, c_desc, STAGES, 1)
    c_smem = c_bufs.index(0)
    gl.warp_specialize([
        (_link_consumer, (a_bufs, b_bufs, ready, empty_a, empty_b, c_desc, c_smem, a_stats_ptr, bias_ptr,
                          stats_ptr, M, N, K, eps, T_IN, num_warps)),
        (pair._loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty_a, empty_b, M, N, K)),
    ], [1], [24])


def compile_sm90a(shape: str):
    k_dim = int(shape.split("x")[0])
    return pair.compile_pair(pair_link, {"a_stats_ptr": "*fp32", "bias_ptr": "*fp32", "stats_ptr": "*fp32",
                                         "M": "i32", "N": "i32", "K": "i32", "eps": "fp32", "T_IN": "constexpr"},
                             {"T_IN": triton.cdiv(k_dim, TILE)})


def report(k) -> None:
    ptx = k.asm["ptx"].splitlines()
    count = lambda pattern: sum(pattern in ln for ln in ptx)  # noqa: E731
    print(f"compiled: {k.metadata.shared} bytes of shared memory per CTA, num_ctas {k.metadata.num_ctas}, "
          f"num_warps {k.metadata.num_warps}")
    print(f"    multicast copies {count('multicast::cluster')}, wgmma {count('wgmma.mma_async')}, "
          f"global fp32 loads {count('ld.global') }, global stores {count('st.global')}, "
          f"TMA stores {count('cp.async.bulk.tensor.2d.global.shared')}")


def reference(a, b_fold, bias, a_stats, k_dim: int):
    """(c, stats) in fp32 math, c rounded once to bf16, stats of the rounded c: the product's own statistics
    functions (kernels/deferred.py), RMSNorm's row [M, T] of them."""
    import torch

    rstd = merge_stats(a_stats.unsqueeze(0), k_dim, TILE, EPS, RMS)[1]
    c = (rstd[:, None] * (a.float() @ b_fold.float().t()) + bias).to(torch.bfloat16)
    return c, partial_stats(c, RMS, TILE)[0]


def run(shape: str) -> None:
    import torch
    from triton.testing import do_bench

    m_dim, k_dim, n_dim, a, b_fold, c = pair.operands(shape)  # b_fold: a weight with the norm's weight in it
    bias = torch.randn(n_dim, device="cuda", dtype=torch.float32)
    t_in = triton.cdiv(k_dim, TILE)
    a_stats = partial_stats(a, RMS, TILE)[0]
    stats = torch.full((m_dim, triton.cdiv(n_dim, TILE)), float("nan"), device="cuda", dtype=torch.float32)
    da, db, dc, grid = pair.descriptors(a, b_fold, c)

    def link():
        pair_link[grid](da, db, dc, a_stats, bias, stats, m_dim, n_dim, k_dim, EPS, T_IN=t_in, STAGES=pair.STAGES,
                        num_warps=pair.WARPS, num_ctas=2)

    dpc = pair.descriptors(a, b_fold, torch.empty_like(c))[2]

    def plain():
        pair.pair_gemm[grid](da, db, dpc, m_dim, n_dim, k_dim, STAGES=pair.STAGES, num_warps=pair.WARPS, num_ctas=2)

    link()
    torch.cuda.synchronize()
    want_c, want_stats = reference(a, b_fold, bias, a_stats, k_dim)
    err_c = (c.float() - want_c.float()).abs().max().item()
    err_s = ((stats - want_stats).abs() / want_stats.abs().clamp_min(1.0)).max().item()
    print(f"c: max |error| {err_c:.4f} against the fp32 reference (rounded once); stats: max relative error "
          f"{err_s:.2e}; NaN left in c: {bool(c.isnan().any())}, in stats: {bool(stats.isnan().any())}")
    gamma = torch.randn(n_dim, device="cuda", dtype=torch.bfloat16)

    def norm_pass():  # the pass over c that deferral removes (eager RMSNorm: read c, write norm(c))
        torch.nn.functional.rms_norm(c, (n_dim,), gamma, EPS)

    for rnd in range(3):
        print(f"round {rnd}: link {do_bench(link, rep=100):.3f} ms, plain pair {do_bench(plain, rep=100):.3f} ms, "
              f"cuBLAS mm {do_bench(lambda: torch.mm(a, b_fold.t()), rep=100):.3f} ms, "
              f"RMSNorm pass {do_bench(norm_pass, rep=100):.3f} ms")


if __name__ == "__main__":
    pair.probe_main(__doc__, f"RMSNorm link on the pair tile A [{2 * pair.BM}, {pair.BK}] / B [{pair.BN}, "
                    f"{pair.BK}] multicast, statistics tiles of {TILE} columns", compile_sm90a, report, run)
