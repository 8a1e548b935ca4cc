"""What the Triton kernel tests share: cases, input builders, references, checks, poisoning, tolerances.

test_kernels_interpreter.py runs these on the CPU under the Triton interpreter (small odd shapes, fp32/fp16);
test_kernels_cuda.py on CUDA (realistic shapes, bf16/fp16/fp32). Each file keeps only its device, dtypes,
shapes, skip conditions and the tests of its own; the inputs, references and checks are the ones here.

This module imports the kernel modules: a test file imports it only after its skips and environment setup
(the interpreter file sets TRITON_INTERPRET before any kernel module is imported). The kernels run as the ops'
CUDA path runs them, through ``mm_norm_tuned`` / ``mm_norm_backward_tuned`` (ops/mm_norm.py,
ops/mm_norm_backward.py: the configuration from tuning, then the kernels' launcher, no launch plan kept),
which look the launchers and gemm_config up on their modules at call time, so a module reloaded after this
import is the one that runs.
"""

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from fusenorm_inductor.kernels.triton import common as _triton_common
from fusenorm_inductor.kernels.triton import mm_norm_backward as bwd_k
from fusenorm_inductor.kernels.triton import mm_norm as fwd_k
from fusenorm_inductor.ops.mm_norm import mm_norm_reference, mm_norm_tuned
from fusenorm_inductor.ops.mm_norm_backward import mm_norm_backward_reference, mm_norm_backward_tuned
from fusenorm_inductor.ops.norm import norm_reference

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-5
FWD_NAMES = ("y", "hh", "mean", "rstd")

DTYPE_IDS = {BF16: "bf16", F16: "fp16", F32: "fp32"}
NORMS = pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])


def parametrize_dtypes(*dtypes):
    return pytest.mark.parametrize("dtype", list(dtypes), ids=[DTYPE_IDS[d] for d in dtypes])


def stack(*marks):
    """One decorator for marks listed top to bottom, as if stacked (same parameters, same test ids)."""

    def apply(f):
        for mark in reversed(marks):
            f = mark(f)
        return f

    return apply


# ----------------------------------------------------------------------------------------------------------
# Tolerances, keyed by the dtype of the compared output
# ----------------------------------------------------------------------------------------------------------


def unit_roundoff(dtype):
    return {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}[dtype]


def _tol_16bit(dtype):
    # The kernel's and the reference's final roundings (u|y| each), and on the multi-tile path one rounding
    # of the scratch, u|hh*w| <= u(|y| + |nb|) (dx: u|t*rstd| <= u(|dx| + ~1)): <= 3u|y| + 4u -> 4u, 8u.
    return dict(atol=8 * unit_roundoff(dtype), rtol=4 * unit_roundoff(dtype))


INTERPRETER_TOL = {
    # fp32 on both sides, only the summation order differs (sums of <= 40 terms of size <= ~10): ~1e-6.
    F32: dict(atol=1e-5, rtol=1e-5),
    F16: _tol_16bit(F16),
}
CUDA_TOL = {
    # TF32 off: the kernel and cuBLAS sum K <= 512 fp32 products in different orders (~1e-6 of |h|), and y
    # multiplies that by |w| <= ~5 over 8M elements: <= ~5e-5. (TF32 is ~1e-3 of |h|: see the TF32 test.)
    F32: dict(atol=1e-4, rtol=1e-4),
    F16: _tol_16bit(F16),
    BF16: _tol_16bit(BF16),
}
# dw/db are fp32 column sums, relative to the largest entry. Interpreter: M <= 257 terms in another order,
# ~sqrt(M) * 2^-24 * |sum|, far below 1e-5. CUDA: 4097 terms (~u32 * M * |term| ~ 2e-4 on entries up to ~300)
# plus the GEMMs' fp32 rounding differences in dn summed over rows (~sqrt(M) * 1e-6): ~1e-6 of the largest.
COLSUM_RTOL = 1e-5


