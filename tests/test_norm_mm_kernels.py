"""The Triton kernels of ``fusenorm::norm_mm`` (Lazy Pre-Norm: ``c = norm(a) @ b + bias``) against an oracle.

Interpreter tests (CPU, Triton interpreter, fp32/fp16; skipped when CUDA is present): the pointer kernel and
the TMA kernel (forced onto CPU tensors with ``common._FORCE_TMA``) for LayerNorm and RMSNorm, affine
off / weight / weight + norm_bias, bias on/off, b = W.t() and a row-major [K, N] b, odd shapes (M = 257, 33,
3; K = 40, 72, 24; N = 24, 130, 40), non-contiguous operands, out_dtype fp32, every TMA candidate, rows of
1000 + N(0, 1) (against an fp64 oracle), M == 0, N == 0, K == 0.
CUDA tests (skipped without CUDA): bf16/fp16 at M = 4097, K in {64, 256}, N in {40, 256, 384}, both kernels,
both norms, affine on/off; |mean| >> std; fp32 (pointer kernel, TF32 off).

The launcher runs the configuration the op's CUDA path gives it (``norm_mm_tuned``: tuning's choice, which
without measuring is the first candidate), or one forced by the test. Every output the launcher allocates is
NaN-poisoned, so an element no program writes fails the finiteness
check. The oracle is the op's semantics computed in fp32 (fp64 for |mean| >> std and on CUDA); tolerances are
per element, in units of the dtypes' roundoff times the magnitudes that carry each rounding (``bounds``).
bf16 arithmetic is broken in the Triton 3.6 interpreter (docs/platform.md): bf16 runs only on CUDA.
"""

import importlib
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    # Triton reads the switch when a kernel is decorated: set it before the kernel modules are imported, and
    # reload any imported without it (conftest.py normally sets it first).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("fusenorm_inductor.kernels.triton.common", "fusenorm_inductor.kernels.triton.norm_mm"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
pytest.importorskip("triton")

from fusenorm_inductor.kernels.triton import common  # noqa: E402
from fusenorm_inductor.kernels.triton import norm_mm as nk  # noqa: E402
from fusenorm_inductor.tuning import norm_mm as tuning  # noqa: E402

op = importlib.import_module("fusenorm_inductor.ops.norm_mm")  # the module, not the op it exports

from .kernel_cases import (  # noqa: E402
    BF16, EPS, F16, F32, NORMS, Recording, nan_alloc, parametrize_dtypes, unit_roundoff,
)

INTERPRETER = pytest.mark.skipif(
    CUDA, reason="CUDA is available: the CUDA tests cover the kernels (no interpreter in a GPU session)"
)
ON_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# The interpreter's `range(0, K, ...)` with a runtime K goes through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

U32 = 2.0**-24
AFFINES = {"none": (False, False), "w": (True, False), "w_nb": (True, True)}
AFFINE = pytest.mark.parametrize("affine", list(AFFINES))
BIAS = pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
B_LAYOUT = pytest.mark.parametrize("b_t", [True, False], ids=["Wt", "KN"])
SHAPES = pytest.mark.parametrize(
    "mkn", [(257, 40, 24), (33, 72, 130), (3, 24, 40)], ids=lambda s: "x".join(map(str, s))
)


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    """NaN-filled outputs (an unwritten element shows), the launcher's own TMA rule, a fixed seed."""
    monkeypatch.setattr(nk, "_alloc", nan_alloc)
    monkeypatch.setattr(common, "_FORCE_TMA", None)
    torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------------------
# Oracle, error bounds, checks
# ----------------------------------------------------------------------------------------------------------


