"""What the Gluon kernel modules share on the host: the partitions' register budgets, the operand checks of the
GEMM core, configurations fitted to shared memory, the TMA descriptors and padded vectors a launch passes,
and the refusal to launch a specialization that spills registers.

Launching itself (compiled kernels, clusters, the per-call fast path) is launch.py's; the kernels' own
compile-time switches (the FLAGS bits) are named in the module of the kernel that reads them.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import launch as L
from ._compat import GLUON_ERROR, TensorDescriptor, gl

MAX_TILE_N = 256  # the widest wgmma instruction and TMA box
# setmaxnreg budgets of a warp-specialized kernel's loader partition and of each consumer partition (the
# backward's consumers take mm_norm_backward.BWD_MMA_REGS). The loader needs few registers; at 40, ptxas
# spilled a few LayerNorm epilogues of 128x256 tiles that compile cleanly at 24 (offline compile).
LOAD_REGS = 24
MMA_REGS = 232


# ----------------------------------------------------------------------------------------------------------
# Spills
# ----------------------------------------------------------------------------------------------------------

ALLOW_SPILLS = False  # the probe benchmark times spilling specializations too (--allow-spills)


class SpillError(RuntimeError):
    """The compiled kernel spills registers: not launched (the caller takes another path). A ``refusal``
    (tuning/measure.py): the specialization spills in every process, so its shape's measurement is kept."""

    refusal = True


def refuse_spills(compiled, label: str, obeys_allow_spills: bool = False) -> None:
    """Raise ``SpillError`` when ``compiled`` (``launch.compiled_kernel``'s) spills registers: such a
    specialization is never launched. ``obeys_allow_spills``: ``ALLOW_SPILLS`` lets it through (the post-norm
    forward and the backward, which the probe benchmark times)."""
    if getattr(compiled, "n_spills", 0) and not (obeys_allow_spills and ALLOW_SPILLS):
        raise SpillError(f"{label}: this specialization spills registers ({compiled.n_spills})")


# ----------------------------------------------------------------------------------------------------------
# The GEMM core's operands
# ----------------------------------------------------------------------------------------------------------


def b_layout(a: Tensor, b: Tensor) -> Optional[str]:
    """How TMA reads b [K, N]: "nk" when b = W.t() of a row-major W [N, K], "kn" when b is row-major."""
    k, n = b.shape
    if b.stride() == (1, k) or (n == 1 and b.stride(0) == 1):
        return "nk"
    if b.stride() == (n, 1) or (k == 1 and b.stride(1) == 1):
        return "kn"
    return None


def tma_ok(t: Tensor) -> bool:
    """Whether TMA can address t's storage: a 16-byte aligned base and row pitch."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def device_problem(a: Tensor) -> Optional[str]:
    """Why no Gluon GEMM can take ``a`` as its first operand at all (None when one can): this triton's Gluon,
    the device, the dtype. Every op's check starts here."""
    if GLUON_ERROR is not None:
        return f"this triton has no usable Gluon ({GLUON_ERROR})"
    if a.device.type != "cuda":
        return "not on CUDA"
    if torch.cuda.get_device_capability(a.device)[0] != 9:
        return "not an sm_90 GPU"
    if a.dtype not in (torch.float16, torch.bfloat16):
        return f"{a.dtype} operands (TMA/wgmma path: fp16/bf16)"
    return None


def operand_problem(a: Tensor, b: Tensor, out_dtype) -> Optional[str]:
    """Why a [M, K] and b [K, N] cannot be the core's TMA/wgmma operands with an output in their dtype (None
    when they can): what the Gluon GEMM ops check first (mm_norm.py and norm_mm.py)."""
    why = device_problem(a)
    if why is not None:
        return why
    m, k = a.shape
    n = b.shape[1]
    if k % 8 or n % 8:
        return f"K={k} or N={n} not a multiple of 8 (TMA rows must be 16-byte aligned)"
    if a.stride() != (k, 1):
        return "a is not row-major contiguous"
    if b_layout(a, b) is None:
        return "b is neither W.t() of a row-major W nor row-major"
    if (out_dtype or a.dtype) != a.dtype:
        return f"output dtype {out_dtype} differs from the operands'"
    return None


def storage_problem(a: Tensor, b: Tensor) -> Optional[str]:
    """Why the real storage of a or b cannot be read by TMA (None when it can, and for fake tensors)."""
    if not isinstance(a, torch._subclasses.FakeTensor):
        for name, t in (("a", a), ("b", b.t() if b_layout(a, b) == "nk" else b)):
            if not tma_ok(t):
                return f"{name}'s storage is not 16-byte aligned"
    return None


# ----------------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------------


def pow2_tile(n: int) -> int:
    """The tile width of rows of n columns that fit one tile: the next power of two, at least 32."""
    return max(32, 1 << max(0, n - 1).bit_length())


def fit_config(kind: str, bm: int, bn: int, bk: int, stages: int, warps: int, staging: int):
    """The config with the most stages (down to 2) that fits shared memory with ``staging`` staging tiles;
    None when none does."""
    from ..gemm_config import GemmConfig

    for st in range(stages, 1, -1):
        if L.smem_bytes(bm, bn, bk, st, staging) <= L.SMEM_LIMIT:
            return GemmConfig(kind, bm, bn, bk, st, warps)
    return None


# ----------------------------------------------------------------------------------------------------------
# A launch's arguments
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def smem_layout(block: tuple, bf16: bool, split: Optional[tuple] = None):
    """The shared-memory layout of a TMA box; ``split``: its CTA split (``pair_core``), None on one CTA."""
    dtype = gl.bfloat16 if bf16 else gl.float16
    if split is None:
        return gl.NVMMASharedLayout.get_default_for(list(block), dtype)
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype, cga_layout=[list(b) for b in split])


def descriptor(t: Tensor, block: list, split: Optional[list] = None):
    """A host TMA descriptor of the 2-D tensor t with this box (the layout object is made once per box), split
    over the CTAs of a program as ``split`` says (None: one CTA)."""
    key = tuple(tuple(b) for b in split) if split is not None else None
    return TensorDescriptor.from_tensor(t, block, smem_layout(tuple(block), t.dtype == torch.bfloat16, key))


def padded(v: Optional[Tensor], bn: int) -> Optional[Tensor]:
    """A per-column vector zero-padded to whole tiles: the epilogue loads it without a column mask (a mask
    over the BN / 4 columns each thread holds costs the registers the epilogue does not have)."""
    if v is None or v.shape[0] % bn == 0:
        return v
    return torch.nn.functional.pad(v, (0, bn - v.shape[0] % bn))
