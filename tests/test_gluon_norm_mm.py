"""The Gluon sm_90 pre-norm forward (kernels/hopper/norm_mm.py: row statistics from the GEMM core's A stages) on
the GPU, against the fp64 oracle and per-element bounds of test_norm_mm_kernels.py.

Every configuration the dispatch can pick runs at odd shapes (M = 257 and 4097, and 40001 for the row-block
schedule with several row blocks per program; K = 40 (BK 32, a ragged last
K tile), 200 (LayerNorm's masked tail), 1024; N = 40, 256, 1000, 3000: one or many N tiles, partial last
ones), LayerNorm and RMSNorm, with bias + weight + norm bias (b = W.t()) and without any (b row-major
[K, N]); LayerNorm at |mean| / std ~ 125 (bf16) and 1000 (fp16); the custom op and its cached launch plan;
inputs the TMA path cannot take fall back to the tl kernels with right results. Every buffer the launcher
allocates is NaN-poisoned. Needs an sm_90 GPU; the CPU suite compiles the same kernels (test_gluon_compile.py).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402

from .kernel_cases import BF16, F16, NORMS, nan_alloc  # noqa: E402
from .test_norm_mm_kernels import check, large_mean_args, make_args, nk, op, oracle, tuning  # noqa: E402

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (_SM90 and _compat.available()), reason="needs an sm_90 GPU and Gluon")


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    monkeypatch.setattr(nk, "_alloc", nan_alloc)
    torch.manual_seed(0)


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records the configuration of every Gluon launch."""
    from fusenorm_inductor import config
    from fusenorm_inductor.kernels.hopper import norm_mm as hopper

    calls = []
    real = hopper.norm_mm_gluon

    def spy(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(hopper, "norm_mm_gluon", spy)
    with config.patch(gluon=True):
        yield calls


def _gluon_candidates(args):
    return [c for c in tuning.prenorm_candidates(args[0], args[1], args[7] or args[0].dtype)
            if c.kind.startswith("gl_")]


@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("n", [40, 256, 1000, 3000])
@pytest.mark.parametrize("k", [40, 200, 1024])
@pytest.mark.parametrize("m", [257, 4097])
@NORMS
def test_every_candidate_matches_oracle(m, k, n, case, is_rms, gluon_calls):
    full = case == "full"
    args = make_args(m, k, n, BF16, is_rms, "w_nb" if full else "none", full, b_t=full, device="cuda")
    cands = _gluon_candidates(args)
    assert cands, tuning.gluon_unsupported(args[0], args[1], None)
    for cfg in cands:
        check(args, nk.norm_mm_triton(*args, config=cfg), oracle_dtype=torch.float64)
    assert gluon_calls == cands


@pytest.mark.parametrize("case", ["full", "bare"])
@NORMS
def test_row_block_schedule_keeps_statistics(case, is_rms, gluon_calls):
    """The row-block schedule ("gl_rows") with several row blocks per program (M = 40001: 313 row blocks over
    at most 132 programs, the last partial): the statistics summed at a row block's first N tile serve its
    other three (N = 1000), and are replaced at the next row block; K = 200 masks LayerNorm's last K tile."""
    full = case == "full"
    args = make_args(40001, 200, 1000, BF16, is_rms, "w_nb" if full else "none", full, b_t=full, device="cuda")
    rows = [c for c in _gluon_candidates(args) if c.kind == "gl_rows"]
    assert rows, _gluon_candidates(args)
    check(args, nk.norm_mm_triton(*args, config=rows[0]), oracle_dtype=torch.float64)
    assert gluon_calls == rows


@pytest.mark.parametrize("dtype, spread, k", [(BF16, 8.0, 256), (BF16, 8.0, 1000), (F16, 1.0, 512)])
def test_layernorm_large_mean(dtype, spread, k, gluon_calls):
    """Rows of 1000 + spread * N(0, 1) (test_norm_mm_kernels.test_cuda_layernorm_large_mean says why bf16 gets
    a spread of 8): the shifted sums keep rstd within a bound that a one-pass E[a^2] - E[a]^2 breaks."""
    args = large_mean_args(4097, k, 384, dtype, spread, device="cuda")
    cands = _gluon_candidates(args)
    for cfg in cands:
        _, rstd_tol = check(args, nk.norm_mm_triton(*args, config=cfg), oracle_dtype=torch.float64)
    x = args[0].float()
    naive = torch.rsqrt(((x * x).mean(1) - x.mean(1) ** 2).clamp_min(0) + args[5])
    _, _, rstd64 = oracle(*args[:7], acc=torch.float64)
    assert bool(((naive.double() - rstd64).abs() > rstd_tol).any()), "the rstd bound cannot see cancellation"
    assert gluon_calls == cands


def test_custom_op_and_cached_plan(gluon_calls):
    """torch.ops.fusenorm.norm_mm on CUDA takes the Gluon kernel and keeps its plan: a second call with new
    inputs of the same signature launches without the full launcher, on fresh (poisoned) buffers."""
    op._PLANS.clear()
    for i in range(5):
        args = make_args(1000, 256, 384, BF16, i % 2 == 0, device="cuda")
        outs = torch.ops.fusenorm.norm_mm(*args)
        check(args, outs, oracle_dtype=torch.float64)
    assert len(gluon_calls) == 2  # LayerNorm and RMSNorm once each: later calls replayed the plan
    assert len(op._PLANS) == 2


@pytest.mark.parametrize("what", ["k_odd", "fp32_out", "a_strided"])
def test_fallbacks_are_correct(what, gluon_calls):
    """Inputs the Gluon path cannot take: K not a multiple of 8, an fp32 output, a non-contiguous a. The
    dispatch says why and the tl kernels give the right result."""
    k = 44 if what == "k_odd" else 64
    args = make_args(257, k, 128, BF16, False, device="cuda", out_dtype=torch.float32 if what == "fp32_out" else None)
    if what == "a_strided":
        a = torch.randn(257, 2 * k, device="cuda").to(BF16)[:, ::2]
        args = (a,) + args[1:]
    why = tuning.gluon_unsupported(args[0], args[1], args[7])
    assert why is not None
    check(args, op.norm_mm_tuned(*args), oracle_dtype=torch.float64)
    assert not gluon_calls


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_empty_rows(dtype, gluon_calls):
    args = make_args(0, 64, 128, dtype, False, device="cuda")
    c, mean, rstd = op.norm_mm_tuned(*args)
    assert c.shape == (0, 128) and mean.shape == (0,) and rstd.shape == (0,)
