"""The Triton kernels of mm_norm / mm_norm_backward under the Triton interpreter (CPU), against references.

Covers both paths of each launcher (single tile, and multi tile forced with ``_FORCE_BLOCK_N = 16``),
LayerNorm and RMSNorm, every optional input, odd shapes (M = 33, 257; K = 17, 40; N = 17, 24, 40),
non-contiguous operands, the scratch choices of the multi-tile path, |mean| >> std, and degenerate shapes.
Every buffer the launchers allocate is poisoned with NaN, so an element a kernel fails to write fails.

fp32 and fp16 only: bf16 arithmetic is broken in the Triton 3.6 interpreter (platform.md); bf16 and the
larger shapes run in test_kernels_cuda.py. With CUDA present these tests are skipped (the device file covers
the kernels there, and the interpreter must not be switched on in a GPU session).
"""

import importlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    pytest.skip("CUDA is available: tests/test_kernels_cuda.py covers the kernels", allow_module_level=True)

# Triton reads the switch when a kernel is decorated (and in some library helpers at run time), so it is set
# before the kernel modules are imported and left set: this session has no GPU to run compiled Triton on.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

# Modules imported earlier in the session (without the switch) hold compiled-mode kernels: reload them.
for _name in (
    "fusenorm_inductor.ops._triton_common",
    "fusenorm_inductor.ops.mm_norm_kernels",
    "fusenorm_inductor.ops.mm_norm_backward_kernels",
):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

from fusenorm_inductor.ops import mm_norm_backward_kernels as bwd_k  # noqa: E402
from fusenorm_inductor.ops import mm_norm_kernels as fwd_k  # noqa: E402
from fusenorm_inductor.ops._triton_common import gemm_config  # noqa: E402
from fusenorm_inductor.ops.mm_norm import mm_norm_reference  # noqa: E402
from fusenorm_inductor.ops.mm_norm_backward import mm_norm_backward_reference  # noqa: E402
from fusenorm_inductor.ops.norm import norm_reference  # noqa: E402

# The interpreter's `range(0, K, ...)` with a runtime K goes through a deprecated numpy conversion (the
# reason numpy 2.4 breaks it, platform.md); not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

F32, F16 = torch.float32, torch.float16
EPS = 1e-5
CPU = torch.device("cpu")

# Tolerances keyed by the dtype of the compared output (u = unit roundoff, 2^-11 for fp16).
TOL = {
    # fp32 on both sides, only the summation order differs (sums of <= 40 terms of size <= ~10): ~1e-6.
    F32: dict(atol=1e-5, rtol=1e-5),
    # The kernel's and the reference's final roundings (u|y| each), and on the multi-tile path one rounding
    # of the scratch, u|hh*w| <= u(|y| + |nb|) (dx: u|t*rstd| <= u(|dx| + ~1)): <= 3u|y| + 4u -> 4u, 8u.
    F16: dict(atol=8 * 2.0**-11, rtol=4 * 2.0**-11),
}
# dw/db: fp32 column sums of M <= 257 terms in another order: error ~ sqrt(M) * 2^-24 * |sum|, far below
# 1e-5 of the largest entry.
COLSUM_RTOL = 1e-5