def oracle(a, b, bias, weight, norm_bias, eps, is_rms, acc=F32):
    """The op's semantics in ``acc`` (fp32 as the op's reference, fp64 for a sharper one): (c unrounded,
    mean ([M], 0-size for RMSNorm), rstd)."""
    x = a.to(acc)
    if is_rms:
        mean = x.new_zeros((0,))
        rstd = torch.rsqrt((x * x).mean(1) + eps)
        y = x * rstd[:, None]
    else:
        mean = x.mean(1)
        var = ((x - mean[:, None]) ** 2).mean(1)
        rstd = torch.rsqrt(var + eps)
        y = (x - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.to(acc)
    if norm_bias is not None:
        y = y + norm_bias.to(acc)
    c = y @ b.to(acc)
    if bias is not None:
        c = c + bias.to(acc)
    return c, mean, rstd


def bounds(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype):
    """Per-element bounds on |kernel - oracle| for (c, mean, rstd), from fp64 magnitudes:

    - b' = w * b rounded to a's dtype (u_in per element; none without a weight): u_in * (|hat| @ |b'|), hat
      the normalized rows before the affine;
    - fp32 sums of K terms, in the kernel (acc, colsum, bias', row sums) and in an fp32 oracle, modelled as
      g = 2 (sqrt(K) + 2) u32 relative to the sum of the terms' magnitudes (random-walk growth plus a few
      single roundings such as rsqrt; measured on the CPU: <= 0.2 of it). For LayerNorm the kernel's acc and
      mean * colsum are ~|mean| * sum|b'| each (the rank-1 correction cancels), so that magnitude enters,
      times rstd;
    - statistics: mean to 2 u32 |mean| + g * 2 max|a - mean| (one rounding of p + s1 / K; the pivot-shifted
      sum carries |a - p| <= 2 max|a - mean|); rstd relatively to g * (var + (p - mean)^2 + eps) / (var +
      eps): the shifted sum of squares is ~var + (p - mean)^2, whose rounding the subtraction of (mean - p)^2
      leaves behind; both propagate to c (mean through rstd * |colsum|, rstd through |hat| @ |b'|);
    - the two final roundings of c (kernel and oracle): u_out (|c| + |c'|) <= 2.5 u_out |c|, plus a subnormal
      floor.
    """
    k = a.shape[1]
    g = 2 * (math.sqrt(k) + 2) * U32
    u_in, u_out = unit_roundoff(a.dtype), unit_roundoff(out_dtype)
    x, bd = a.double(), b.double()
    bp = bd * weight.double()[:, None] if weight is not None else bd
    c, mean, rstd = oracle(a, b, bias, weight, norm_bias, eps, is_rms, acc=torch.float64)
    if is_rms:
        hat = x * rstd[:, None]
        rstd_rtol = torch.full_like(rstd, g)
        mean_tol = mean
        stats = rstd_rtol[:, None] * (hat.abs() @ bp.abs())
        acc_mag = rstd[:, None] * (x.abs() @ bp.abs())
    else:
        dev = x - mean[:, None]
        var = (dev * dev).mean(1)
        hat = dev * rstd[:, None]
        rstd_rtol = g * (var + (x[:, 0] - mean) ** 2 + eps) / (var + eps)
        mean_tol = 2 * U32 * mean.abs() + 2 * g * dev.abs().amax(1)
        colsum_mag = bp.abs().sum(0)
        stats = rstd_rtol[:, None] * (hat.abs() @ bp.abs()) + (mean_tol * rstd)[:, None] * bp.sum(0).abs()[None, :]
        acc_mag = rstd[:, None] * (x.abs() @ bp.abs() + mean.abs()[:, None] * colsum_mag[None, :])
    fold = u_in * (hat.abs() @ bp.abs()) if weight is not None else 0.0
    y = hat * weight.double() if weight is not None else hat
    y = y + norm_bias.double() if norm_bias is not None else y
    bias_mag = (norm_bias.double().abs() @ bd.abs()) if norm_bias is not None else 0.0
    bias_mag = bias_mag + (bias.double().abs() if bias is not None else 0.0)
    arith = g * (acc_mag + bias_mag + y.abs() @ bd.abs())
    final = 2.5 * u_out * c.abs() + 4 * torch.finfo(out_dtype).smallest_normal
    return fold + arith + stats + final, mean_tol, rstd_rtol * rstd


def assert_within(out, ref, tol, name):
    """|out - ref| <= tol elementwise (fp64), with the worst element in the message."""
    assert out.shape == ref.shape, (name, tuple(out.shape), tuple(ref.shape))
    if out.numel() == 0:
        return
    err = (out.double() - ref.double()).abs()
    ratio = err / tol
    worst = int(ratio.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ratio.shape))
    assert bool((err <= tol).all()), (
        f"{name}: {int((err > tol).sum())} of {err.numel()} elements out of bounds; worst at {idx}: "
        f"got {out.flatten()[worst].item()}, expected {ref.flatten()[worst].item()}, "
        f"|diff| {err.flatten()[worst].item():.3g} > tol {tol.flatten()[worst].item():.3g}"
    )


