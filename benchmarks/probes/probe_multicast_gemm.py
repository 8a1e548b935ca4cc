"""Probe (CPU now, GPU later): a persistent, warp-specialized GEMM whose CTA pairs share B by TMA multicast,
written in the multi-CTA model of newer tritons' Gluon, compiled for sm_90a.

Why: at K = N = 1024 the deferred GEMMs ran 13-26% over cuBLAS (docs/history/performance-log.md, "Deferred
normalization"), whose kernel for these shapes (``nvjet_sm90_tst_128x256_64x4_2x1``) runs CTA pairs that load
the shared operand once. ``probe_multicast_compile.py`` showed that triton 3.9's Gluon compiles one such tile;
this writes the whole mainloop, which needs a stage of B released by *both* CTAs before it is loaded again:

- the pair is one program (``num_ctas=2``): A [2 * BM, BK] is sharded over the CTAs (each loads its BM rows),
  B [BN, BK] is loaded once by CTA 0 and multicast into both CTAs' shared memory (the compiled PTX predicates
  the multicast copy on ``%cluster_ctarank == 0``);
- ``ready[s]``: one barrier per CTA (``allocate_mbarrier``), expecting that CTA's A bytes and the whole B;
- ``empty_a[s]``: one barrier per CTA: its consumer released its A slot (its loader overwrites only that);
- ``empty_b[s]``: one barrier for the pair (a broadcast CGA layout, ``[[0, 0]]``): it lives in CTA 0, both
  consumers arrive on it (the PTX arrives at the CTA-0 address of the cluster window), and only CTA 0 waits
  on it (the others skip the wait), which is what the multicasting loader needs. On sm_90a Gluon has no
  multicast arrive (``mbarrier.arrive.multicast::cluster`` is sm_100), so this gather is the way to release.

The loader, the mainloop and the buffers are the product's now (kernels/hopper/pair_core.py, where the
deferred GEMMs run them on triton >= 3.9); this probe times them under a plain store. The consumer (one
partition of ``num_warps`` warps, the accumulator [2 * BM, BN] sharded like A) runs the same
wgmma loop as gemm_core's cooperative schedule and stores each tile through shared memory by TMA. It prints
whether it compiles, the shared memory per CTA, and the PTX's multicast copies, cluster arrives and wgmmas.
Nothing is launched here: ``--run`` (on a GPU with this triton) also times it against cuBLAS and checks the
product, the step the next device session takes.

    .venv-next/bin/python benchmarks/probes/probe_multicast_gemm.py            # compile for sm_90a (CPU)
    python benchmarks/probes/probe_multicast_gemm.py --run --shape 1024x1024   # a GPU with triton >= 3.9

Results: compiled (triton 3.9.0, 2026-12-05): benchmarks/results/probe_multicast_compile.txt; run on an H100
with triton 3.9.0 carried beside torch 2.11 (2026-12-06; triton 3.9 needs TRITON_PTXAS_BLACKWELL_PATH set as
well as TRITON_PTXAS_PATH): benchmarks/results/probe_multicast_run_h100.txt.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# The pair mainloop is the product's (kernels/hopper/pair_core.py); the multi-CTA API it needs is triton >= 3.9's
# (3.6 has none: the probe says so and stops).
from fusenorm_inductor.kernels.hopper import pair_core  # noqa: E402
from fusenorm_inductor.kernels.hopper._compat import fence_async_shared, tma  # noqa: E402
from fusenorm_inductor.kernels.hopper.pair_core import _coords, _loader, _tiles, pair_buffers  # noqa: E402
from fusenorm_inductor.kernels.hopper.pair_core import pair_acc_layout as acc_layout  # noqa: E402,F401
from fusenorm_inductor.kernels.hopper.pair_core import pair_mainloop as mainloop  # noqa: E402

HAVE_MULTI_CTA = pair_core.unavailable() is None

BM, BN, BK, STAGES, WARPS = 128, 256, 64, 3, 8  # per CTA: cuBLAS's tile for these shapes


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty_a, empty_b, c_desc, c_bufs, M, N, K, WARPS: gl.constexpr):
    BM2: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = acc_layout(BN, WARPS)
    c = 0
    for t in range(gl.program_id(0), _tiles(M, N, BM2, BN), gl.num_programs(0)):
        pm, pn = _coords(t, N, BN)
        acc, c = mainloop(a_bufs, b_bufs, ready, empty_a, empty_b, c, K, layout)
        tma.store_wait(0)  # the previous tile's store has left the staging tile
        c_bufs.index(0).store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_store(c_desc, [pm * BM2, pn * BN], c_bufs.index(0))
    tma.store_wait(0)


@gluon.jit
def pair_gemm(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """C [M, N] = A [M, K] @ B [N, K]^T, bf16, fp32 accumulation (the module docstring)."""
    a_bufs, b_bufs, c_bufs, ready, empty_a, empty_b, _ = pair_buffers(a_desc, b_desc, c_desc, STAGES, 1)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty_a, empty_b, c_desc, c_bufs, M, N, K, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty_a, empty_b, M, N, K)),
    ], [1], [24])


def _layouts():
    """The descriptors' shared layouts: A and C sharded over the pair along M, B the same in both CTAs."""
    a = gl.NVMMASharedLayout.get_default_for([2 * BM, BK], gl.bfloat16, cga_layout=[[1, 0]])
    b = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16, cga_layout=[[0, 0]])
    c = gl.NVMMASharedLayout.get_default_for([2 * BM, BN], gl.bfloat16, cga_layout=[[1, 0]])
    return a, b, c


