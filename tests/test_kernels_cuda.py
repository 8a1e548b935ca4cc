"""The Triton kernels of mm_norm / mm_norm_backward on CUDA, against the references, at realistic sizes.

M = 4097 rows, K in {64, 257, 512}, N in {40, 128, 256, 300, 1024, 2048} (single-tile path up to 256,
multi-tile above), bf16/fp16/fp32, LayerNorm and RMSNorm, every optional input, non-contiguous operands,
|mean| >> std, fp32 with TF32 off (tight) and on (the kernels follow torch's TF32 flag), determinism of
dw/db, and the custom ops' CUDA registrations. Every buffer the launchers allocate is poisoned with NaN.

The same checks at small shapes run on the CPU under the Triton interpreter: test_kernels_interpreter.py;
the cases, inputs, references, checks and tolerances both files use are in kernel_cases.py.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.triton import common  # noqa: E402
from fusenorm_inductor.tuning import mm_norm as fwd_t, mm_norm_backward as bwd_t  # noqa: E402

from . import kernel_cases as kc  # noqa: E402  (imports the kernel modules)
from .kernel_cases import BF16, BWD_CASES, EPS, F16, F32, FWD_CASES, NORMS, bwd_k, fwd_k  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TARGET = kc.Target(torch.device("cuda"), kc.CUDA_TOL)
DTYPES = kc.parametrize_dtypes(BF16, F16, F32)
M = 4097
SINGLE_N, MULTI_N = 128, 2048  # one shape per path for the variant tests
PATHS = pytest.mark.parametrize("n", [SINGLE_N, MULTI_N], ids=["single", "multi"])
TF32_PATHS = pytest.mark.parametrize("n", [256, MULTI_N], ids=["single", "multi"])
# The "full" case at every shape; the other cases at one shape per path (K = 257).
SHAPE_GRID = kc.stack(
    pytest.mark.parametrize("n", (40, 128, 256, 300, 1024, 2048)),
    pytest.mark.parametrize("k", (64, 257, 512)),
    DTYPES,
    NORMS,
)


def _variant_grid(cases):
    return kc.stack(PATHS, pytest.mark.parametrize("case", [c for c in cases if c != "full"]), DTYPES, NORMS)


def _set_tf32(enabled: bool) -> None:
    # The legacy setter works whichever API was used before (reading allow_tf32 can raise in torch >= 2.9).
    torch.backends.cuda.matmul.allow_tf32 = enabled


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    """NaN-poisoned buffers, tuning's own configs, TF32 off (exact fp32 on both sides), a fixed seed."""
    kc.poison_and_seed(monkeypatch)
    kc.force_block_n(monkeypatch, None)
    matmul = torch.backends.cuda.matmul
    old = getattr(matmul, "fp32_precision", None)
    old_legacy = None
    if old is None:
        old_legacy = matmul.allow_tf32
    _set_tf32(False)
    yield
    if old is not None:
        matmul.fp32_precision = old
    else:
        matmul.allow_tf32 = old_legacy


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@SHAPE_GRID
def test_forward_shapes(k, n, dtype, is_rms):
    TARGET.run_forward(FWD_CASES["full"], M, k, n, dtype, is_rms)


@_variant_grid(FWD_CASES)
def test_forward_variants(case, n, dtype, is_rms):
    assert TARGET.single_tile(M, n, 257, dtype) == (n == SINGLE_N)
    TARGET.run_forward(FWD_CASES[case], M, 257, n, dtype, is_rms)


@PATHS
@DTYPES
def test_forward_layernorm_large_mean(n, dtype, m=M, k=257):
    """Rows of 1000 + N(0, ~2): two-pass / Chan variance, h - tile_mean in the multi-tile scratch."""
    TARGET.check_layernorm_large_mean(m, k, n, dtype, w_max=5.0)


@pytest.mark.parametrize("n", [40, 256])
@NORMS
def test_forward_tma_path(monkeypatch, n, is_rms, m=M, k=64):
    """Aligned 16-bit operands with a transposed weight take the TMA kernel on Hopper; it agrees with the
    pointer-load kernel to bf16 rounding, and keeps |mean| >> std accurate."""
    a = torch.randn(m, k, device="cuda", dtype=BF16)
    b = torch.randn(n, k, device="cuda", dtype=BF16).t()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    assert common.tma_layout(a, b) == "nk"
    args = (a, b, None, None, None, None, EPS, is_rms, None, False)
    y_tma = kc.mm_norm_tuned(*args)[0].float()
    monkeypatch.setattr(common, "_FORCE_TMA", False)
    y_ptr = kc.mm_norm_tuned(*args)[0].float()
    torch.testing.assert_close(y_tma, y_ptr, **kc.CUDA_TOL[BF16])
    monkeypatch.setattr(common, "_FORCE_TMA", None)
    TARGET.check_layernorm_large_mean(m, k, n, BF16, w_max=5.0)