def check(args, outs, oracle_dtype=F32):
    """(c, mean, rstd) of the kernels against the oracle, every output finite, shapes and dtypes exact."""
    a, b, bias, weight, norm_bias, eps, is_rms, out_dtype = args
    out_dtype = out_dtype or a.dtype
    c, mean, rstd = outs
    rc, rmean, rrstd = oracle(a, b, bias, weight, norm_bias, eps, is_rms, acc=oracle_dtype)
    m, n = a.shape[0], b.shape[1]
    assert c.shape == (m, n) and c.dtype == out_dtype and c.device == a.device
    assert mean.shape == ((0,) if is_rms else (m,)) and mean.dtype == F32
    assert rstd.shape == (m,) and rstd.dtype == F32
    for t, name in ((c, "c"), (mean, "mean"), (rstd, "rstd")):
        assert bool(torch.isfinite(t).all()), f"{name}: unwritten (NaN-poisoned) or non-finite elements"
    c_tol, mean_tol, rstd_tol = bounds(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)
    assert_within(c, rc.to(out_dtype), c_tol, "c")
    assert_within(rstd, rrstd, rstd_tol, "rstd")
    if not is_rms:
        assert_within(mean, rmean, mean_tol, "mean")
    return c_tol, rstd_tol


def make_args(m, k, n, dtype, is_rms, affine="w_nb", has_bias=True, b_t=True, device="cpu", out_dtype=None):
    """Rows of N(0.5, 2) (a mean for LayerNorm to remove), b ~ N(0, 1/K) so that c ~ N(0, |w|^2 + ...);
    b = W.t() of an [N, K] weight (b_t) or a row-major [K, N]; the norm's parameters in the model's dtype."""
    a = (torch.randn(m, k, device=device) * 2 + 0.5).to(dtype)
    b = torch.randn(n, k, device=device).t() if b_t else torch.randn(k, n, device=device)
    b = (b / math.sqrt(k)).to(dtype)
    has_w, has_nb = AFFINES[affine]
    weight = torch.randn(k, device=device).to(dtype) if has_w else None
    norm_bias = torch.randn(k, device=device).to(dtype) if has_nb else None
    bias = torch.randn(n, device=device).to(dtype) if has_bias else None
    return (a, b, bias, weight, norm_bias, EPS, is_rms, out_dtype)


