"""Probe: where the FlashNormAttention block's time goes, kernel by kernel, against baseline (a) (the GDPA op with
Inductor's norms), on bench_flash_norm_attention's inputs (B = 768, S = D = 128, bf16, fast_gelu).

Per point and direction, each implementation runs ``--iters`` times under torch.profiler; per CUDA kernel its
mean time per call of the block and its share, and the memory floor of one [T, H, D] pass (T * H * D * 2 bytes
over the copy bandwidth), so "this kernel is worth N passes" can be read off.

    python benchmarks/probes/probe_fna_kernels.py --H 1,8 --lmax 512 --out /tmp/fna_kernels.json
    python benchmarks/probes/probe_fna_kernels.py --variants staged,block ...   # also the block with
        # kernels/hopper/gdpa.STAGE_STATS (fused_staged) and, at H = 1, in one kernel (GLUON_BLOCK: fused_block)

Kernel times from common.profile_kernels (torch.profiler). Results of the H200 runs:
benchmarks/results/fna_kernels_h200.json and fna_kernels2_h200.json (--variants staged,block).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_flash_norm_attention as fna  # noqa: E402  (the block's inputs and implementations)
import bench_gemm_norm as gn  # noqa: E402  (its ceilings: the copy bandwidth)
import common  # noqa: E402


def main() -> None:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--H", default="1,8")
    p.add_argument("--lmax", default="512")
    p.add_argument("--dirs", default="fwd,bwd")
    p.add_argument("--batch", type=int, default=768)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default="",
                   help="comma list: staged (the attention step's statistics staged by the loader, fused_staged), "
                        "block (H = 1: the whole block in one Gluon kernel, fused_block)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import fusenorm_inductor  # noqa: F401  (registers torch.ops.fusenorm.*)
    from fusenorm_inductor.kernels.hopper import gdpa as hopper
    from fusenorm_inductor.ops import flash_norm_attention as fna_op
    from fusenorm_inductor.kernels.triton import flash_norm_attention as fna_kern

    switches = {"staged": (hopper, "STAGE_STATS"), "block": (fna_kern, "GLUON_BLOCK")}
    variants = [x for x in args.variants.split(",") if x]
    if set(variants) - set(switches):
        p.error(f"--variants: {variants} not in {sorted(switches)}")

    fna_op.CHECK_OFFSETS = False
    copy_gbps = gn.measure_ceilings(common.Bench("cudagraph", 20.0, "cuda"), "cuda", False)["copy_gbps"]
    rows = []
    for h in (int(x) for x in args.H.split(",")):
        for lmax in (int(x) for x in args.lmax.split(",")):
            case = fna.Case(args.batch, 128, h, 128, lmax, 0.5, "cuda")
            off = case.offsets
            seed_c = torch.compile(lambda *a: fna.seed_block(*a, off, lmax), dynamic=False)
            impls = {"fused": lambda *a: fna.fused_block(*a, off, lmax), "seed": seed_c}
            for name in variants:
                if name == "block" and h != 1:
                    continue
                module, flag = switches[name]

                def switched(*a, off=off, lmax=lmax, module=module, flag=flag):
                    setattr(module, flag, True)
                    try:
                        return fna.fused_block(*a, off, lmax)
                    finally:
                        setattr(module, flag, False)

                impls[f"fused_{name}"] = switched
            pass_ms = case.total * h * 128 * 2 / (copy_gbps * 1e9) * 1e3
            for direction in args.dirs.split(","):
                for name, fn in impls.items():
                    if direction == "fwd":
                        def call(fn=fn):
                            with torch.no_grad():
                                fn(*case.params)
                    else:
                        leaves = [t.detach().requires_grad_() for t in case.params]
                        out = fn(*leaves)
                        grad = torch.randn_like(out)

                        def call(out=out, leaves=leaves, grad=grad):
                            torch.autograd.grad(out, leaves, grad, retain_graph=True)
                    ks = common.profile_kernels(call, args.iters)
                    total = sum(ks.values())
                    rows.append({"H": h, "Lmax": lmax, "T": case.total, "dir": direction, "impl": name,
                                 "total_ms": total, "pass_ms": pass_ms, "kernels_ms": ks})
                    print(f"H={h} Lmax={lmax} {direction} {name}: {total:.3f} ms = {total / pass_ms:.1f} passes "
                          f"(one [T, H, D] pass {pass_ms:.3f} ms)")
                    for k, v in ks.items():
                        print(f"    {v:8.3f} ms {v / pass_ms:5.1f} passes  {k}")
            torch._dynamo.reset()
    meta = {**common.environment(python=False),  # gpu, torch, triton, date, commit
            "copy_gbps": copy_gbps, "iters": args.iters, "timer": "torch.profiler CUDA kernel times, mean per call"}
    common.write_json(args.out, {"meta": meta, "rows": rows}, quiet=True, rounded=False)


if __name__ == "__main__":
    main()
