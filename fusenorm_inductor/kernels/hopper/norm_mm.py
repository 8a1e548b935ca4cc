"""Pre-norm forward on the Hopper GEMM core ("Lazy Pre-Norm"): ``c = norm(a) @ b + bias`` (``fusenorm::norm_mm``).

Semantics are ``norm_mm_reference``'s (ops/norm_mm.py), on the folded operands of
``kernels/triton/norm_mm.fold_norm_affine``: b' = diag(weight) b (a's dtype), bias' = bias + norm_bias b (fp32),
colsum = the column sums of the rounded b' (LayerNorm). The core multiplies a @ b' and, with its ``STATS``
switch, adds up each row's statistics from the A stages it already holds in shared memory (gemm_core.py);
the epilogue (``_norm_mm_epilogue``) applies them to the fp32 accumulator:
    RMSNorm:   c = rstd * acc + bias'
    LayerNorm: c = rstd * (acc - mean * colsum) + bias'
and the tiles of the first N tile column (pn = 0) store mean (LayerNorm) and rstd [M] fp32 for the backward.
Nothing of norm(a) is written and no row depends on another tile: any N, no clusters.

LayerNorm's statistics come from sums shifted by the row's mean over the first K tile (gemm_core), so the
variance keeps its precision at |mean| >> std; the rank-1 correction's own cancellation at large |mean| is
discussed in kernels/triton/norm_mm.py (the tl kernels share it).

Launcher: ``unsupported`` says why an input cannot take this path, ``candidates`` lists the configurations
to time, ``PrenormPlan`` compiles one and launches it with the per-call fast path (launch.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..gemm_config import num_sms
from . import launch as L
from ._compat import gl, gluon, tma
from .common import (
    LOAD_REGS,
    MMA_REGS,
    b_layout,
    descriptor,
    fit_config,
    operand_problem,
    padded,
    refuse_spills,
    storage_problem,
)
from .cpu_compile import compile_sm90, descriptor_type, runtime_attrs
from .epilogues import load_vector, stage_store, tile_index
from .gemm_core import gemm_ws, no_prologue

# The epilogue's FLAGS (gemm_core passes its switches as one integer): a bit per switch of norm_mm_kernel.
# gl.constexpr: the kernels read them as globals.
FLAG_HAS_BIAS = gl.constexpr(1)
FLAG_IS_RMS = gl.constexpr(2)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _norm_mm_epilogue(acc, off_m, off_n, pn, c_bufs, buf0: gl.constexpr, epi_bar, it, eargs,
                      FLAGS: gl.constexpr, M, N, layout: gl.constexpr, stats):
    c_desc = eargs[0]
    colsum_ptr = eargs[1]
    bias_ptr = eargs[2]
    mean_ptr = eargs[3]
    rstd_ptr = eargs[4]
    K = eargs[5]
    eps = eargs[6]
    HAS_BIAS: gl.constexpr = (FLAGS & FLAG_HAS_BIAS) != 0
    IS_RMS: gl.constexpr = (FLAGS & FLAG_IS_RMS) != 0
    BM: gl.constexpr = c_bufs.type.shape[1]
    BN: gl.constexpr = c_bufs.type.shape[2]
    rows, cols, rmask, cmask = tile_index(off_m, off_n, M, N, BM, BN, layout)
    shift = stats[0]
    s1 = stats[1]
    s2 = stats[2]
    kf = K.to(gl.float32)
    first = rmask & (pn == 0)  # one tile of a row block writes its statistics
    if IS_RMS:
        rstd = gl.rsqrt(s2 / kf + eps)
        c = acc * gl.expand_dims(rstd, 1)
    else:
        d = s1 / kf  # mean - shift: of the order of the row's spread
        mean = shift + d
        rstd = gl.rsqrt(gl.maximum(s2 / kf - d * d, 0.0) + eps)  # rounding may leave a hair below 0
        c = (acc - gl.expand_dims(mean, 1) * load_vector(colsum_ptr, cols)) * gl.expand_dims(rstd, 1)
        gl.store(mean_ptr + rows, mean, mask=first)
    gl.store(rstd_ptr + rows, rstd, mask=first)
    if HAS_BIAS:
        c = c + load_vector(bias_ptr, cols)
    tma.store_wait(0)  # the staging tile's previous store has left
    stage_store(c, c_desc, c_bufs.index(buf0), off_m, off_n)


@gluon.jit
def norm_mm_kernel(a_desc, b_desc, c_desc, colsum_ptr, bias_ptr, mean_ptr, rstd_ptr, M, N, K, eps,
                   HAS_BIAS: gl.constexpr, IS_RMS: gl.constexpr, STATS: gl.constexpr, NUM_STAGES: gl.constexpr,
                   SPAN: gl.constexpr, NCONS: gl.constexpr, B_KN: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
                   num_warps: gl.constexpr):
    eargs = (c_desc, colsum_ptr, bias_ptr, mean_ptr, rstd_ptr, K, eps)
    FLAGS: gl.constexpr = HAS_BIAS * FLAG_HAS_BIAS + IS_RMS * FLAG_IS_RMS
    gemm_ws(a_desc, b_desc, c_desc, M, N, K, no_prologue, _norm_mm_epilogue, eargs, FLAGS, STATS, 1, False,
            NUM_STAGES, 1, SPAN, NCONS, B_KN, 1, LOAD_REGS, MMA_REGS, num_warps)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def unsupported(a: Tensor, b: Tensor, out_dtype) -> Optional[str]:
    """Why ``norm_mm_gluon`` cannot take a [M, K] and b (or b') [K, N] (None when it can)."""
    # b's storage too: without a norm weight the kernel reads b itself (no folded copy)
    return operand_problem(a, b, out_dtype) or storage_problem(a, b)


def candidates(a: Tensor, b: Tensor) -> list:
    """Configurations worth timing, best guess first: the GEMM core's own (the epilogue is light and no
    row spans tiles), the 128x256 cooperative tile where N is wider than 128, 128-row ping-pong tiles; where
    rows span several 256-wide tiles, first the row-block schedule ("gl_rows": a program computes a row
    block's tiles one after the other and sums A's rows at the first only)."""
    k = a.shape[1]
    n = b.shape[1]
    bk = 64 if k >= 64 else 32
    out = [fit_config("gl_rows", 128, 256, bk, 4, 8, 1)] if n > 256 else []
    out += [fit_config("gl_coop", 128, 256, bk, 4, 8, 1)] if n > 128 else []
    out += [fit_config("gl_pp", 128, 128, bk, 5, 4, 2), fit_config("gl_coop", 128, 128, bk, 6, 4, 1)]
    return [c for c in out if c is not None]


class Launch(NamedTuple):
    ncons: int
    num_warps: int
    maxnreg: int
    span: int  # N tiles a program computes per row block (> 1: the row-block schedule)


def launch_shape(config, n: int) -> Launch:
    ncons = 2 if config.kind == "gl_pp" else 1
    warps = 4 if ncons == 2 else config.warps
    span = -(-n // config.block_n) if config.kind == "gl_rows" else 1
    return Launch(ncons, warps, L.maxnreg(L.padded_warps(1) + warps * ncons), span)


def _stats_mode(is_rms: bool, k: int, bk: int) -> int:
    return 1 if is_rms else (2 if k % bk == 0 else 3)


def _constexprs(config, shape: Launch, k: int, b_kn: bool, *, bias: bool, is_rms: bool) -> dict:
    return dict(HAS_BIAS=bias, IS_RMS=is_rms, STATS=_stats_mode(is_rms, k, config.block_k),
                NUM_STAGES=config.stages, SPAN=shape.span, NCONS=shape.ncons, B_KN=b_kn, LOAD_REGS=LOAD_REGS, MMA_REGS=MMA_REGS)


_PARAMS = ("a_desc", "b_desc", "c_desc", "colsum_ptr", "bias_ptr", "mean_ptr", "rstd_ptr", "M", "N", "K", "eps",
           "HAS_BIAS", "IS_RMS", "STATS", "NUM_STAGES", "SPAN", "NCONS", "B_KN", "LOAD_REGS", "MMA_REGS", "num_warps")
_N_RUNTIME = 11


class PrenormPlan:
    """One launch configuration of ``norm_mm_kernel`` for one argument signature: the compiled kernel, its
    grid and compile-time arguments, and the fast launcher. Calling it launches on new tensors of the same
    shapes, strides and dtypes. Raises ``common.SpillError`` when the specialization spills (never launched)."""

    def __init__(self, a, b_fold, bias_fold, colsum, eps, is_rms, c, mean, rstd, config) -> None:
        m, k = a.shape
        n = b_fold.shape[1]
        self.config, self.is_rms, self.eps = config, bool(is_rms), float(eps)
        self.shape = shape = launch_shape(config, n)
        self.kn = b_layout(a, b_fold) == "kn"
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        self.blocks = ([bm, bk], [bk, bn] if self.kn else [bn, bk], [bm, bn])
        consts = _constexprs(config, shape, k, self.kn, bias=bias_fold is not None, is_rms=is_rms)
        self.consts = tuple(consts[p] for p in _PARAMS[_N_RUNTIME:-1])
        args = self._runtime(a, b_fold, bias_fold, colsum, eps, c, mean, rstd, descriptors=True)
        compiled = L.compiled_kernel(norm_mm_kernel, args + self.consts, 1, num_warps=shape.num_warps,
                                     maxnreg=shape.maxnreg)
        refuse_spills(compiled, config.label())
        self.compiled = compiled
        self.fast = L.fast_launcher(compiled, 3, shape.num_warps, a.device)
        items = -(-m // bm) * (-(-n // bn) if shape.span == 1 else 1)  # tiles, or row blocks
        self.grid = min(items, num_sms(a.device))

    def _runtime(self, a, b_fold, bias_fold, colsum, eps, c, mean, rstd, descriptors: bool) -> tuple:
        m, k = a.shape
        n = b_fold.shape[1]
        bn = self.config.block_n
        descs = (a, b_fold if self.kn else b_fold.t(), c)
        if descriptors:
            descs = tuple(descriptor(t, blk) for t, blk in zip(descs, self.blocks))
        bias_fold, colsum = padded(bias_fold, bn), padded(colsum, bn)
        return descs + (colsum if colsum is not None else rstd, bias_fold if bias_fold is not None else rstd,
                        mean if mean.numel() else rstd, rstd, m, n, k, float(eps))

    def __call__(self, a, b_fold, bias_fold, colsum, eps, c, mean, rstd) -> None:
        if self.fast is not None:
            args = self._runtime(a, b_fold, bias_fold, colsum, eps, c, mean, rstd, descriptors=False)
            self.fast(self.grid, args[:3], args[3:] + self.consts)
            return
        args = self._runtime(a, b_fold, bias_fold, colsum, eps, c, mean, rstd, descriptors=True)
        L.run(self.compiled, self.grid, args + self.consts, self.shape.num_warps)


def norm_mm_gluon(a, b_fold, bias_fold, colsum, eps, is_rms, c, mean, rstd, config) -> PrenormPlan:
    """Write (c, mean, rstd) of ``norm_mm_reference`` with ``config`` (one of ``candidates``) on the folded
    operands into the given buffers. Returns the plan, which launches the same again on new buffers."""
    plan = PrenormPlan(a, b_fold, bias_fold, colsum, eps, is_rms, c, mean, rstd, config)
    plan(a, b_fold, bias_fold, colsum, eps, c, mean, rstd)
    return plan


# ----------------------------------------------------------------------------------------------------------
# Offline compile (CPU tests, CI)
# ----------------------------------------------------------------------------------------------------------


def compile_offline(config, n: int, k: int, *, is_rms: bool, bias: bool, bias_fp32: bool = True, b_kn: bool = False,
                    m: int = 1024):
    """Compile the kernel ``norm_mm_gluon`` would launch for this config and flags, for sm_90a, on the CPU.
    ``bias_fp32``: bias' is fp32 where a norm bias folds into it, else the linear's own bias (a's dtype)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    shape = launch_shape(config, n)
    values = dict(a_desc=descriptor_type([bm, bk]), b_desc=descriptor_type([bk, bn] if b_kn else [bn, bk]),
                  c_desc=descriptor_type([bm, bn]), colsum_ptr="*fp32", bias_ptr="*fp32" if bias_fp32 else "*bf16", mean_ptr="*fp32",
                  rstd_ptr="*fp32", M="i32", N="i32", K="i32", eps="fp32")
    constexprs = _constexprs(config, shape, k, b_kn, bias=bias, is_rms=is_rms)
    constexprs["num_warps"] = shape.num_warps
    signature = {p: values.get(p, "constexpr") for p in _PARAMS}
    attrs = runtime_attrs(signature, dict(M=m, N=n, K=k))
    return compile_sm90(norm_mm_kernel, signature, constexprs, shape.num_warps, shape.maxnreg, attrs)


OFFLINE_NS = (64, 256, 1024, 2048)
OFFLINE_KS = (40, 256, 1000)  # K = 40: BK 32 with a ragged tail; 1000: LayerNorm's masked last K tile
OFFLINE_FLAGS = {"rms": dict(is_rms=True, bias=True, bias_fp32=False), "ln": dict(is_rms=False, bias=True),
                 "ln_bare": dict(is_rms=False, bias=False)}


def offline_variants() -> list[dict]:
    """Every distinct specialization ``candidates`` produces over a grid of N and K, per flag set."""
    seen = {}
    for n in OFFLINE_NS:
        for k in OFFLINE_KS:
            a = torch.empty((1024, k), device="meta", dtype=torch.bfloat16)
            b = torch.empty((k, n), device="meta", dtype=torch.bfloat16)
            for cfg in candidates(a, b):
                for name, flags in OFFLINE_FLAGS.items():
                    stats = _stats_mode(flags["is_rms"], k, cfg.block_k)
                    seen.setdefault((cfg, name, stats, launch_shape(cfg, n).span), dict(op="norm_mm", config=list(cfg), n=n, k=k, flags=name,
                                                             save_normed=False, gemm_only=False, b_kn=False))
    return list(seen.values())


def compile_variant(v: dict):
    from ..gemm_config import GemmConfig

    return compile_offline(GemmConfig(*v["config"]), v["n"], v["k"], b_kn=v["b_kn"], **OFFLINE_FLAGS[v["flags"]])