def _nan_alloc(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    """NaN-filled buffers catch unwritten elements; a fixed seed per test keeps failures reproducible."""
    monkeypatch.setattr(fwd_k, "_alloc", _nan_alloc)
    monkeypatch.setattr(bwd_k, "_alloc", _nan_alloc)
    torch.manual_seed(0)


@pytest.fixture(params=["single", "multi"])
def path(request, monkeypatch):
    """single: the launchers' own config (N <= 256 fits one tile); multi: 16-wide N tiles."""
    force = None if request.param == "single" else 16
    monkeypatch.setattr(fwd_k, "_FORCE_BLOCK_N", force)
    monkeypatch.setattr(bwd_k, "_FORCE_BLOCK_N", force)
    return request.param


def _assert_path(path, m, n, k, dtype, module):
    single = gemm_config(m, n, k, dtype, CPU, module._FORCE_BLOCK_N)[4]
    assert single == (path == "single"), "the test does not exercise the path it names"


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, transposed strides (a non-contiguous operand)."""
    return t.t().contiguous().t()


def _check(outs, refs, names):
    for out, ref, name in zip(outs, refs, names):
        assert out.shape == ref.shape, (name, out.shape, ref.shape)
        assert out.dtype == ref.dtype, (name, out.dtype, ref.dtype)
        assert torch.isfinite(out).all(), f"{name}: unwritten (NaN-poisoned) or non-finite elements"
        torch.testing.assert_close(out, ref, **TOL[ref.dtype], msg=lambda m: f"{name}: {m}")


def _check_colsum(out, ref, name):
    assert out.shape == ref.shape and out.dtype == ref.dtype == F32, (name, out.shape, ref.shape, out.dtype)
    atol = COLSUM_RTOL * max(1.0, ref.abs().max().item()) if ref.numel() else 0.0
    torch.testing.assert_close(out, ref, atol=atol, rtol=COLSUM_RTOL, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fwd:
    m: int
    k: int
    n: int
    bias: bool
    residual: Optional[str]  # None, "same" (a's dtype) or "f32"
    weight: bool
    norm_bias: bool
    save_normed: bool
    out: str  # "same" or "f32"
    b_t: bool  # b = W.t() of an [N, K] weight (stride (1, K))
    col_major: bool = False  # a and residual column-major


FWD_CASES = {
    "full": Fwd(33, 40, 40, True, "same", True, True, True, "same", b_t=True),
    "bare": Fwd(257, 40, 24, False, None, False, False, False, "same", b_t=False),
    # fp16: pre-norm dtype fp32 != out fp16, hh saved: the multi-tile scratch is hh.
    "mixed": Fwd(33, 40, 40, False, "f32", True, False, True, "same", b_t=True, col_major=True),
    # fp16: same without hh: the multi-tile scratch is a separate fp32 buffer.
    "no_save": Fwd(33, 17, 40, True, "f32", False, True, False, "same", b_t=True),
    # out fp32: the multi-tile scratch is y (exact).
    "out_f32": Fwd(33, 40, 40, True, None, True, True, True, "f32", b_t=True),
}


def _fwd_inputs(c: Fwd, dtype, is_rms):
    a = torch.randn(c.m, c.k) / math.sqrt(c.k)  # h = a @ b ~ N(0, 1)
    a = (_col_major(a.to(dtype)) if c.col_major else a.to(dtype))
    b = torch.randn(c.n, c.k).to(dtype).t() if c.b_t else torch.randn(c.k, c.n).to(dtype)
    bias = torch.randn(c.n).to(dtype) if c.bias else None
    residual = None
    if c.residual:
        residual = torch.randn(c.m, c.n).to(dtype if c.residual == "same" else F32)
        residual = _col_major(residual) if c.col_major else residual
    weight = torch.randn(c.n) if c.weight else None
    norm_bias = torch.randn(c.n) if c.norm_bias else None
    out_dtype = F32 if c.out == "f32" else None
    return (a, b, bias, residual, weight, norm_bias, EPS, is_rms, out_dtype, c.save_normed)


@pytest.mark.parametrize("case", list(FWD_CASES))
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_forward_matches_reference(path, case, dtype, is_rms):
    c = FWD_CASES[case]
    _assert_path(path, c.m, c.n, c.k, dtype, fwd_k)
    args = _fwd_inputs(c, dtype, is_rms)
    out = fwd_k.mm_norm_triton(*args)
    ref = mm_norm_reference(*args)
    _check(out, ref, ("y", "hh", "mean", "rstd"))


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_forward_layernorm_large_mean(path, dtype):
    """Rows of 1000 + N(0, 2): the variance must come from deviations (two-pass / Chan), not E[h^2] - E[h]^2,
    and the multi-tile scratch (fp16 here: ulp(1000) = 0.5) must hold h - tile_mean, not h."""
    m, k, n = 65, 24, 40
    _assert_path(path, m, n, k, dtype, fwd_k)
    a = (torch.randn(m, k) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, k).to(dtype).t()
    residual = (1000.0 + torch.randn(m, n)).to(dtype)  # same dtype as a: the pre-norm dtype is `dtype`
    weight, norm_bias = torch.randn(n), torch.randn(n)
    y, hh, mean, rstd = fwd_k.mm_norm_triton(a, b, None, residual, weight, norm_bias, EPS, False, None, True)

    # fp64 two-pass reference from the same (rounded) inputs.
    h = a.double() @ b.double() + residual.double()
    var64, mean64 = torch.var_mean(h, dim=-1, unbiased=False)
    rstd64 = torch.rsqrt(var64 + EPS)
    hh64 = (h - mean64[:, None]) * rstd64[:, None]
    y64 = hh64 * weight.double() + norm_bias.double()
    # A one-pass fp32 E[h^2] - E[h]^2 is off by ~ulp(1e6) = 0.06 on var ~ 2 (3%). The kernel's h is fp32
    # (ulp(1000) = 6e-5, i.e. 4e-5 std per element): var inherits ~1e-5 relative, rstd half of that.
    torch.testing.assert_close(rstd.double(), rstd64, atol=0.0, rtol=5e-5)
    # Any fp32 mean of values near 1000 is off by ~u32 * 1000 * (sequential run length of the sum): a GPU
    # row sum adds up to ~32-64 values per thread in order, ~4e-4 seen in a simulation. Allow 1e-3 (1e-6 rel).
    torch.testing.assert_close(mean.double(), mean64, atol=1e-3, rtol=0.0)
    # hh = (h - mean) * rstd inherits that plus h's own fp32 rounding (3e-5), times rstd ~ 0.7: <= ~1e-3;
    # y multiplies it by |w| <= ~4; 16-bit outputs add their rounding (TOL).
    for out, ref, name, scale in ((hh, hh64, "hh", 1.0), (y, y64, "y", 4.0)):
        assert torch.isfinite(out).all(), name
        atol = 1e-3 * scale + (TOL[dtype]["atol"] if dtype != F32 else 0.0)
        torch.testing.assert_close(
            out.double(), ref, atol=atol, rtol=TOL[dtype]["rtol"], msg=lambda s: f"{name}: {s}"
        )


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bwd:
    m: int
    k: int
    n: int
    extra: Optional[str]  # None, "same" (dy's dtype) or "f32"
    weight: bool
    has_bias: bool
    src_is_normed: bool
    src: str  # "same" or "f32"
    dx: str  # "same" or "f32"
    b_t: bool
    col_major: bool = False  # dy and src column-major


BWD_CASES = {
    "full": Bwd(33, 40, 40, "same", True, True, False, "same", "same", b_t=True),
    "bare": Bwd(257, 40, 24, None, False, False, True, "same", "same", b_t=False),
    # fp16: dn's unfused dtype fp32 != dx fp16: the multi-tile scratch is a separate fp32 buffer.
    "mixed": Bwd(33, 17, 40, "f32", True, True, False, "f32", "same", b_t=False, col_major=True),
    # dx fp32: the multi-tile scratch is dx (exact).
    "dx_f32": Bwd(33, 40, 40, "same", False, True, True, "same", "f32", b_t=True),
}


def _bwd_inputs(c: Bwd, dtype, is_rms):
    dy = (torch.randn(c.m, c.k) / math.sqrt(c.k)).to(dtype)  # dn = dy @ b ~ N(0, 1)
    dy = _col_major(dy) if c.col_major else dy
    b = torch.randn(c.n, c.k).to(dtype).t() if c.b_t else torch.randn(c.k, c.n).to(dtype)
    extra = torch.randn(c.m, c.n).to(dtype if c.extra == "same" else F32) if c.extra else None
    src_dtype = dtype if c.src == "same" else F32
    x = (torch.randn(c.m, c.n) * 2 + 0.5).to(src_dtype)  # the norm's input; rstd ~ 0.5
    hh, mean, rstd = norm_reference(x, None, None, EPS, is_rms)  # the forward's statistics of x
    src = hh if c.src_is_normed else x
    src = _col_major(src) if c.col_major else src
    weight = torch.randn(c.n) if c.weight else None
    dx_dtype = F32 if c.dx == "f32" else dtype
    return (dy, b, extra, src, weight, mean, rstd, is_rms, c.src_is_normed, c.has_bias, dx_dtype)


@pytest.mark.parametrize("case", list(BWD_CASES))
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_backward_matches_reference(path, case, dtype, is_rms):
    c = BWD_CASES[case]
    _assert_path(path, c.m, c.n, c.k, dtype, bwd_k)
    args = _bwd_inputs(c, dtype, is_rms)
    dx, dw, db = bwd_k.mm_norm_backward_triton(*args)
    rdx, rdw, rdb = mm_norm_backward_reference(*args)
    _check([dx], [rdx], ["dx"])
    _check_colsum(dw, rdw, "dw")
    _check_colsum(db, rdb, "db")


# ----------------------------------------------------------------------------------------------------------
# Degenerate shapes and plumbing
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:var_mean.*degrees of freedom")  # the reference's var_mean at M = 0
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 17), (0, 8, 24)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_degenerate_shapes(path, shape, is_rms):
    """N = 1 (zero variance), a last N tile of one column (17 = 16 + 1 when multi), K = 1, M = 0 and 1."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(n, k).t()
    bias, residual, weight, norm_bias = torch.randn(n), torch.randn(m, n), torch.randn(n), torch.randn(n)
    args = (a, b, bias, residual, weight, norm_bias, EPS, is_rms, None, True)
    _check(fwd_k.mm_norm_triton(*args), mm_norm_reference(*args), ("y", "hh", "mean", "rstd"))

    x = torch.randn(m, n) * 2 + 0.5
    _, mean, rstd = norm_reference(x, None, None, EPS, is_rms)
    bargs = (torch.randn(m, k), torch.randn(k, n), torch.randn(m, n), x, torch.randn(n), mean, rstd, is_rms,
             False, True, F32)
    dx, dw, db = bwd_k.mm_norm_backward_triton(*bargs)
    rdx, rdw, rdb = mm_norm_backward_reference(*bargs)
    _check([dx], [rdx], ["dx"])
    _check_colsum(dw, rdw, "dw")
    _check_colsum(db, rdb, "db")


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_default_multi_tile_config(is_rms):
    """The launchers' own multi-tile config (N = 300 > 256: three 128-wide N tiles, the last one of 44)."""
    m, k, n = 33, 17, 300
    assert not gemm_config(m, n, k, F16, CPU, None)[4]
    args = _fwd_inputs(Fwd(m, k, n, True, "same", True, True, True, "same", b_t=True), F16, is_rms)
    _check(fwd_k.mm_norm_triton(*args), mm_norm_reference(*args), ("y", "hh", "mean", "rstd"))
    bargs = _bwd_inputs(Bwd(m, k, n, "same", True, True, False, "same", "same", b_t=False), F16, is_rms)
    dx, dw, db = bwd_k.mm_norm_backward_triton(*bargs)
    rdx, rdw, rdb = mm_norm_backward_reference(*bargs)
    _check([dx], [rdx], ["dx"])
    _check_colsum(dw, rdw, "dw")
    _check_colsum(db, rdb, "db")


def test_outputs_come_from_alloc(path, monkeypatch):
    """The poisoning is only as good as the hook: every returned buffer must have come from ``_alloc``."""
    made = []

    def recording_alloc(shape, dtype, device):
        t = _nan_alloc(shape, dtype, device)
        made.append(t)
        return t

    monkeypatch.setattr(fwd_k, "_alloc", recording_alloc)
    monkeypatch.setattr(bwd_k, "_alloc", recording_alloc)
    args = _fwd_inputs(FWD_CASES["full"], F32, False)
    for t in fwd_k.mm_norm_triton(*args):
        assert any(t is u for u in made)

    made.clear()
    c = BWD_CASES["full"]
    dx, dw, db = bwd_k.mm_norm_backward_triton(*_bwd_inputs(c, F32, False))
    assert any(dx is u for u in made)
    # dw/db are host sums of [m_tiles, N] partial buffers, which must be poisoned too.
    partials = [u for u in made if u.dim() == 2 and u.shape[1] == c.n and u.shape[0] < c.m]
    assert len(partials) == 2
