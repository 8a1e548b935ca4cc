"""Probe: where the FlashNormAttention block's time goes, kernel by kernel, against baseline (a) (the GDPA op with
Inductor's norms), on bench_flash_norm_attention's inputs (B = 768, S = D = 128, bf16, fast_gelu).

Per point and direction, each implementation runs ``--iters`` times under torch.profiler; per CUDA kernel its
mean time per call of the block and its share, and the memory floor of one [T, H, D] pass (T * H * D * 2 bytes
over the copy bandwidth), so "this kernel is worth N passes" can be read off.

    python benchmarks/probe_fna_kernels.py --H 1,8 --lmax 512 --out /tmp/fna_kernels.json
    python benchmarks/probe_fna_kernels.py --variants staged,block ...   # also the block with
        # kernels/hopper/gdpa.STAGE_STATS (fused_staged) and, at H = 1, in one kernel (GLUON_BLOCK: fused_block)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_flash_norm_attention as fna  # noqa: E402
import bench_gemm_norm as gn  # noqa: E402


def kernel_times(fn, iters: int) -> dict:
    """Mean CUDA time per call of ``fn`` by kernel name (ms), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]] += e.device_time / 1e3 / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    import triton

    import fusenorm_inductor  # noqa: F401  (registers torch.ops.fusenorm.*)
    from fusenorm_inductor.kernels.hopper import gdpa as hopper
    from fusenorm_inductor.ops import flash_norm_attention as fna_op
    from fusenorm_inductor.kernels.triton import flash_norm_attention as fna_kern

    switches = {"staged": (hopper, "STAGE_STATS"), "block": (fna_kern, "GLUON_BLOCK")}
    variants = [x for x in args.variants.split(",") if x]
    if set(variants) - set(switches):
        p.error(f"--variants: {variants} not in {sorted(switches)}")

    fna_op.CHECK_OFFSETS = False
    copy_gbps = gn.measure_ceilings(gn.Bench("cudagraph", 20.0, "cuda"), "cuda", False)["copy_gbps"]
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
                    ks = kernel_times(call, args.iters)
                    total = sum(ks.values())
                    rows.append({"H": h, "Lmax": lmax, "T": case.total, "dir": direction, "impl": name,
                                 "total_ms": total, "pass_ms": pass_ms, "kernels_ms": ks})
                    print(f"H={h} Lmax={lmax} {direction} {name}: {total:.3f} ms = {total / pass_ms:.1f} passes "
                          f"(one [T, H, D] pass {pass_ms:.3f} ms)")
                    for k, v in ks.items():
                        print(f"    {v:8.3f} ms {v / pass_ms:5.1f} passes  {k}")
            torch._dynamo.reset()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": gn._git_commit(),
            "copy_gbps": copy_gbps, "iters": args.iters, "timer": "torch.profiler CUDA kernel times, mean per call"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
