"""The Gluon sm_90 kernel of ``fusenorm::deferred_mm`` (kernels/hopper/deferred_mm.py) on the GPU, against
``deferred_mm_reference`` (ops/deferred_norm.py) computed on the CPU from the same inputs.

Every configuration ``candidates`` offers runs through ``deferred_mm_tuned(args, config=cfg)`` at odd shapes
(M = 257 and 1000; N = 40, 264, 1024, 3000: one tile, a partial last tile, many tiles; K = 40 (BK 32) and
1000), in bf16 and fp16: producers (no input norm; RMSNorm and LayerNorm output statistics, several
statistics tile widths, straddling N or not), consumers (RMSNorm and LayerNorm applied from partial
statistics of their input, with the norm's affine folded, statistics tiles of a_tile = 96 leaving a short
last one), links of a chain (a norm applied, the next one's statistics written) and a two-link chain
against the unfused norm, LayerNorm at |mean| / std = 1000 (fp16; 125 in bf16, whose 8-bit mantissa cannot
hold 1000 + N(0, 1)), with and without bias and residual, b = W.t() or row-major. Every output the op
allocates is NaN-poisoned; each test checks the Gluon kernel ran (no silent fallback to the reference).
c is compared with 16-bit tolerances plus an fp32 dot-product allowance (LayerNorm's rank-1 correction
cancels |mean| * colsum); the statistics closely against ``partial_stats`` of the kernel's own c, the values
they describe. Needs an sm_90 GPU; the CPU suite compiles the same kernels (test_gluon_compile.py).
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (_SM90 and _compat.available()), reason="needs an sm_90 GPU and Gluon")

from fusenorm_inductor.ops import deferred_norm as op  # noqa: E402

from .kernel_cases import nan_alloc  # noqa: E402

BF16, F16 = torch.bfloat16, torch.float16
EPS = 1e-5
NONE, RMS, LN = op.NONE, op.RMS, op.LN
# c: a few units in the last place of the output dtype (the kernel and the reference round the same fp32
# sum, which differs in its last fp32 bits)
C_RTOL = {BF16: 2.0**-6, F16: 2.0**-9}
C_ATOL = {BF16: 2.0**-6, F16: 2.0**-9}


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    monkeypatch.setattr(op, "_alloc", nan_alloc)
    torch.manual_seed(0)


@pytest.fixture
def gluon_calls(monkeypatch):
    """The configurations of the Gluon launches that ran (a launch that raised is not recorded)."""
    from fusenorm_inductor import config
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    calls = []
    real = hopper.deferred_mm_gluon

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        calls.append(args[-1])
        return plan

    monkeypatch.setattr(hopper, "deferred_mm_gluon", spy)
    with config.patch(gluon=True):
        yield calls


def make_args(m, k, n, dtype, a_norm, out_norm, *, a_tile=128, out_tile=128, bias=True, residual=True,
              affine=True, b_t=True, mean=0.0, spread=1.0, a=None):
    """The op's arguments on CUDA: rows of mean + spread * N(0, 1), b ~ N(0, 1/K) (W.t() of an [N, K] weight,
    or row-major), the norm's weight and bias in the model's dtype, a_stats from ``partial_stats`` of a."""
    dev = "cuda"
    if a is None:
        a = (mean + spread * torch.randn(m, k, device=dev)).to(dtype)
    b = torch.randn(n, k, device=dev).t() if b_t else torch.randn(k, n, device=dev)
    b = (b / math.sqrt(k)).to(dtype)
    bias_t = torch.randn(n, device=dev).to(dtype) if bias else None
    res = torch.randn(m, n, device=dev).to(dtype) if residual else None
    w = nb = None
    if a_norm != NONE and affine:
        w = (1 + 0.5 * torch.randn(k, device=dev)).to(dtype)
        nb = (0.5 * torch.randn(k, device=dev)).to(dtype) if a_norm == LN else None
    a_stats = op.partial_stats(a, a_norm, a_tile) if a_norm != NONE else None
    return (a, b, bias_t, res, a_stats, w, nb, EPS, a_norm, a_tile if a_norm != NONE else 0, out_norm,
            out_tile if out_norm != NONE else 0, False)


def candidates(args):
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    a, b, residual, out_norm, out_tile = args[0], args[1], args[3], args[10], args[11]
    assert hopper.unsupported(a, b, residual, out_norm, out_tile) is None
    cands = hopper.candidates(a, b, out_tile if out_norm != NONE else 0, residual is not None, len(args) > 13)
    assert cands
    return cands


def oracle(args):
    """(c of the CPU reference, c's tolerance): 16-bit units in the last place plus an allowance for fp32 dot
    products of K terms (the GPU's and the CPU's in different orders) scaled by the norm's rstd: what the
    rank-1 correction leaves of |a| @ |b'| at a large mean."""
    a, k, a_norm = args[0], args[0].shape[1], args[8]
    cpu = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in args)
    ref_c, _ = op.deferred_mm_reference(*cpu)
    b_f, _, _ = op.folded(cpu[1], cpu[2], cpu[5], cpu[6], a_norm)
    allowance = 2.0**-22 * math.sqrt(k) * (cpu[0].abs().float() @ b_f.abs().float()).double()
    if a_norm != NONE:
        allowance = allowance * op.merge_stats(cpu[4], k, args[9], args[7], a_norm)[1].double().unsqueeze(1)
    want = ref_c.double()
    return want, C_RTOL[a.dtype] * want.abs() + C_ATOL[a.dtype] + allowance


