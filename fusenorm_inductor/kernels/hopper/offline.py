"""Compile the Hopper kernels for sm_90a without a GPU (``triton.compile`` with a CUDA target): what the CPU
test suite and CI run, since Gluon has no interpreter. Reports registers, spills and shared memory."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from ._compat import gl

SM90 = ("cuda", 90, 32)


@dataclass
class Compiled:
    name: str
    registers: int
    spill_bytes: int  # local memory per thread (stack frame + spill stores): 0 when nothing spills
    shared: int
    ptx: str


def _triton_type(v) -> str:
    if isinstance(v, bool):
        return "constexpr"
    if isinstance(v, int):
        return "i32"
    if isinstance(v, float):
        return "fp32"
    return str(v)


def descriptor_type(block: list, dtype: str = "bf16") -> str:
    """The signature type of a host TMA descriptor of a 16-bit tensor with this box."""
    gdtype = gl.bfloat16 if dtype == "bf16" else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(block, gdtype)
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout!r}>"


def runtime_attrs(signature: dict, ints: dict) -> dict:
    """The specialization triton's JIT gives a launch with these values: 16-divisibility of every pointer
    (torch's allocations are aligned far beyond 16 bytes) and of every int in ``ints`` that is a multiple of
    16. Without it the offline compile is not the kernel the launcher runs: on the H200 a backward variant
    that compiled clean here spilled at run time, N = 256 being divisible where the offline N was not."""
    attrs = {}
    for i, (name, ty) in enumerate(signature.items()):
        if ty.startswith("*") or (name in ints and ints[name] % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, maxnreg: int,
                 attrs: dict | None = None) -> Compiled:
    """Compile gluon.jit ``fn`` for sm_90a. ``signature``: parameter -> triton type (constexprs included as
    "constexpr"), in the kernel's parameter order; ``attrs``: ``runtime_attrs``. Returns its resource usage
    as ptxas reports it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget(*SM90), options={"num_warps": num_warps, "maxnreg": maxnreg})
    usage = _resource_usage(k.asm["cubin"])
    return Compiled(k.metadata.name, usage["REG"], usage["LOCAL"] + usage["STACK"], k.metadata.shared,
                    k.asm["ptx"])


def _resource_usage(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-300:]}")
    return {k: int(v) for k, v in zip(("REG", "STACK", "SHARED", "LOCAL"), m.groups())}


def _compile_one(v: dict) -> dict:
    from . import gdpa, mm_norm, mm_norm_backward, norm_mm

    ops = {"mm_norm_backward": mm_norm_backward, "norm_mm": norm_mm, "gdpa": gdpa}
    try:
        c = ops.get(v.get("op"), mm_norm).compile_variant(v)
        return dict(v, ok=True, triton=_triton_version(), registers=c.registers, spill_bytes=c.spill_bytes, shared=c.shared,
                    cluster_barrier="barrier.cluster.arrive" in c.ptx and "barrier.cluster.wait" in c.ptx)
    except Exception as e:  # noqa: BLE001 - reported per variant
        root = e
        while root.__cause__ is not None:  # a CompilationError's text is the kernel source; the cause says why
            root = root.__cause__
        return dict(v, ok=False, triton=_triton_version(), error=f"{type(root).__name__}: {str(root)[-1500:]} (in {type(e).__name__}: "
                                       f"{str(e)[-500:]})")


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None) -> int:
    """``python -m fusenorm_inductor.kernels.hopper.offline [--jobs J]``: compile every variant the dispatch
    can launch (``offline_variants`` of mm_norm, mm_norm_backward, norm_mm and gdpa) for sm_90a and print one JSON object per line. Must run
    without TRITON_INTERPRET (the interpreter replaces the jit functions the compiler needs)."""
    import argparse
    import json
    from concurrent.futures import ProcessPoolExecutor

    from . import gdpa, mm_norm, mm_norm_backward, norm_mm

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--op", default=None, help="only this op's variants (mm_norm, mm_norm_backward, norm_mm, gdpa)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the sm_90 compile needs the real compiler")
    variants = (mm_norm.offline_variants() + mm_norm_backward.offline_variants() + norm_mm.offline_variants()
                + gdpa.offline_variants())
    if args.op is not None:
        variants = [v for v in variants if v.get("op", "mm_norm") == args.op]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for res in pool.map(_compile_one, variants):
            print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
