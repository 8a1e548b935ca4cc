"""The Triton kernels of mm_norm / mm_norm_backward on CUDA, against the references, at realistic sizes.

M = 4097 rows, K in {64, 257, 512}, N in {40, 128, 256, 300, 1024, 2048} (single-tile path up to 256,
multi-tile above), bf16/fp16/fp32, LayerNorm and RMSNorm, every optional input, non-contiguous operands,
|mean| >> std, fp32 with TF32 off (tight) and on (the kernels follow torch's TF32 flag), determinism of
dw/db, and the custom ops' CUDA registrations. Every buffer the launchers allocate is poisoned with NaN.

The same checks at small shapes run on the CPU under the Triton interpreter: test_kernels_interpreter.py.
"""

import math
from dataclasses import dataclass
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.ops import mm_norm_backward_kernels as bwd_k  # noqa: E402
from fusenorm_inductor.ops import mm_norm_kernels as fwd_k  # noqa: E402
from fusenorm_inductor.ops._triton_common import gemm_config  # noqa: E402
from fusenorm_inductor.ops.mm_norm import mm_norm_reference  # noqa: E402
from fusenorm_inductor.ops.mm_norm_backward import mm_norm_backward_reference  # noqa: E402
from fusenorm_inductor.ops.norm import norm_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, F16, F32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
EPS = 1e-5
M = 4097
KS = (64, 257, 512)
NS = (40, 128, 256, 300, 1024, 2048)
SINGLE_N, MULTI_N = 128, 2048  # one shape per path for the variant tests


def _u(dtype):
    """Unit roundoff."""
    return {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}[dtype]


# Tolerances keyed by the dtype of the compared output.
TOL = {
    # TF32 off: the kernel and cuBLAS sum K <= 512 fp32 products in different orders (~1e-6 of |h|), and y
    # multiplies that by |w| <= ~5 over 8M elements: <= ~5e-5. (TF32 is ~1e-3 of |h|: see the TF32 test.)
    F32: dict(atol=1e-4, rtol=1e-4),
    # The kernel's and the reference's final roundings (u|y| each), and on the multi-tile path one rounding
    # of the scratch, u|hh*w| <= u(|y| + |nb|) (dx: u|t*rstd| <= u(|dx| + ~1)): <= 3u|y| + 4u -> 4u, 8u.
    F16: dict(atol=8 * _u(F16), rtol=4 * _u(F16)),
    BF16: dict(atol=8 * _u(BF16), rtol=4 * _u(BF16)),
}
# dw/db: fp32 column sums of 4097 terms in another order (~u32 * M * |term| ~ 2e-4 on entries up to ~300)
# plus the GEMMs' fp32 rounding differences in dn summed over rows (~sqrt(M) * 1e-6): ~1e-6 of the largest.
COLSUM_RTOL = 1e-5


