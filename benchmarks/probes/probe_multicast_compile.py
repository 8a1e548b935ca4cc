"""Probe (CPU, no GPU): does a newer triton's Gluon compile a two-CTA wgmma tile whose B operand one TMA load
multicasts to both CTAs, for sm_90a?

Why: cuBLAS runs the deferred chain's GEMMs (M = 262144, K = N = 1024) as 256x128 tiles in clusters of two
CTAs with the shared operand multicast (its kernel names say ``..._1x2_...``), and the plugin's Gluon GEMMs,
one CTA per tile, ran 4% (alone) to 15-25% (in the chain, under load) over it on the H200
(docs/history/performance-log.md, "Deferred normalization"). Triton 3.6's Gluon has no multicast; the multi-CTA model of
newer ones (``num_ctas`` at compile time, ``cga_layout`` on layouts: a tensor sharded over the cluster's CTAs or
broadcast to all of them) does. This compiles one tile of that shape: A [2 * BM, BK] sharded along M (each CTA
its BM rows), B [BN, BK] broadcast (``tma.async_load(..., multicast=True)``), each CTA's wgmma on its half, the
pair's [2 * BM, BN] result stored; and prints whether the PTX has the multicast copy and the wgmma, and the
shared memory per CTA. It is not a GEMM: no K loop, no pipeline, nothing timed.

Run with the newer triton's interpreter (the repository's second venv, ``TRITON_NEXT_PYTHON``):

    .venv-next/bin/python benchmarks/probes/probe_multicast_compile.py

Results (triton 3.9.0, 2026-12-05): benchmarks/results/probe_multicast_compile.txt.
"""

from __future__ import annotations

import argparse
import sys
import traceback


def main() -> None:
    doc = __doc__.split("\n\n")
    argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def pair_tile(a_desc, b_desc, c_ptr, N, BM2: gl.constexpr, BN: gl.constexpr, MULTICAST: gl.constexpr):
        a = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_shape, a_desc.layout)
        b = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_shape, b_desc.layout)
        ready = mbarrier.allocate_mbarrier()
        mbarrier.init(ready, count=1)
        mbarrier.expect(ready, a_desc.nbytes_per_cta + b_desc.nbytes_per_cta)
        tma.async_load(a_desc, [0, 0], ready, a)
        tma.async_load(b_desc, [0, 0], ready, b, multicast=MULTICAST)
        mbarrier.wait(ready, 0)
        # the accumulator sharded like A: CTA r holds rows [r * BM2 / 2, (r + 1) * BM2 / 2)
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16], cga_layout=[[1, 0]])
        acc = warpgroup_mma(a, b.permute((1, 0)), gl.zeros([BM2, BN], gl.float32, layout), is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        rows = gl.arange(0, BM2, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        gl.store(c_ptr + gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0), acc.to(gl.bfloat16))

    def desc(block, cga):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16, cga_layout=cga)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    bm, bn, bk = 128, 128, 64
    print(f"triton {triton.__version__}; tile: A [{2 * bm}, {bk}] sharded over 2 CTAs, B [{bn}, {bk}] broadcast")
    for multicast in (True, False):
        sig = {"a_desc": desc([2 * bm, bk], [[1, 0]]), "b_desc": desc([bn, bk], [[0, 0]]), "c_ptr": "*bf16",
               "N": "i32", "BM2": "constexpr", "BN": "constexpr", "MULTICAST": "constexpr"}
        try:
            src = GluonASTSource(pair_tile, sig, constexprs={"BM2": 2 * bm, "BN": bn, "MULTICAST": multicast})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 2})
        except Exception:  # noqa: BLE001 - the answer may be "no": print why
            print(f"multicast={multicast}: does not compile")
            traceback.print_exc(limit=2, file=sys.stdout)
            continue
        ptx = k.asm["ptx"].splitlines()
        copies = [ln.strip().split(" [")[0] for ln in ptx if "cp.async.bulk.tensor" in ln]
        mmas = sorted({ln.strip().split(" {")[0] for ln in ptx if "wgmma.mma_async" in ln})
        print(f"multicast={multicast}: compiled, {k.metadata.shared} bytes of shared memory per CTA, "
              f"num_ctas {k.metadata.num_ctas}")
        for c in copies:
            print(f"    TMA load: {c}")
        print(f"    wgmma: {', '.join(mmas)} x {sum('wgmma.mma_async' in ln for ln in ptx)}")


if __name__ == "__main__":
    main()