def check(args, outs, expected=None):
    """(c, stats) of the kernel: every element written and finite, c within its tolerance of the CPU
    reference (``oracle``), stats within fp32 summation-order differences of ``partial_stats`` of the
    kernel's own c (the values they describe)."""
    a, b, out_norm, out_tile = args[0], args[1], args[10], args[11]
    m, n = a.shape[0], b.shape[1]
    c, stats = outs
    assert c.shape == (m, n) and c.dtype == a.dtype and c.device == a.device
    assert stats.shape == op.stats_shape(m, n, out_norm, out_tile) and stats.dtype == torch.float32
    assert bool(torch.isfinite(c).all()), "c: unwritten (NaN-poisoned) or non-finite elements"
    assert bool(torch.isfinite(stats).all()), "stats: unwritten (NaN-poisoned) or non-finite elements"
    want, tol = expected if expected is not None else oracle(args)
    got = c.cpu().double()
    excess = (got - want).abs() - tol
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0, (f"c[{worst // n}, {worst % n}] = {float(got.view(-1)[worst])} vs "
                                      f"{float(want.view(-1)[worst])} (tolerance {float(tol.view(-1)[worst])})")
    if out_norm != NONE:
        ref_s = op.partial_stats(c.cpu(), out_norm, out_tile)
        scale = float(ref_s.abs().max()) or 1.0
        torch.testing.assert_close(stats.cpu(), ref_s, rtol=1e-5, atol=1e-6 * scale)


def run_all(args, gluon_calls):
    cands = candidates(args)
    expected = oracle(args)
    for cfg in cands:
        check(args, op.deferred_mm_tuned(args, config=cfg), expected)
    assert gluon_calls == cands, "a candidate did not run on the Gluon kernel"


@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("out_norm", [RMS, LN], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [40, 264, 1024, 3000])
@pytest.mark.parametrize("k", [40, 1000])
@pytest.mark.parametrize("m", [257, 1000])
def test_producer(m, k, n, out_norm, case, gluon_calls):
    """A plain GEMM writing the next norm's statistics (tiles of 128 columns: groups straddling N at 40, 264
    and 3000), with bias and residual (b = W.t()) and without (b row-major)."""
    full = case == "full"
    args = make_args(m, k, n, BF16, NONE, out_norm, out_tile=128, bias=full, residual=full, b_t=full)
    run_all(args, gluon_calls)


