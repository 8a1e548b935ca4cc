"""Compile a Gluon kernel for sm_90a without a GPU (``triton.compile`` with a CUDA target), as triton's JIT
would specialize it at launch, and read its registers, spills and shared memory: what each kernel module's
``compile_offline`` builds on, and offline.py runs over every variant (Gluon has no interpreter)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Optional

SM90 = ("cuda", 90, 32)


@dataclass
class Compiled:
    name: str
    registers: int
    spill_bytes: int  # local memory per thread (stack frame + spill stores): 0 when nothing spills
    shared: int
    ptx: str


def descriptor_type(block: list, dtype: str = "bf16", split: Optional[list] = None) -> str:
    """The signature type of a host TMA descriptor of a 16-bit tensor with this box (``split``: its CTA split,
    common.descriptor's)."""
    from .common import smem_layout

    key = tuple(tuple(b) for b in split) if split is not None else None
    layout = smem_layout(tuple(block), dtype == "bf16", key)
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
                 attrs: dict | None = None, num_ctas: int = 1) -> Compiled:
    """Compile gluon.jit ``fn`` for sm_90a. ``signature``: parameter -> triton type (constexprs included as
    "constexpr"), in the kernel's parameter order; ``attrs``: ``runtime_attrs``. Returns its resource usage
    as ptxas reports it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget(*SM90), options={"num_warps": num_warps, "maxnreg": maxnreg,
                                                               "num_ctas": num_ctas})
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