@TF32_PATHS
def test_forward_fp32_follows_tf32_flag(n, m=M, k=512):
    """With torch's TF32 flag on, fp32 GEMMs may use TF32 (10-bit mantissa): errors ~1e-3 of |h|; the test
    also checks they are there, i.e. the flag reached the kernel (ieee gives <~5e-5, see CUDA_TOL[F32])."""
    _set_tf32(True)
    a = TARGET.randn_scaled(m, k, F32)
    b = TARGET.randn(n, k).t()
    weight, norm_bias = TARGET.randn(n), TARGET.randn(n)
    y, _, _, _ = kc.mm_norm_tuned(a, b, None, None, weight, norm_bias, EPS, False, None, False)
    _, _, _, y64 = kc.layernorm_reference64(a.double() @ b.double(), weight, norm_bias)
    err = (y.double() - y64).abs().max().item()
    # TF32 input rounding 2^-11 relative: h errors ~7e-4 rms, ~4e-3 max over 8M elements, times |w| <= ~5.
    assert err < 3e-2, err
    assert err > 2e-4, f"max error {err}: looks like ieee fp32, the TF32 flag did not reach the kernel"


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@SHAPE_GRID
def test_backward_shapes(k, n, dtype, is_rms):
    TARGET.run_backward(BWD_CASES["full"], M, k, n, dtype, is_rms)


@_variant_grid(BWD_CASES)
def test_backward_variants(case, n, dtype, is_rms):
    TARGET.run_backward(BWD_CASES[case], M, 257, n, dtype, is_rms)


@PATHS
def test_backward_deterministic(n, m=M, k=512):
    """dw/db come from per-M-tile partials summed in a fixed order (no atomics): bitwise reproducible."""
    args = TARGET.bwd_args(BWD_CASES["full"], m, k, n, BF16, False)
    first = kc.mm_norm_backward_tuned(*args)
    second = kc.mm_norm_backward_tuned(*args)
    for x, y, name in zip(first, second, ("dx", "dw", "db")):
        assert torch.equal(x, y), name


@TF32_PATHS
def test_backward_fp32_follows_tf32_flag(n, m=M, k=512):
    """TF32 on: dx within TF32 accuracy of the fp64 truth (dn errors ~1e-3 of |dn|, times |w| * rstd)."""
    _set_tf32(True)
    args = TARGET.bwd_args(BWD_CASES["full"], m, k, n, F32, False)
    dx, dw, db = kc.mm_norm_backward_tuned(*args)
    _set_tf32(False)  # the reference's own fp32 GEMM must not use TF32: it stands in for the exact result
    rdx, rdw, rdb = kc.mm_norm_backward_reference(*args)
    # dn errors ~1e-3 of |dn| (~4e-3 max over 8M elements), times |w| <= ~5 and rstd ~ 0.5.
    torch.testing.assert_close(dx, rdx, atol=3e-2, rtol=1e-2)
    # Column sums over M rows: the per-row TF32 errors are independent, ~sqrt(M) * 1e-3 on sums ~sqrt(M).
    for out, ref, name in ((dw, rdw, "dw"), (db, rdb, "db")):
        torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


# ----------------------------------------------------------------------------------------------------------
# The custom ops' CUDA registrations reach the launchers
# ----------------------------------------------------------------------------------------------------------


def test_ops_dispatch_to_kernels():
    args = TARGET.fwd_args(FWD_CASES["full"], M, 257, MULTI_N, BF16, False)
    via_op = torch.ops.fusenorm.mm_norm(*args)
    direct = kc.mm_norm_tuned(*args)
    for x, y in zip(via_op, direct):
        assert torch.equal(x, y)
    bargs = TARGET.bwd_args(BWD_CASES["full"], M, 257, MULTI_N, BF16, False)
    via_op = torch.ops.fusenorm.mm_norm_backward(*bargs)
    direct = kc.mm_norm_backward_tuned(*bargs)
    for x, y in zip(via_op, direct):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------------------------------------
# Every configuration the tuner may pick (Hopper TMA kernels: row and cooperative)
# ----------------------------------------------------------------------------------------------------------