def large_mean_args(m, k, n, dtype, spread=1.0, device="cpu"):
    """LayerNorm of rows of 1000 + spread * N(0, 1): |mean| / std ~ 1000 / spread."""
    a = (1000.0 + spread * torch.randn(m, k, device=device)).to(dtype)
    b = (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype).t()
    weight, norm_bias = torch.randn(k, device=device).to(dtype), torch.randn(k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    return (a, b, bias, weight, norm_bias, EPS, False, None)


def check_large_mean(args):
    """Against an fp64 oracle; the rstd bound must be tight enough that a plain one-pass E[a^2] - E[a]^2
    in fp32 would break it (the test can tell the shifted sums from the naive ones)."""
    c_tol, rstd_tol = check(args, op.norm_mm_tuned(*args), oracle_dtype=torch.float64)
    a, eps = args[0], args[5]
    x = a.float()
    naive = torch.rsqrt(((x * x).mean(1) - x.mean(1) ** 2).clamp_min(0) + eps)
    _, _, rstd64 = oracle(*args[:7], acc=torch.float64)
    assert bool(((naive.double() - rstd64).abs() > rstd_tol).any()), "the rstd bound cannot see cancellation"
    return c_tol


def record_kernels(monkeypatch, tma=None):
    """(pointer, tma) recorders; ``tma`` True forbids the pointer kernel, False the TMA kernel."""
    ptr = Recording(nk._norm_mm_fwd_kernel, forbidden=tma is True)
    tmak = Recording(nk._norm_mm_fwd_tma_kernel, "C_TMA", forbidden=tma is False)
    monkeypatch.setattr(nk, "_norm_mm_fwd_kernel", ptr)
    monkeypatch.setattr(nk, "_norm_mm_fwd_tma_kernel", tmak)
    return ptr, tmak


def run(args):
    outs = op.norm_mm_tuned(*args)
    check(args, outs)
    return outs


# ----------------------------------------------------------------------------------------------------------
# Interpreter: the pointer kernel
# ----------------------------------------------------------------------------------------------------------


@INTERPRETER
@SHAPES
@B_LAYOUT
@BIAS
@AFFINE
@NORMS
@parametrize_dtypes(F32, F16)
def test_pointer_kernel(monkeypatch, dtype, is_rms, affine, has_bias, b_t, mkn):
    """M not a multiple of the row tile, K not of BLOCK_K (padded columns must not enter the statistics),
    N = 130: two N tiles, the second of two columns (mean/rstd stored by the first only)."""
    ptr, _ = record_kernels(monkeypatch, tma=False)
    run(make_args(*mkn, dtype, is_rms, affine, has_bias, b_t))
    assert ptr.values


@INTERPRETER
@NORMS
@parametrize_dtypes(F32, F16)
def test_pointer_kernel_noncontiguous(monkeypatch, dtype, is_rms):
    """Any strides: a column-major (K = 17), b a strided view, bias a strided view."""
    m, k, n = 33, 17, 40
    a, _, _, weight, norm_bias, eps, _, _ = make_args(m, k, n, dtype, is_rms)
    a = a.t().contiguous().t()
    b = (torch.randn(k, 2 * n) / math.sqrt(k)).to(dtype)[:, ::2]
    bias = torch.randn(2 * n).to(dtype)[::2]
    record_kernels(monkeypatch, tma=False)
    run((a, b, bias, weight, norm_bias, eps, is_rms, None))


@INTERPRETER
@NORMS
@parametrize_dtypes(F32, F16)
def test_pointer_kernel_out_f32(dtype, is_rms):
    run(make_args(33, 72, 130, dtype, is_rms, out_dtype=F32))


# ----------------------------------------------------------------------------------------------------------
# Interpreter: the TMA kernel, forced onto CPU tensors
# ----------------------------------------------------------------------------------------------------------


@INTERPRETER
@SHAPES
@B_LAYOUT
@BIAS
@AFFINE
@NORMS
def test_tma_kernel(monkeypatch, is_rms, affine, has_bias, b_t, mkn):
    """The persistent TMA kernel (4 programs here, so a program walks several tiles; TMA zero-fills out of
    bounds) in fp16. c leaves through a TMA store when its row pitch is a multiple of 16 bytes (N = 130: not).
    A row-major [K, N] b whose row pitch TMA cannot read (N = 130) takes the pointer kernel."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    args = make_args(*mkn, F16, is_rms, affine, has_bias, b_t)
    expect_tma = common.tma_layout(args[0], args[1]) is not None
    assert expect_tma == (b_t or mkn[2] % 8 == 0)
    ptr, tmak = record_kernels(monkeypatch, tma=expect_tma)
    run(args)
    if expect_tma:
        assert tmak.values == [mkn[2] % 8 == 0]
    else:
        assert ptr.values and not tmak.values


@INTERPRETER
@pytest.mark.parametrize("out_dtype", [None, F32], ids=["out_f16", "out_f32"])
@NORMS
def test_tma_kernel_every_candidate(monkeypatch, is_rms, out_dtype):
    """Each TMA configuration tuning may pick (128 x 128 and 128 x 256 tiles here; with an fp32 c the wide
    tile shrinks to fit shared memory), N = 300: a partial last tile either way."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    args = make_args(130, 40, 300, F16, is_rms, out_dtype=out_dtype)
    cands = tuning.prenorm_candidates(args[0], args[1], out_dtype or F16)
    assert {c.kind for c in cands} == {"tma"} and {c.block_n for c in cands} == {128, 256}, cands
    record_kernels(monkeypatch, tma=True)
    for config in cands:
        outs = nk.norm_mm_triton(*args, config=config)
        check(args, outs)


# The TMA kernel's two walks over the tiles and two forms of the row sums (kernels/triton/norm_mm.py's docstring).
WALKS = pytest.mark.parametrize(
    "kind, tile_sums",
    [("tma", False), ("tma", True), ("tma_rows", False), ("tma_rows", True)],
    ids=["flat-reduce", "flat-tilesums", "rows-reduce", "rows-tilesums"],
)


def run_walk(monkeypatch, args, kind, tile_sums, block_n):
    """norm_mm_triton with one forced TMA configuration and form of the row sums."""
    monkeypatch.setattr(nk, "TILE_SUMS_OVERRIDE", tile_sums)
    out_dtype = args[7] or args[0].dtype
    config = common.tma_config(kind, tuning.TMA_BLOCK_M, block_n, tuning.TMA_BLOCK_K, tuning.TMA_STAGES,
                               tuning.TMA_WARPS, out_dtype.itemsize)
    return nk.norm_mm_triton(*args, config=config)


@INTERPRETER
@WALKS
@pytest.mark.parametrize("k", [72, 128], ids=["k72-padded", "k128-even"])
@NORMS
def test_tma_walks_and_row_sums(monkeypatch, is_rms, k, kind, tile_sums):
    """M = 600 (5 row blocks over the interpreter's 4 programs: one program takes two, the last is partial),
    N = 300 in 128-wide tiles (3 per row block, the last partial): the row-block walk must carry its first
    tile's statistics to the other two; K = 72 pads its last K tile (masked row sums), K = 128 does not."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    record_kernels(monkeypatch, tma=True)
    args = make_args(600, k, 300, F16, is_rms)
    check(args, run_walk(monkeypatch, args, kind, tile_sums, 128))


@INTERPRETER
def test_candidates_row_block_walk_first(monkeypatch):
    """Enough row blocks to fill the SMs and N over several tiles: the row-block walk is timed first for each
    N tile that splits N; a single-tile N keeps the flattened walk only."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    a = torch.randn(1024, 64, dtype=F16)  # 8 row blocks >= the interpreter's 4 "SMs"
    kinds = [(c.kind, c.block_n) for c in tuning.prenorm_candidates(a, torch.randn(64, 304, dtype=F16), F16)]
    assert kinds == [("tma_rows", 128), ("tma", 128), ("tma_rows", 256), ("tma", 256)], kinds
    kinds = [(c.kind, c.block_n) for c in tuning.prenorm_candidates(a, torch.randn(64, 256, dtype=F16), F16)]
    assert kinds == [("tma", 256), ("tma_rows", 128), ("tma", 128)], kinds
    few_rows = torch.randn(256, 64, dtype=F16)  # 2 row blocks: the row-block walk would leave SMs idle
    assert {c.kind for c in tuning.prenorm_candidates(few_rows, torch.randn(64, 304, dtype=F16), F16)} == {"tma"}


# ----------------------------------------------------------------------------------------------------------
# Interpreter: |mean| >> std, degenerate shapes, host folding
# ----------------------------------------------------------------------------------------------------------


@INTERPRETER
@pytest.mark.parametrize(
    "dtype, path", [(F32, "ptr"), (F16, "ptr"), (F16, "tma")], ids=["fp32-ptr", "fp16-ptr", "fp16-tma"]
)
def test_layernorm_large_mean(monkeypatch, dtype, path):
    """Rows of 1000 + N(0, 1) (fp16: ulp(1000) = 0.5, still resolved): mean, rstd and c stay accurate
    against an fp64 oracle; K = 72 spans K tiles with a padded last one."""
    monkeypatch.setattr(common, "_FORCE_TMA", path == "tma")
    record_kernels(monkeypatch, tma=path == "tma")
    c_tol = check_large_mean(large_mean_args(130, 72, 40, dtype))
    # The bound is an accuracy statement, not a formality: c ~ N(0, |w|^2) here.
    assert c_tol.max() < 0.05, c_tol.max()


@INTERPRETER
@NORMS
def test_empty_rows(monkeypatch, is_rms):
    """M == 0: empty outputs of the right shapes and dtypes, nothing launched."""
    monkeypatch.setattr(nk, "_norm_mm_fwd_kernel", Recording(None, forbidden=True))
    monkeypatch.setattr(nk, "_norm_mm_fwd_tma_kernel", Recording(None, forbidden=True))
    c, mean, rstd = op.norm_mm_tuned(*make_args(0, 40, 24, F32, is_rms))
    assert c.shape == (0, 24) and c.dtype == F32
    assert mean.shape == (0,) and rstd.shape == (0,) and mean.dtype == rstd.dtype == F32


@INTERPRETER
@NORMS
def test_empty_output_columns(monkeypatch, is_rms):
    """N == 0: c is [M, 0], but mean and rstd are still every row's (one N tile per row block runs)."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    run(make_args(33, 40, 0, F16, is_rms))


def test_k_zero_raises():
    with pytest.raises(ValueError, match="K == 0"):
        op.norm_mm_tuned(*make_args(4, 0, 8, F32, False))


@parametrize_dtypes(F32, F16)
def test_fold_norm_affine(dtype):
    """b' keeps b's strides (a transposed weight stays TMA-readable) and is w * b rounded once; colsum is the
    fp32 sum of the rounded b' (to fp32 summation error); bias' = bias + norm_bias @ b in fp32."""
    k, n = 40, 24
    b = torch.randn(n, k).to(dtype).t()
    weight, norm_bias, bias = torch.randn(k), torch.randn(k), torch.randn(n).to(dtype)
    b_fold, bias_fold, colsum = nk.fold_norm_affine(b, bias, weight, norm_bias, dtype, is_rms=False)
    assert b_fold.stride() == b.stride() and b_fold.dtype == dtype
    assert torch.equal(b_fold, (b.double() * weight.double()[:, None]).to(dtype))
    assert colsum.dtype == F32
    exact = b_fold.double().sum(0)
    assert_within(colsum, exact, k * U32 * b_fold.double().abs().sum(0), "colsum")
    ref = bias.double() + norm_bias.double() @ b.double()
    assert bias_fold.dtype == F32
    torch.testing.assert_close(bias_fold.double(), ref, atol=1e-5, rtol=1e-6)
    # Without the affine, nothing is copied; RMSNorm needs no colsum.
    b_same, bias_same, none = nk.fold_norm_affine(b, bias, None, None, dtype, is_rms=True)
    assert b_same is b and bias_same is bias and none is None


@INTERPRETER
def test_spilling_gluon_config_runs_tl_first_choice(monkeypatch):
    """A Gluon configuration whose specialization spills: the launcher raises ``SpillError`` (the Gluon kernel is
    never launched), and the op's path runs the tl kernels' first choice instead, with the right result."""
    from fusenorm_inductor.kernels.hopper import _compat

    if not _compat.available():
        pytest.skip(f"this triton has no usable Gluon ({_compat.GLUON_ERROR})")
    from fusenorm_inductor.kernels.hopper import common as hopper_common, norm_mm as hopper

    def spills(*args):
        raise hopper_common.SpillError("spills")

    monkeypatch.setattr(hopper, "norm_mm_gluon", spills)
    gl_config = common.GemmConfig("gl_coop", 128, 128, 64, 3, 8)
    monkeypatch.setattr(tuning, "prenorm_config", lambda *args: gl_config)
    args = make_args(33, 40, 24, F16, False)
    with pytest.raises(hopper_common.SpillError):
        nk.norm_mm_triton(*args, config=gl_config)
    ptr, _ = record_kernels(monkeypatch, tma=False)
    assert tuning.tl_candidates(args[0], args[1], F16)[0].kind == "ptr"
    run(args)
    assert ptr.values


@INTERPRETER
def test_outputs_come_from_alloc(monkeypatch):
    """The poisoning is only as good as the hook: every returned buffer must come from ``_alloc``."""
    made = []

    def recording_alloc(shape, dtype, device):
        made.append(nan_alloc(shape, dtype, device))
        return made[-1]

    monkeypatch.setattr(nk, "_alloc", recording_alloc)
    for t in op.norm_mm_tuned(*make_args(33, 40, 24, F32, False)):
        assert any(t is u for u in made)


# ----------------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------------

M_CUDA = 4097
PATHS = pytest.mark.parametrize("path", ["tma", "ptr"])


def _tma_available() -> bool:
    return CUDA and torch.cuda.get_device_capability()[0] >= 9


def _set_path(monkeypatch, path):
    """tma: the launcher's own rule (TMA on sm_90+); ptr: the pointer kernel (``_FORCE_TMA = False``)."""
    if path == "tma" and not _tma_available():
        pytest.skip("TMA needs sm_90+")
    # the tl kernels under test, not the Gluon kernel the dispatch puts first on sm_90 (test_gluon_norm_mm.py)
    monkeypatch.setattr(tuning, "gluon_unsupported", lambda *args: "off: the tl kernels' tests")
    monkeypatch.setattr(common, "_FORCE_TMA", None if path == "tma" else False)
    return record_kernels(monkeypatch, tma=path == "tma")


@ON_CUDA
@PATHS
@pytest.mark.parametrize("affine", ["on", "off"])
@pytest.mark.parametrize("n", [40, 256, 384])
@pytest.mark.parametrize("k", [64, 256])
@NORMS
@parametrize_dtypes(BF16, F16)
def test_cuda_matches_oracle(monkeypatch, dtype, is_rms, k, n, affine, path):
    """affine on: weight, norm_bias and bias, b = W.t(); off: none of them, a row-major [K, N] b."""
    _, tmak = _set_path(monkeypatch, path)
    on = affine == "on"
    args = make_args(M_CUDA, k, n, dtype, is_rms, "w_nb" if on else "none", on, b_t=on, device="cuda")
    check(args, op.norm_mm_tuned(*args), oracle_dtype=torch.float64)
    if path == "tma":
        assert tmak.values


@ON_CUDA
@PATHS
@pytest.mark.parametrize(
    "dtype, spread", [(BF16, 8.0), (F16, 1.0)], ids=["bf16-spread8", "fp16-spread1"]
)
def test_cuda_layernorm_large_mean(monkeypatch, dtype, spread, path):
    """Rows of 1000 + spread * N(0, 1). bf16 steps by 4 at 1000, so a spread of 1 would round most rows to
    constants (where rstd = rsqrt(eps) amplifies the rank-1 correction's fp32 cancellation: module docstring
    of kernels/triton/norm_mm.py); a spread of 8 keeps |mean| / std ~ 125 with resolved rows."""
    _set_path(monkeypatch, path)
    check_large_mean(large_mean_args(M_CUDA, 256, 384, dtype, spread, device="cuda"))


@ON_CUDA
@WALKS
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("k", [200, 256], ids=["k200-padded", "k256-even"])
@NORMS
def test_cuda_tma_walks_and_row_sums(monkeypatch, is_rms, k, block_n, kind, tile_sums):
    """Every walk and form of the row sums on the H200 (the compiled kernels, pipelined): M = 4097, N = 640
    (several N tiles, the last partial), affine on, bf16; plus rows of 1000 + 8 N(0, 1) for LayerNorm."""
    if not _tma_available():
        pytest.skip("TMA needs sm_90+")
    record_kernels(monkeypatch, tma=True)
    args = make_args(M_CUDA, k, 640, BF16, is_rms, "w_nb", True, b_t=True, device="cuda")
    check(args, run_walk(monkeypatch, args, kind, tile_sums, block_n), oracle_dtype=torch.float64)
    if not is_rms:
        args = large_mean_args(M_CUDA, k, 640, BF16, 8.0, device="cuda")
        outs = run_walk(monkeypatch, args, kind, tile_sums, block_n)
        check(args, outs, oracle_dtype=torch.float64)


@ON_CUDA
@pytest.mark.parametrize("n", [40, 384])
@pytest.mark.parametrize("k", [64, 256])
@NORMS
def test_cuda_fp32_pointer_kernel(monkeypatch, is_rms, k, n):
    """fp32 operands take the pointer kernel; with TF32 off its products are exact fp32 (ieee dot)."""
    monkeypatch.setattr(common, "_cuda_matmul_allows_tf32", lambda: False)
    record_kernels(monkeypatch, tma=False)
    args = make_args(M_CUDA, k, n, F32, is_rms, device="cuda")
    check(args, op.norm_mm_tuned(*args), oracle_dtype=torch.float64)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_normed_kernel(is_rms, affine):
    """mm_normed's rebuilt operand: y = norm(a) * w + nb from saved statistics, one rounding to a's dtype;
    odd sizes, a transposed (non-contiguous) a, NaN-poisoned output (the autouse fixture)."""
    dev = "cuda" if CUDA else "cpu"
    m, k = 67, 300
    a = (3.0 + torch.randn(k, m)).t().to(dev, F16)  # column-major: strides (1, m)
    af = a.double()
    mean = None if is_rms else af.mean(1).float()
    rstd = torch.rsqrt((af.pow(2).mean(1) if is_rms else af.var(1, unbiased=False)) + 1e-5).float()
    w = (1 + 0.3 * torch.randn(k)).to(dev) if affine else None
    nb = torch.randn(k).to(dev) if affine and not is_rms else None
    y = nk.normed_triton(a, mean, rstd, w, nb, is_rms)
    want = af if is_rms else af - mean.double()[:, None]
    want = want * rstd.double()[:, None]
    if w is not None:
        want = want * w.double()
    if nb is not None:
        want = want + nb.double()
    assert y.dtype == F16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", ["none", "w", "w_nb"])
@pytest.mark.parametrize("b_t", [True, False], ids=["Wt", "KN"])
def test_fold_one_launch(is_rms, affine, b_t):
    """The Gluon path's one-launch fold against fold_norm_affine: b' bit for bit (one rounding of w * b), b's
    strides kept; colsum and bias' (fp32 here whenever there is one) to fp32 summation order."""
    dev = "cuda" if CUDA else "cpu"
    dtype = BF16 if CUDA else F16
    a, b, bias, weight, norm_bias, _, _, _ = make_args(3, 200, 72, dtype, is_rms, affine, True, b_t, device=dev)
    bf, biasf, colsum = nk.fold_one_launch(b, bias, weight, norm_bias, is_rms)
    rb, rbias, rcolsum = nk.fold_norm_affine(b, bias, weight, norm_bias, dtype, is_rms)
    assert bf.stride() == b.stride() and bf.dtype == dtype
    torch.testing.assert_close(bf, rb, rtol=0, atol=0)
    assert biasf.dtype == F32
    torch.testing.assert_close(biasf, rbias.float(), rtol=1e-5, atol=1e-5)
    if is_rms:
        assert colsum is None
    else:
        torch.testing.assert_close(colsum, rcolsum, rtol=1e-5, atol=1e-5)