# ----------------------------------------------------------------------------------------------------------
# NaN poisoning and the launchers' test hooks
# ----------------------------------------------------------------------------------------------------------


class Recording:
    """Wraps a kernel: records each launch's keyword ``key`` (True when None), or refuses to run it."""

    def __init__(self, kernel, key=None, forbidden=False):
        self.kernel, self.key, self.forbidden, self.values = kernel, key, forbidden, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert not self.forbidden, "a kernel ran that this path must not launch"
            self.values.append(kwargs[self.key] if self.key else True)
            return self.kernel[grid](*args, **kwargs)

        return launch


def nan_alloc(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def poison_allocs(monkeypatch, alloc=nan_alloc):
    """Every buffer both launchers allocate comes from ``alloc`` (NaN-filled: unwritten elements show)."""
    monkeypatch.setattr(fwd_k, "_alloc", alloc)
    monkeypatch.setattr(bwd_k, "_alloc", alloc)


def force_block_n(monkeypatch, block_n):
    """None: the launchers' own configs; a power of two >= 16: that N tile (N > block_n goes multi-tile)."""
    monkeypatch.setattr(fwd_k, "_FORCE_BLOCK_N", block_n)
    monkeypatch.setattr(bwd_k, "_FORCE_BLOCK_N", block_n)


def poison_and_seed(monkeypatch):
    """The body of each file's autouse fixture: NaN-filled buffers catch unwritten elements; a fixed seed
    per test keeps failures reproducible."""
    poison_allocs(monkeypatch)
    torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------------------
# Cases (the shapes are each file's own)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fwd:
    bias: bool
    residual: Optional[str]  # None, "same" (a's dtype) or "f32"
    weight: bool
    norm_bias: bool
    save_normed: bool
    out: str  # "same" or "f32"
    b_t: bool  # b = W.t() of an [N, K] weight (stride (1, K))
    col_major: bool = False  # a and residual column-major


FWD_CASES = {
    "full": Fwd(True, "same", True, True, True, "same", b_t=True),
    "bare": Fwd(False, None, False, False, False, "same", b_t=False),
    # 16-bit: pre-norm dtype fp32 != out dtype, hh saved: the multi-tile scratch is hh.
    "mixed": Fwd(False, "f32", True, False, True, "same", b_t=True, col_major=True),
    # 16-bit: same without hh: the multi-tile scratch is a separate fp32 buffer.
    "no_save": Fwd(True, "f32", False, True, False, "same", b_t=True),
    # out fp32: the multi-tile scratch is y (exact).
    "out_f32": Fwd(True, None, True, True, True, "f32", b_t=True),
}


@dataclass(frozen=True)
class Bwd:
    extra: Optional[str]  # None, "same" (dy's dtype) or "f32"
    weight: bool
    has_bias: bool
    src_is_normed: bool
    src: str  # "same" or "f32"
    dx: str  # "same" or "f32"
    b_t: bool  # b = W.t() of an [N, K] tensor; else [K, N] contiguous (the next linear's weight [out, in])
    col_major: bool = False  # dy and src column-major


BWD_CASES = {
    "full": Bwd("same", True, True, False, "same", "same", b_t=False),
    "bare": Bwd(None, False, False, True, "same", "same", b_t=True),
    # 16-bit: dn's unfused dtype fp32 != dx dtype: the multi-tile scratch is a separate fp32 buffer.
    "mixed": Bwd("f32", True, True, False, "f32", "same", b_t=False, col_major=True),
    # dx fp32: the multi-tile scratch is dx (exact).
    "dx_f32": Bwd("same", False, True, True, "same", "f32", b_t=True),
}


def col_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, transposed strides (a non-contiguous operand)."""
    return t.t().contiguous().t()


def layernorm_reference64(h, weight, norm_bias):
    """fp64 two-pass LayerNorm of fp64 rows h: (mean, rstd, hh, y)."""
    var64, mean64 = torch.var_mean(h, dim=-1, unbiased=False)
    rstd64 = torch.rsqrt(var64 + EPS)
    hh64 = (h - mean64[:, None]) * rstd64[:, None]
    return mean64, rstd64, hh64, hh64 * weight.double() + norm_bias.double()


# ----------------------------------------------------------------------------------------------------------
# Inputs, references and checks on one device with one tolerance table
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    device: torch.device
    tol: dict  # assert_close kwargs keyed by the compared output's dtype
    colsum_rtol: float = COLSUM_RTOL

    def randn(self, *shape, dtype=F32):
        return torch.randn(*shape, device=self.device).to(dtype)

    def randn_scaled(self, m, k, dtype):
        """[m, k] of N(0, 1 / k): times a [k, n] of N(0, 1) gives N(0, 1)."""
        return (torch.randn(m, k, device=self.device) / math.sqrt(k)).to(dtype)

    def single_tile(self, m, n, k, dtype, force_block_n=None) -> bool:
        return _triton_common.gemm_config(m, n, k, dtype, self.device, force_block_n)[4]

    # -- checks --------------------------------------------------------------------------------------------

    def check(self, outs, refs, names):
        for out, ref, name in zip(outs, refs, names):
            assert out.shape == ref.shape, (name, out.shape, ref.shape)
            assert out.dtype == ref.dtype, (name, out.dtype, ref.dtype)
            assert out.device == ref.device, (name, out.device)
            assert torch.isfinite(out).all(), f"{name}: unwritten (NaN-poisoned) or non-finite elements"
            torch.testing.assert_close(out, ref, **self.tol[ref.dtype], msg=lambda m: f"{name}: {m}")

    def check_colsum(self, out, ref, name):
        assert out.shape == ref.shape, (name, out.shape, ref.shape)
        assert out.dtype == ref.dtype == F32, (name, out.dtype, ref.dtype)
        atol = self.colsum_rtol * max(1.0, ref.abs().max().item()) if ref.numel() else 0.0
        torch.testing.assert_close(out, ref, atol=atol, rtol=self.colsum_rtol, msg=lambda m: f"{name}: {m}")

    def check_forward(self, args):
        """mm_norm_tuned(*args) (tuning's configuration, then the launcher) against mm_norm_reference(*args)."""
        self.check(mm_norm_tuned(*args), mm_norm_reference(*args), FWD_NAMES)

    def check_backward(self, args):
        """mm_norm_backward_tuned(*args) against mm_norm_backward_reference(*args)."""
        dx, dw, db = mm_norm_backward_tuned(*args)
        rdx, rdw, rdb = mm_norm_backward_reference(*args)
        self.check([dx], [rdx], ["dx"])
        self.check_colsum(dw, rdw, "dw")
        self.check_colsum(db, rdb, "db")

    # -- inputs --------------------------------------------------------------------------------------------

    def fwd_args(self, c: Fwd, m, k, n, dtype, is_rms):
        a = self.randn_scaled(m, k, dtype)  # h = a @ b ~ N(0, 1)
        a = col_major(a) if c.col_major else a
        b = self.randn(n, k, dtype=dtype).t() if c.b_t else self.randn(k, n, dtype=dtype)
        bias = self.randn(n, dtype=dtype) if c.bias else None
        residual = None
        if c.residual:
            residual = self.randn(m, n, dtype=dtype if c.residual == "same" else F32)
            residual = col_major(residual) if c.col_major else residual
        weight = self.randn(n) if c.weight else None
        norm_bias = self.randn(n) if c.norm_bias else None
        out_dtype = F32 if c.out == "f32" else None
        return (a, b, bias, residual, weight, norm_bias, EPS, is_rms, out_dtype, c.save_normed)

    def bwd_args(self, c: Bwd, m, k, n, dtype, is_rms):
        dy = self.randn_scaled(m, k, dtype)  # dn = dy @ b ~ N(0, 1)
        dy = col_major(dy) if c.col_major else dy
        b = self.randn(n, k, dtype=dtype).t() if c.b_t else self.randn(k, n, dtype=dtype)
        extra = self.randn(m, n, dtype=dtype if c.extra == "same" else F32) if c.extra else None
        src_dtype = dtype if c.src == "same" else F32
        x = (torch.randn(m, n, device=self.device) * 2 + 0.5).to(src_dtype)  # the norm's input; rstd ~ 0.5
        hh, mean, rstd = norm_reference(x, None, None, EPS, is_rms)  # the forward's statistics of x
        src = hh if c.src_is_normed else x
        src = col_major(src) if c.col_major else src
        weight = self.randn(n) if c.weight else None
        dx_dtype = F32 if c.dx == "f32" else dtype
        return (dy, b, extra, src, weight, mean, rstd, is_rms, c.src_is_normed, c.has_bias, dx_dtype)

    def run_forward(self, c: Fwd, m, k, n, dtype, is_rms):
        self.check_forward(self.fwd_args(c, m, k, n, dtype, is_rms))

    def run_backward(self, c: Bwd, m, k, n, dtype, is_rms):
        self.check_backward(self.bwd_args(c, m, k, n, dtype, is_rms))

    # -- |mean| >> std -------------------------------------------------------------------------------------

    def check_layernorm_large_mean(self, m, k, n, dtype, w_max):
        """Rows of 1000 + N(0, ~2): the variance must come from deviations (two-pass / Chan), not
        E[h^2] - E[h]^2, and the multi-tile scratch must hold h - tile_mean, not h (ulp(1000): fp16 0.5,
        bf16 4). ``w_max`` bounds |w| over the n weights drawn (~4 for n = 40, ~5 up to 2048)."""
        a = self.randn_scaled(m, k, dtype)
        b = self.randn(n, k, dtype=dtype).t()
        # Same dtype as a: the pre-norm dtype is `dtype` (bf16 quantizes it to steps of 4).
        residual = (1000.0 + torch.randn(m, n, device=self.device)).to(dtype)
        weight, norm_bias = self.randn(n), self.randn(n)
        args = (a, b, None, residual, weight, norm_bias, EPS, False, None, True)
        y, hh, mean, rstd = mm_norm_tuned(*args)

        # fp64 two-pass reference from the same (rounded) inputs.
        h = a.double() @ b.double() + residual.double()
        mean64, rstd64, hh64, y64 = layernorm_reference64(h, weight, norm_bias)
        # A one-pass fp32 E[h^2] - E[h]^2 is off by ~ulp(1e6) = 0.06 on var ~ 2 (3%). The kernel's h is fp32
        # (ulp(1000) = 6e-5, 4e-5 std per element; fp32 K-sums add ~1e-6): rstd good to ~1e-5.
        torch.testing.assert_close(rstd.double(), rstd64, atol=0.0, rtol=5e-5)
        # Any fp32 mean of values near 1000 is off by ~u32 * 1000 * (sequential run length of the sum): a
        # GPU row sum adds up to ~32-64 values per thread in order, ~4e-4 seen in a simulation. Allow 1e-3
        # (1e-6 relative).
        torch.testing.assert_close(mean.double(), mean64, atol=1e-3, rtol=0.0)
        # hh = (h - mean) * rstd inherits that plus h's own fp32 rounding (3e-5), times rstd ~ 0.7: <= ~1e-3;
        # y multiplies it by |w| <= w_max; 16-bit outputs add their rounding (tol); fp32 rtol 1e-5.
        for out, ref, name, scale in ((hh, hh64, "hh", 1.0), (y, y64, "y", w_max)):
            assert torch.isfinite(out).all(), name
            atol = 1e-3 * scale + (self.tol[dtype]["atol"] if dtype != F32 else 0.0)
            rtol = self.tol[dtype]["rtol"] if dtype != F32 else 1e-5
            torch.testing.assert_close(
                out.double(), ref, atol=atol, rtol=rtol, msg=lambda s: f"{name}: {s}"
            )