def _nan_alloc(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _set_tf32(enabled: bool) -> None:
    # The legacy setter works whichever API was used before (reading allow_tf32 can raise in torch >= 2.9).
    torch.backends.cuda.matmul.allow_tf32 = enabled


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    """NaN-poisoned buffers, the launchers' own configs, TF32 off (exact fp32 on both sides), a fixed seed."""
    monkeypatch.setattr(fwd_k, "_alloc", _nan_alloc)
    monkeypatch.setattr(bwd_k, "_alloc", _nan_alloc)
    monkeypatch.setattr(fwd_k, "_FORCE_BLOCK_N", None)
    monkeypatch.setattr(bwd_k, "_FORCE_BLOCK_N", None)
    matmul = torch.backends.cuda.matmul
    old = getattr(matmul, "fp32_precision", None)
    old_legacy = None
    if old is None:
        old_legacy = matmul.allow_tf32
    _set_tf32(False)
    torch.manual_seed(0)
    yield
    if old is not None:
        matmul.fp32_precision = old
    else:
        matmul.allow_tf32 = old_legacy


def _col_major(t):
    return t.t().contiguous().t()


def _randn(*shape, dtype=F32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _check(outs, refs, names):
    for out, ref, name in zip(outs, refs, names):
        assert out.shape == ref.shape, (name, out.shape, ref.shape)
        assert out.dtype == ref.dtype, (name, out.dtype, ref.dtype)
        assert out.device == ref.device, (name, out.device)
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
    # out fp32: the multi-tile scratch is y.
    "out_f32": Fwd(True, None, True, True, True, "f32", b_t=True),
}


def _fwd_args(c: Fwd, m, k, n, dtype, is_rms):
    a = (torch.randn(m, k, device=DEVICE) / math.sqrt(k)).to(dtype)  # a @ b ~ N(0, 1)
    a = _col_major(a) if c.col_major else a
    b = _randn(n, k, dtype=dtype).t() if c.b_t else _randn(k, n, dtype=dtype)
    bias = _randn(n, dtype=dtype) if c.bias else None
    residual = None
    if c.residual:
        residual = _randn(m, n, dtype=dtype if c.residual == "same" else F32)
        residual = _col_major(residual) if c.col_major else residual
    weight = _randn(n) if c.weight else None
    norm_bias = _randn(n) if c.norm_bias else None
    out_dtype = F32 if c.out == "f32" else None
    return (a, b, bias, residual, weight, norm_bias, EPS, is_rms, out_dtype, c.save_normed)


def _run_forward(case, m, k, n, dtype, is_rms):
    args = _fwd_args(FWD_CASES[case], m, k, n, dtype, is_rms)
    _check(fwd_k.mm_norm_triton(*args), mm_norm_reference(*args), ("y", "hh", "mean", "rstd"))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_forward_shapes(k, n, dtype, is_rms):
    _run_forward("full", M, k, n, dtype, is_rms)


@pytest.mark.parametrize("n", [SINGLE_N, MULTI_N], ids=["single", "multi"])
@pytest.mark.parametrize("case", [c for c in FWD_CASES if c != "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_forward_variants(case, n, dtype, is_rms):
    single = gemm_config(M, n, 257, dtype, DEVICE, None)[4]
    assert single == (n == SINGLE_N)
    _run_forward(case, M, 257, n, dtype, is_rms)


@pytest.mark.parametrize("n", [SINGLE_N, MULTI_N], ids=["single", "multi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_layernorm_large_mean(n, dtype, m=M, k=257):
    """Rows of 1000 + N(0, ~2): the variance must come from deviations (two-pass / Chan), not
    E[h^2] - E[h]^2, and the multi-tile scratch must hold h - tile_mean (ulp(1000): fp16 0.5, bf16 4)."""
    a = (torch.randn(m, k, device=DEVICE) / math.sqrt(k)).to(dtype)
    b = _randn(n, k, dtype=dtype).t()
    residual = (1000.0 + torch.randn(m, n, device=DEVICE)).to(dtype)  # bf16 quantizes it to steps of 4
    weight, norm_bias = _randn(n), _randn(n)
    y, hh, mean, rstd = fwd_k.mm_norm_triton(a, b, None, residual, weight, norm_bias, EPS, False, None, True)

    h = a.double() @ b.double() + residual.double()
    var64, mean64 = torch.var_mean(h, dim=-1, unbiased=False)
    rstd64 = torch.rsqrt(var64 + EPS)
    hh64 = (h - mean64[:, None]) * rstd64[:, None]
    y64 = hh64 * weight.double() + norm_bias.double()
    # A one-pass fp32 E[h^2] - E[h]^2 is off by ~ulp(1e6) = 0.06 on var ~ 2 (3%). The kernel's h is fp32
    # (ulp(1000) = 6e-5, 4e-5 std per element; K=257 fp32 sums add ~1e-6): rstd good to ~1e-5.
    torch.testing.assert_close(rstd.double(), rstd64, atol=0.0, rtol=5e-5)
    # Any fp32 mean of values near 1000 is off by ~u32 * 1000 * (sequential run length of the sum): a GPU
    # row sum adds up to ~32-64 values per thread in order, ~4e-4 seen in a simulation. Allow 1e-3 (1e-6 rel).
    torch.testing.assert_close(mean.double(), mean64, atol=1e-3, rtol=0.0)
    # hh = (h - mean) * rstd inherits that plus h's own fp32 rounding (3e-5), times rstd ~ 0.7: <= ~1e-3;
    # y multiplies it by |w| <= ~5; 16-bit outputs add their rounding (TOL).
    for out, ref, name, scale in ((hh, hh64, "hh", 1.0), (y, y64, "y", 5.0)):
        assert torch.isfinite(out).all(), name
        atol = 1e-3 * scale + (TOL[dtype]["atol"] if dtype != F32 else 0.0)
        rtol = TOL[dtype]["rtol"] if dtype != F32 else 1e-5
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("n", [256, MULTI_N], ids=["single", "multi"])
def test_forward_fp32_follows_tf32_flag(n, m=M, k=512):
    """With torch's TF32 flag on, fp32 GEMMs may use TF32 (10-bit mantissa): errors ~1e-3 of |h|; the test
    also checks they are there, i.e. the flag reached the kernel (ieee gives <~5e-5, see TOL[F32])."""
    _set_tf32(True)
    a = torch.randn(m, k, device=DEVICE) / math.sqrt(k)
    b = torch.randn(n, k, device=DEVICE).t()
    weight, norm_bias = _randn(n), _randn(n)
    y, _, _, _ = fwd_k.mm_norm_triton(a, b, None, None, weight, norm_bias, EPS, False, None, False)
    h = a.double() @ b.double()
    var64, mean64 = torch.var_mean(h, dim=-1, unbiased=False)
    y64 = (h - mean64[:, None]) * torch.rsqrt(var64 + EPS)[:, None] * weight.double() + norm_bias.double()
    err = (y.double() - y64).abs().max().item()
    # TF32 input rounding 2^-11 relative: h errors ~7e-4 rms, ~4e-3 max over 8M elements, times |w| <= ~5.
    assert err < 3e-2, err
    assert err > 2e-4, f"max error {err}: looks like ieee fp32, the TF32 flag did not reach the kernel"


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bwd:
    extra: Optional[str]  # None, "same" (dy's dtype) or "f32"
    weight: bool
    has_bias: bool
    src_is_normed: bool
    src: str  # "same" or "f32"
    dx: str  # "same" or "f32"
    b_t: bool
    col_major: bool = False  # dy and src column-major


BWD_CASES = {
    "full": Bwd("same", True, True, False, "same", "same", b_t=False),
    "bare": Bwd(None, False, False, True, "same", "same", b_t=True),
    # 16-bit: dn's unfused dtype fp32 != dx dtype: the multi-tile scratch is a separate fp32 buffer.
    "mixed": Bwd("f32", True, True, False, "f32", "same", b_t=False, col_major=True),
    # dx fp32: the multi-tile scratch is dx.
    "dx_f32": Bwd("same", False, True, True, "same", "f32", b_t=True),
}


def _bwd_args(c: Bwd, m, k, n, dtype, is_rms):
    dy = (torch.randn(m, k, device=DEVICE) / math.sqrt(k)).to(dtype)  # dn = dy @ b ~ N(0, 1)
    dy = _col_major(dy) if c.col_major else dy
    # b is usually the next linear's weight [out, in] = [K, N], contiguous; b_t gives the transposed layout.
    b = _randn(n, k, dtype=dtype).t() if c.b_t else _randn(k, n, dtype=dtype)
    extra = _randn(m, n, dtype=dtype if c.extra == "same" else F32) if c.extra else None
    src_dtype = dtype if c.src == "same" else F32
    x = (torch.randn(m, n, device=DEVICE) * 2 + 0.5).to(src_dtype)  # the norm's input; rstd ~ 0.5
    hh, mean, rstd = norm_reference(x, None, None, EPS, is_rms)
    src = hh if c.src_is_normed else x
    src = _col_major(src) if c.col_major else src
    weight = _randn(n) if c.weight else None
    dx_dtype = F32 if c.dx == "f32" else dtype
    return (dy, b, extra, src, weight, mean, rstd, is_rms, c.src_is_normed, c.has_bias, dx_dtype)


def _run_backward(case, m, k, n, dtype, is_rms):
    args = _bwd_args(BWD_CASES[case], m, k, n, dtype, is_rms)
    dx, dw, db = bwd_k.mm_norm_backward_triton(*args)
    rdx, rdw, rdb = mm_norm_backward_reference(*args)
    _check([dx], [rdx], ["dx"])
    _check_colsum(dw, rdw, "dw")
    _check_colsum(db, rdb, "db")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_backward_shapes(k, n, dtype, is_rms):
    _run_backward("full", M, k, n, dtype, is_rms)


@pytest.mark.parametrize("n", [SINGLE_N, MULTI_N], ids=["single", "multi"])
@pytest.mark.parametrize("case", [c for c in BWD_CASES if c != "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_backward_variants(case, n, dtype, is_rms):
    _run_backward(case, M, 257, n, dtype, is_rms)


@pytest.mark.parametrize("n", [SINGLE_N, MULTI_N], ids=["single", "multi"])
def test_backward_deterministic(n, m=M, k=512):
    """dw/db come from per-M-tile partials summed in a fixed order (no atomics): bitwise reproducible."""
    args = _bwd_args(BWD_CASES["full"], m, k, n, BF16, False)
    first = bwd_k.mm_norm_backward_triton(*args)
    second = bwd_k.mm_norm_backward_triton(*args)
    for x, y, name in zip(first, second, ("dx", "dw", "db")):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("n", [256, MULTI_N], ids=["single", "multi"])
def test_backward_fp32_follows_tf32_flag(n, m=M, k=512):
    """TF32 on: dx within TF32 accuracy of the fp64 truth (dn errors ~1e-3 of |dn|, times |w| * rstd)."""
    _set_tf32(True)
    args = _bwd_args(BWD_CASES["full"], m, k, n, F32, False)
    dx, dw, db = bwd_k.mm_norm_backward_triton(*args)
    _set_tf32(False)  # the reference's own fp32 GEMM must not use TF32: it stands in for the exact result
    rdx, rdw, rdb = mm_norm_backward_reference(*args)
    # dn errors ~1e-3 of |dn| (~4e-3 max over 8M elements), times |w| <= ~5 and rstd ~ 0.5.
    torch.testing.assert_close(dx, rdx, atol=3e-2, rtol=1e-2)
    # Column sums over M rows: the per-row TF32 errors are independent, ~sqrt(M) * 1e-3 on sums ~sqrt(M).
    for out, ref, name in ((dw, rdw, "dw"), (db, rdb, "db")):
        torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


# ----------------------------------------------------------------------------------------------------------
# The custom ops' CUDA registrations reach the launchers
# ----------------------------------------------------------------------------------------------------------


def test_ops_dispatch_to_kernels():
    args = _fwd_args(FWD_CASES["full"], M, 257, MULTI_N, BF16, False)
    via_op = torch.ops.fusenorm.mm_norm(*args)
    direct = fwd_k.mm_norm_triton(*args)
    for x, y in zip(via_op, direct):
        assert torch.equal(x, y)
    bargs = _bwd_args(BWD_CASES["full"], M, 257, MULTI_N, BF16, False)
    via_op = torch.ops.fusenorm.mm_norm_backward(*bargs)
    direct = bwd_k.mm_norm_backward_triton(*bargs)
    for x, y in zip(via_op, direct):
        assert torch.equal(x, y)