@pytest.mark.parametrize("out_tile", [8, 32, 64, 256])
@pytest.mark.parametrize("out_norm", [RMS, LN], ids=["rms", "ln"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_statistics_tile_widths(dtype, out_norm, out_tile, gluon_calls):
    """Statistics tiles from 8 columns to a whole 256-wide tile (N = 1000: the last one short, past N in
    a partial N tile), fp16 and bf16."""
    args = make_args(257, 256, 1000, dtype, NONE, out_norm, out_tile=out_tile)
    run_all(args, gluon_calls)


@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("a_norm", [RMS, LN], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [40, 264, 3000])
@pytest.mark.parametrize("k", [40, 1000])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_consumer(dtype, k, n, a_norm, case, gluon_calls):
    """The deferred norm applied from partial statistics of a (a_tile = 96: K = 1000 leaves a short last
    statistics tile and 11 tiles, more than one chunked load of the epilogue's; K = 40 a single one), with
    the norm's affine folded, bias and residual, or bare."""
    full = case == "full"
    args = make_args(1000, k, n, dtype, a_norm, NONE, a_tile=96, bias=full, residual=full, affine=full,
                     b_t=full)
    run_all(args, gluon_calls)


@pytest.mark.parametrize("residual", [False, True], ids=["", "res"])
@pytest.mark.parametrize("norm", [RMS, LN], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [264, 1024])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_chain_link(dtype, n, norm, residual, gluon_calls):
    """A link of a chain: the previous norm applied and the next one's statistics written (tiles of 64)."""
    args = make_args(257, 1000, n, dtype, norm, norm, a_tile=128, out_tile=64, residual=residual)
    run_all(args, gluon_calls)


@pytest.mark.parametrize("residual", [False, True], ids=["", "res"])
@pytest.mark.parametrize("role", ["producer", "link"])
@pytest.mark.parametrize("norm", [RMS, LN], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [256, 512])
def test_register_statistics(n, norm, role, residual, gluon_calls):
    """The candidates that sum the output statistics in registers (``stats_regs``: the ping-pong tiles,
    statistics tiles of 128 columns, N <= 512) among the others, as a producer and as a link, odd M."""
    a_norm = norm if role == "link" else NONE
    args = make_args(257, 1000, n, BF16, a_norm, norm, a_tile=128, out_tile=128, residual=residual)
    assert any(c.stats_regs for c in candidates(args))
    run_all(args, gluon_calls)


@pytest.mark.parametrize("norm", [RMS, LN], ids=["rms", "ln"])
def test_two_link_chain_is_the_unfused_norm(norm, gluon_calls):
    """linear -> norm -> linear as two deferred_mm calls (the first writes the statistics the second merges)
    against the unfused model in fp32: the norm of the stored y, then the second linear."""
    m, k, n1, n2 = 1000, 512, 1024, 264
    x = torch.randn(m, k, device="cuda").to(BF16)
    first = make_args(m, k, n1, BF16, NONE, norm, out_tile=128, a=x)
    y, y_stats = op.deferred_mm_tuned(first, config=candidates(first)[0])
    check(first, (y, y_stats))
    second = make_args(m, n1, n2, BF16, norm, NONE, a_tile=128, a=y)
    second = second[:4] + (y_stats,) + second[5:]
    z, _ = op.deferred_mm_tuned(second, config=candidates(second)[0])
    check(second, (z, _))
    w, nb = second[5].float().cpu(), (second[6].float().cpu() if second[6] is not None else None)
    yf = y.float().cpu()
    if norm == LN:
        normed = torch.nn.functional.layer_norm(yf, (n1,), w, nb, EPS)
    else:
        normed = yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + EPS) * w
    want = normed @ second[1].float().cpu() + second[2].float().cpu() + second[3].float().cpu()
    torch.testing.assert_close(z.float().cpu(), want, rtol=2e-2, atol=3e-2)
    assert len(gluon_calls) == 2


@pytest.mark.parametrize("dtype, spread", [(F16, 1.0), (BF16, 8.0)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n", [40, 1024])
def test_layernorm_large_mean(dtype, spread, n, gluon_calls):
    """Rows of 1000 + spread * N(0, 1) as the input of a LayerNorm consumer that is also a LayerNorm
    producer: the input's Chan merge and the rank-1 correction keep c within its bound, and the output's
    statistics stay exact for c's own mean (the residual adds 1000 to c: |mean| / std ~ 1000 there too)."""
    args = make_args(1000, 1000, n, dtype, LN, LN, a_tile=128, out_tile=32, mean=1000.0, spread=spread)
    res = (1000 + torch.randn(1000, n, device="cuda")).to(dtype)
    args = args[:3] + (res,) + args[4:]
    run_all(args, gluon_calls)


@pytest.mark.parametrize("b_t", [True, False], ids=["bt", "bkn"])
@pytest.mark.parametrize("rows", [1, 3], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [40, 264, 1024])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_row_scaled_residual(dtype, n, rows, b_t, gluon_calls):
    """A norm's input gradient as the GEMM of its consumers' gradients computes it: the residual (the norm's
    input) scaled per row (RMSNorm: one term; LayerNorm: scale, center and shift, with rows of mean 100 and
    their own means as the center), no bias, K = 1000, the folded weights in either layout."""
    args = make_args(1000, 1000, n, dtype, NONE, NONE, bias=False, b_t=b_t)
    res = args[3] if rows == 1 else (100 + torch.randn(1000, n, device="cuda")).to(dtype)
    terms = torch.randn(rows, 1000, device="cuda")
    if rows == 3:
        terms[1] = res.float().mean(1)
    run_all(args[:3] + (res,) + args[4:] + (terms,), gluon_calls)


@pytest.mark.parametrize("norm", [RMS, LN], ids=["rms", "ln"])
def test_cta_pair_tower_link(norm, gluon_calls):
    """Where this triton has CTA pairs (pair_core: triton >= 3.9): both pair tiles (one consumer; two in
    ping-pong) lead the candidates of an MLP tower's link (the norm applied, the next one's statistics
    written, bias, no residual) and run it right at
    M = 1000 (a partial last pair), N = 1000 (a partial last tile; LayerNorm's last statistics group
    straddles N), K = 1000. The other run_all tests take the pair too wherever it is offered."""
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper
    from fusenorm_inductor.kernels.hopper import pair_core

    if pair_core.unavailable() is not None:
        pytest.skip(pair_core.unavailable())
    args = make_args(1000, 1000, 1000, BF16, norm, norm, residual=False)
    pairs = candidates(args)[:2]
    assert [c.kind for c in pairs] == [hopper.PAIR_KIND, hopper.PAIR_PP_KIND]
    expected = oracle(args)
    for cfg in pairs:
        check(args, op.deferred_mm_tuned(args, config=cfg), expected)
    assert gluon_calls == pairs


def test_plan_relaunches_on_new_tensors(gluon_calls):
    """The plan ``deferred_mm_gluon`` returns launches the same specialization on new tensors of the same
    signature (the fast launcher's descriptors keyed by address), into fresh poisoned buffers."""
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    plan = None
    for i in range(3):
        args = make_args(1000, 256, 264, BF16, LN, LN, out_tile=64)
        a, b, bias, residual, a_stats, w, nb = args[:7]
        b_f, bias_f, colsum = op.folded(b, bias, w, nb, LN)
        c = nan_alloc((1000, 264), BF16, "cuda")
        stats = nan_alloc(op.stats_shape(1000, 264, LN, 64), torch.float32, "cuda")
        if plan is None:
            plan = hopper.deferred_mm_gluon(a, b_f, bias_f, colsum, residual, a_stats, EPS, LN, 128, LN, 64, c,
                                            stats, candidates(args)[0])
        else:
            plan(a, b_f, bias_f, colsum, residual, a_stats, c, stats)
        check(args, (c, stats))
    assert len(gluon_calls) == 1


def test_rejects_what_it_cannot_take():
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    a = torch.randn(257, 64, device="cuda").to(BF16)
    b = torch.randn(64, 128, device="cuda").to(BF16)
    assert hopper.unsupported(a, b, None, LN, 128) is None
    assert "out_tile" in hopper.unsupported(a, b, None, LN, 96)
    assert "out_tile" in hopper.unsupported(a, torch.randn(64, 1024, device="cuda").to(BF16), None, RMS, 512)
    assert "residual" in hopper.unsupported(a, b, torch.randn(257, 128, device="cuda"), NONE, 0)
    assert "residual" in hopper.unsupported(a, b, torch.randn(128, 257, device="cuda").to(BF16).t(), NONE, 0)
    assert "multiple of 8" in hopper.unsupported(a, torch.randn(64, 100, device="cuda").to(BF16), None, NONE, 0)