def compile_pair(kernel, extra_sig: dict, constexprs: dict):
    """``kernel`` compiled for sm_90a as a pair (``num_ctas=2``): its descriptors' types (the pair tile's
    layouts), ``extra_sig`` for its other parameters, and STAGES / num_warps (this module's)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    la, lb, lc = _layouts()
    sig = {"a_desc": f"tensordesc<bf16[{2 * BM}, {BK}],{la!r}>", "b_desc": f"tensordesc<bf16[{BN}, {BK}],{lb!r}>",
           "c_desc": f"tensordesc<bf16[{2 * BM}, {BN}],{lc!r}>", **extra_sig,
           "STAGES": "constexpr", "num_warps": "constexpr"}
    src = GluonASTSource(kernel, sig, constexprs={**constexprs, "STAGES": STAGES, "num_warps": WARPS})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS, "num_ctas": 2})


def compile_sm90a(_shape: str = ""):
    return compile_pair(pair_gemm, {"M": "i32", "N": "i32", "K": "i32"}, {})


def descriptors(a, b, c):
    """TMA descriptors of A [M, K], B [N, K] and C [M, N] for the pair tile, and the persistent grid."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    la, lb, lc = _layouts()
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms // 2, triton.cdiv(a.shape[0], 2 * BM) * triton.cdiv(b.shape[0], BN)),)
    return (TensorDescriptor.from_tensor(a, [2 * BM, BK], la), TensorDescriptor.from_tensor(b, [BN, BK], lb),
            TensorDescriptor.from_tensor(c, [2 * BM, BN], lc), grid)


def report(k) -> None:
    ptx = k.asm["ptx"].splitlines()

    def kinds(pattern):
        return sorted({ln.strip().split(" [")[0].split(" _,")[0].split(" {")[0] for ln in ptx if pattern in ln})

    print(f"compiled: {k.metadata.shared} bytes of shared memory per CTA, num_ctas {k.metadata.num_ctas}, "
          f"num_warps {k.metadata.num_warps}")
    for what, pattern in (("TMA loads", "cp.async.bulk.tensor"), ("arrives", "mbarrier.arrive"),
                          ("waits", "mbarrier.try_wait"), ("wgmma", "wgmma.mma_async"),
                          ("cluster barriers", "barrier.cluster")):
        print(f"    {what}: " + "; ".join(kinds(pattern)))


def operands(shape: str):
    """(M, K, N, A [M, K], B [N, K], C [M, N] poisoned with NaN) for ``--shape KxN``, M = 262144, bf16, seeded."""
    import torch

    k_dim, n_dim = (int(v) for v in shape.split("x"))
    m_dim = 262144
    torch.manual_seed(0)
    a = torch.randn(m_dim, k_dim, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n_dim, k_dim, device="cuda", dtype=torch.bfloat16) / k_dim ** 0.5
    c = torch.full((m_dim, n_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    return m_dim, k_dim, n_dim, a, b, c


def run(shape: str) -> None:
    """On a GPU: check the product against cuBLAS's and time both (do_bench medians)."""
    import torch
    from triton.testing import do_bench

    m_dim, k_dim, n_dim, a, b, c = operands(shape)
    da, db, dc, grid = descriptors(a, b, c)

    def call():
        pair_gemm[grid](da, db, dc, m_dim, n_dim, k_dim, STAGES=STAGES, num_warps=WARPS, num_ctas=2)

    call()
    torch.cuda.synchronize()
    want = a.float() @ b.float().t()
    err = (c.float() - want).abs().max().item()
    print(f"max |error| against fp32: {err:.4f} (cuBLAS bf16: "
          f"{(torch.mm(a, b.t()).float() - want).abs().max().item():.4f})")
    for rnd in range(3):
        print(f"round {rnd}: pair_gemm {do_bench(call, rep=100):.3f} ms, "
              f"cuBLAS {do_bench(lambda: torch.mm(a, b.t()), rep=100):.3f} ms")


def probe_main(doc: str, title: str, compile_fn, report_fn, run_fn) -> None:
    """A pair probe's command line: compile for sm_90a (``compile_fn(shape)``) and print what compiled
    (``report_fn``); with ``--run``, ``run_fn(shape)`` on this machine's GPU."""
    parts = doc.split("\n\n")
    p = argparse.ArgumentParser(description=parts[0], epilog="\n\n".join(parts[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="also check and time it on this machine's GPU")
    p.add_argument("--shape", default="1024x1024", help="KxN of the GEMM (M = 262144)")
    args = p.parse_args()
    print(f"triton {triton.__version__}; {title}")
    if not HAVE_MULTI_CTA:
        print("this triton's Gluon has no multi-CTA API (triton 3.6): nothing to compile")
        return
    try:
        report_fn(compile_fn(args.shape))
    except Exception:  # noqa: BLE001 - the answer may be "no": print why
        print("does not compile")
        traceback.print_exc(limit=4, file=sys.stdout)
        return
    if args.run:
        run_fn(args.shape)


if __name__ == "__main__":
    probe_main(__doc__, f"pair tile: A [{2 * BM}, {BK}] sharded over 2 CTAs, B [{BN}, {BK}] multicast, {STAGES} "
               f"stages, {WARPS} consumer warps", compile_sm90a, report, run)