# (m, k, n): one row tile, two and eight N tiles, N not a multiple of the tile, K not a multiple of BLOCK_K.
CANDIDATE_SHAPES = [(4097, 64, 40), (4097, 256, 256), (3001, 520, 512), (3001, 256, 1000), (4097, 1024, 2048)]
_IDS = dict(ids=lambda s: "x".join(map(str, s)))


def _needs_hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")


@pytest.mark.parametrize("mkn", CANDIDATE_SHAPES, **_IDS)
@pytest.mark.parametrize("case", ["full", "bare", "no_save", "out_f32"])
@NORMS
def test_forward_every_candidate(mkn, case, is_rms):
    _needs_hopper()
    args = TARGET.fwd_args(FWD_CASES[case], *mkn, BF16, is_rms)
    out_bytes = fwd_t.forward_out_bytes(args[0], args[3], args[8], args[9])  # fp32 y/hh: fewer stages
    cands = fwd_t.forward_candidates(args[0], args[1], mkn[2], out_bytes)
    assert all(c.kind in ("row", "coop", "spin") for c in cands), cands
    ref = kc.mm_norm_reference(*args)
    for c in cands:
        TARGET.check(fwd_k.mm_norm_triton(*args, config=c), ref, kc.FWD_NAMES)


@pytest.mark.parametrize("mkn", CANDIDATE_SHAPES, **_IDS)
@pytest.mark.parametrize("case", ["full", "bare", "dx_f32"])
@NORMS
def test_backward_every_candidate(mkn, case, is_rms):
    _needs_hopper()
    args = TARGET.bwd_args(BWD_CASES[case], *mkn, BF16, is_rms)
    cands = bwd_t.backward_candidates(args[0], args[1], mkn[2], 4 if args[10] == F32 else 2)
    assert all(c.kind in ("row", "coop", "spin") for c in cands), cands
    rdx, rdw, rdb = kc.mm_norm_backward_reference(*args)
    for c in cands:
        dx, dw, db = bwd_k.mm_norm_backward_triton(*args, config=c)
        TARGET.check([dx], [rdx], [f"dx {c.label()}"])
        TARGET.check_colsum(dw, rdw, f"dw {c.label()}")
        TARGET.check_colsum(db, rdb, f"db {c.label()}")


@pytest.mark.parametrize("n", [256, 2048])
def test_layernorm_large_mean_every_candidate(monkeypatch, n):
    """|mean| >> std through each forward configuration (row: two-pass in registers; coop: centred scratch
    and Chan combine across programs)."""
    _needs_hopper()
    a = torch.randn(64, 64, device="cuda", dtype=BF16)
    for c in fwd_t.forward_candidates(a, torch.randn(n, 64, device="cuda", dtype=BF16).t(), n):
        monkeypatch.setattr(fwd_t, "forward_candidates", lambda *args, c=c: [c])
        TARGET.check_layernorm_large_mean(M, 256, n, BF16, w_max=5.0)


@pytest.mark.parametrize("mkn", [(4097, 256, 256), (3001, 256, 1000)], **_IDS)
def test_gemm_only(mkn):
    """The benchmark's GEMM-base mode: the fused kernels with the norm switched off give a @ b (+ bias)."""
    _needs_hopper()
    m, k, n = mkn
    a = TARGET.randn_scaled(m, k, BF16)
    w = TARGET.randn(n, k, dtype=BF16)
    bias = TARGET.randn(n, dtype=BF16)
    ref = (a.float() @ w.float().t() + bias.float()).to(BF16)
    for c in fwd_t.forward_candidates(a, w.t(), n):
        y = fwd_k.mm_norm_triton(a, w.t(), bias, None, None, None, EPS, False, None, False, config=c, gemm_only=True)[0]
        torch.testing.assert_close(y, ref, **kc.CUDA_TOL[BF16])
    dz = TARGET.randn_scaled(m, k, BF16)
    w2 = TARGET.randn(k, n, dtype=BF16)
    src = TARGET.randn(m, n, dtype=BF16)
    rstd = torch.ones(m, device="cuda")
    for c in bwd_t.backward_candidates(dz, w2, n):
        dx = bwd_k.mm_norm_backward_triton(
            dz, w2, None, src, None, None, rstd, True, True, False, BF16, config=c, gemm_only=True
        )[0]
        torch.testing.assert_close(dx, (dz.float() @ w2.float()).to(BF16), **kc.CUDA_TOL[BF16])
