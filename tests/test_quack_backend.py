"""The kernel-backend interface (backends/) and its quack backend (backends/quack.py).

CPU (every run): the registry pools the backends' candidates and says why none takes a case; quack's
refusals name the reason; a quack configuration survives the tuning cache's round trip; with quack missing
or switched off, everything runs as before (Gluon's candidates alone). The row-scale merge's torch form
against ``merge_stats``.

GPU with quack installed (skipped otherwise; run on the GPU machine): ``fusenorm::deferred_mm`` through every
quack candidate against the CPU reference (``oracle`` of test_gluon_deferred_mm: 16-bit tolerances plus an
fp32 dot-product allowance), outputs NaN-poisoned, no silent fallback to the reference: producers writing
RMSNorm statistics (odd M, N with a short last tile, bias and residual or bare), producers and links writing
LayerNorm statistics at |mean| / std ~ 300 (against float64 statistics of y), consumers applying RMSNorm and
LayerNorm (LayerNorm at |mean| / std = 1000 in fp16, 125 in bf16), links of an RMSNorm tower; the merge kernel
against its torch form; and compiled models with the Gluon kernels switched off (quack serves every deferred
GEMM): an RMSNorm tower with 3-D input, bias and a post-norm residual, a pre-norm block with q/k/v fan-out, and
a LayerNorm of a residual sum at a large mean read by two linears, against an fp32 reference relative to
Inductor's own error on the same model.
"""

import copy
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn as nn  # noqa: E402

import fusenorm_inductor as fi  # noqa: E402
from fusenorm_inductor import backends, config  # noqa: E402
from fusenorm_inductor.backends import DeferredCase  # noqa: E402
from fusenorm_inductor.backends.quack import QUACK, QuackConfig  # noqa: E402
from fusenorm_inductor.kernels import deferred as dk  # noqa: E402
from fusenorm_inductor.kernels.merge import row_scales, row_scales_reference  # noqa: E402
from fusenorm_inductor.ops import deferred_norm as op  # noqa: E402
from fusenorm_inductor.tuning import measure  # noqa: E402

from .models import LayerNormOfSum  # noqa: E402

NONE, RMS, LN = dk.NONE, dk.RMS, dk.LN
BF16, F16 = torch.bfloat16, torch.float16
_QUACK = QUACK.unavailable() is None
_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (8, 9, 10, 12)
gpu_quack = pytest.mark.skipif(not (_GPU and _QUACK), reason=f"needs a GPU quack serves and quack ({QUACK.unavailable()})")


def _case(m=256, k=64, n=128, dtype=BF16, device="meta", **kw):
    return DeferredCase(torch.empty(m, k, dtype=dtype, device=device), torch.empty(k, n, dtype=dtype, device=device),
                        **kw)


# ---- CPU: the interface ------------------------------------------------------------------------------------


def test_case_of_the_op_arguments():
    a, b = torch.empty(4, 8), torch.empty(8, 16)
    args = (a, b, None, None, None, None, None, 1e-5, RMS, 128, LN, 64, False)
    case = DeferredCase.of(args)
    assert (case.a is a and case.b is b and case.a_norm == RMS and case.out_norm == LN and case.out_tile == 64
            and case.res_rows is None)


def test_quack_missing_or_off_says_why(monkeypatch):
    from fusenorm_inductor.backends import quack

    with config.patch(quack=False):
        assert QUACK.unavailable() == "off (config.quack / FUSENORM_QUACK)"
        assert backends.unavailable()["quack"].startswith("off")
    monkeypatch.setattr(quack, "_import_problem", lambda: "not installed (ModuleNotFoundError: No module named 'quack')")
    assert QUACK.deferred_unsupported(_case()).startswith("not installed")
    assert "not installed" in backends.unavailable()["quack"]


def test_quack_refusals_name_the_reason(monkeypatch):
    from fusenorm_inductor.backends import quack

    monkeypatch.setattr(quack, "_import_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = dict(device="cuda") if torch.cuda.is_available() else None
    assert "CUDA only" in QUACK.deferred_unsupported(_case())
    if cuda is None:  # the checks below read CUDA tensors' metadata: fake ones stand in on a CPU machine
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            _refusals(lambda **kw: _case(device="cuda", **kw))
    else:
        _refusals(lambda **kw: _case(device="cuda", **kw))


def _refusals(case):
    assert QUACK.deferred_unsupported(case()) is None
    assert QUACK.deferred_unsupported(case(out_norm=RMS, out_tile=128)) is None
    assert QUACK.deferred_unsupported(case(out_norm=LN, out_tile=128)) is None  # N = 128: one whole tile
    assert "whole tiles" in QUACK.deferred_unsupported(case(n=264, out_norm=LN, out_tile=128))
    assert QUACK.deferred_unsupported(case(a_norm=LN)) is None
    assert "tiles" in QUACK.deferred_unsupported(case(out_norm=RMS, out_tile=64))
    rows = torch.empty(3, 256, device="cuda")
    res = torch.empty(256, 128, dtype=BF16, device="cuda")
    assert "per-row residual" in QUACK.deferred_unsupported(case(residual=res, res_rows=rows))
    assert "does not read C" in QUACK.deferred_unsupported(case(residual=res, out_norm=LN, out_tile=128))
    assert "fp16 or bf16" in QUACK.deferred_unsupported(case(dtype=torch.float32))
    assert "multiples of 8" in QUACK.deferred_unsupported(case(k=60))
    assert "residual in" in QUACK.deferred_unsupported(case(residual=res.float()))


def test_layernorm_statistics_need_quacks_prepass(monkeypatch):
    from fusenorm_inductor.backends import quack

    monkeypatch.setattr(quack, "_import_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        case = _case(device="cuda", out_norm=LN, out_tile=128)
        assert "sm_90" in QUACK.deferred_unsupported(case)
        assert QUACK.deferred_unsupported(_case(device="cuda", out_norm=RMS, out_tile=128)) is None


def test_registry_pools_candidates_and_joins_reasons(monkeypatch):
    from fusenorm_inductor.backends import gluon, quack

    q = [QuackConfig("quack", 128, 128, 2, 1, True)]
    monkeypatch.setattr(gluon._Gluon, "deferred_unsupported", lambda self, case: None)
    monkeypatch.setattr(gluon._Gluon, "deferred_candidates", lambda self, case: ["g1", "g2"])
    monkeypatch.setattr(quack._Quack, "deferred_unsupported", lambda self, case: None)
    monkeypatch.setattr(quack._Quack, "deferred_candidates", lambda self, case: q)
    assert backends.deferred_candidates(_case()) == ["g1", "g2", *q]  # ours first: what runs untimed
    assert backends.backend_of(q[0]) is QUACK
    monkeypatch.setattr(quack._Quack, "deferred_unsupported", lambda self, case: "not installed")
    assert backends.deferred_candidates(_case()) == ["g1", "g2"]
    assert backends.deferred_unsupported(_case()) is None
    monkeypatch.setattr(gluon._Gluon, "deferred_unsupported", lambda self, case: "off")
    assert backends.deferred_unsupported(_case()) == "gluon: off; quack: not installed"
    with pytest.raises(ValueError, match="no backend owns"):
        backends.backend_of(("mystery", 1))


def test_the_dispatch_asks_the_backends_with_the_norm_each_gemm_applies(monkeypatch):
    """A consumer's case carries the norm it applies, a producer's the norm whose statistics it writes (a backend
    refuses by either: quack refuses LayerNorm statistics of a sum with a residual)."""
    from fusenorm_inductor.tuning import deferred_norm as tuning

    seen = []
    monkeypatch.setattr(backends, "deferred_candidates", lambda case: seen.append(case) or ["c"])
    a, b = torch.empty(8, 16), torch.empty(16, 24)
    tuning.deferred_candidates(a, b, 0, a_norm=LN)
    tuning.deferred_candidates(a, b, 128, out_norm=RMS)
    assert (seen[0].a_norm, seen[0].out_norm) == (LN, NONE) and (seen[1].a_norm, seen[1].out_norm) == (NONE, RMS)


def test_quack_configuration_round_trips_through_the_cache():
    cfg = QuackConfig("quack", 256, 128, 2, 1, False, 9, False, 0, 0)
    entry = measure.make_entry(cfg, {cfg: 1.0}, 2.0)
    assert entry["candidates"] == {cfg.label(): 1.0}
    assert measure.config_of(entry) == cfg
    assert measure.config_of({"config": ["gl_coop", 128, 256, 64, 3, 8]}).kind == "gl_coop"
    for bad in (["quack", 128], ["quack", 128, 128, 2, 1, "yes"], ["quack", 0, 128, 2, 1, True]):
        with pytest.raises(ValueError):
            measure.config_of({"config": bad})


@pytest.mark.parametrize("norm", [RMS, LN], ids=["rms", "ln"])
def test_row_scales_reference_is_the_merge(norm):
    torch.manual_seed(0)
    y = 300 + torch.randn(37, 1000)
    stats = dk.partial_stats(y, norm, 96)
    s, t = row_scales_reference(stats, 1000, 96, 1e-5, norm)
    mean, rstd = dk.merge_stats(stats, 1000, 96, 1e-5, norm)
    torch.testing.assert_close(s, rstd)
    if norm == LN:
        torch.testing.assert_close(t, mean * rstd)
    else:
        assert t is None
    # the off-GPU call is the reference
    s2, _ = row_scales(stats, 1000, 96, 1e-5, norm)
    torch.testing.assert_close(s2, s)


# ---- GPU: quack's deferred GEMMs ---------------------------------------------------------------------------


@pytest.fixture
def quack_only(monkeypatch):
    """NaN-poisoned outputs; the reference may not run (a launch that fell back would pass unseen)."""
    from .kernel_cases import nan_alloc

    monkeypatch.setattr(op, "_alloc", nan_alloc)

    real = op.deferred_mm_reference

    def no_fallback(*a, **k):
        if a[0].device.type == "cuda":
            raise AssertionError("the op's reference ran on the GPU instead of quack")
        return real(*a, **k)  # the oracle's, on the CPU

    monkeypatch.setattr(op, "deferred_mm_reference", no_fallback)
    torch.manual_seed(0)
    with config.patch(quack=True):
        yield


def _run_all(args):
    from .test_gluon_deferred_mm import oracle

    case = DeferredCase.of(args)
    assert QUACK.deferred_unsupported(case) is None, QUACK.deferred_unsupported(case)
    cands = QUACK.deferred_candidates(case)
    assert cands
    expected = oracle(args)
    for cfg in cands:
        _check(args, op.deferred_mm_tuned(args, config=cfg), expected)


def _check(args, outs, expected):
    """c within the oracle's tolerance; statistics against ``partial_stats`` of the kernel's own c up to the
    rounding of c (quack sums y^2 before y is rounded to c's dtype)."""
    a, b, out_norm, out_tile = args[0], args[1], args[10], args[11]
    m, n = a.shape[0], b.shape[1]
    c, stats = outs
    assert c.shape == (m, n) and c.dtype == a.dtype
    assert bool(torch.isfinite(c).all()), "c: unwritten (NaN-poisoned) or non-finite elements"
    want, tol = expected
    excess = (c.cpu().double() - want).abs() - tol
    assert float(excess.max()) <= 0, f"c off by {float(excess.max())} beyond its tolerance"
    if out_norm != NONE:
        assert stats.shape == dk.stats_shape(m, n, out_norm, out_tile)
        assert bool(torch.isfinite(stats).all()), "stats: unwritten (NaN-poisoned) elements"
        ref = dk.partial_stats(c.cpu(), out_norm, out_tile)
        rtol = 2.0**-7 if a.dtype == BF16 else 2.0**-10
        torch.testing.assert_close(stats.cpu(), ref, rtol=rtol, atol=1e-6 * float(ref.abs().max()))


@gpu_quack
@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("n", [40, 264, 1024, 3000])
@pytest.mark.parametrize("k", [64, 1000])
@pytest.mark.parametrize("m", [257, 1000])
def test_quack_producer(m, k, n, case, quack_only):
    """A GEMM writing RMSNorm statistics (tiles of 128: a short last tile at 40, 264, 3000), with bias and
    residual (b = W.t()) or bare (b row-major)."""
    from .test_gluon_deferred_mm import make_args

    full = case == "full"
    _run_all(make_args(m, k, n, BF16, NONE, RMS, out_tile=128, bias=full, residual=full, b_t=full))


@gpu_quack
@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("a_norm", [RMS, LN], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [40, 264, 3000])
@pytest.mark.parametrize("k", [64, 1000])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_quack_consumer(dtype, k, n, a_norm, case, quack_only):
    """The norm applied from partial statistics of a in tiles of 96 (merged by kernels/merge.py), its affine
    folded, bias and residual, or bare."""
    from .test_gluon_deferred_mm import make_args

    full = case == "full"
    _run_all(make_args(1000, k, n, dtype, a_norm, NONE, a_tile=96, bias=full, residual=full, affine=full,
                       b_t=full))


@gpu_quack
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_quack_layernorm_consumer_at_large_mean(dtype, quack_only):
    from .test_gluon_deferred_mm import make_args

    spread = 1.0 if dtype == F16 else 8.0
    _run_all(make_args(257, 1000, 264, dtype, LN, NONE, mean=1000.0, spread=spread))


@gpu_quack
@pytest.mark.parametrize("residual", [False, True], ids=["", "res"])
@pytest.mark.parametrize("n", [264, 1024])
def test_quack_tower_link(n, residual, quack_only):
    """RMSNorm applied and the next one's statistics written."""
    from .test_gluon_deferred_mm import make_args

    _run_all(make_args(257, 1000, n, BF16, RMS, RMS, a_tile=128, out_tile=128, residual=residual))


def _unrounded(args):
    """y of the op in float64 (the reference's arithmetic before c's rounding) on the CPU."""
    cpu = [None if t is None else t.cpu() if i == 4 else t.cpu().double() for i, t in enumerate(args[:7])]
    return op.deferred_mm_reference(*cpu, *args[7:])[0]


@gpu_quack
@pytest.mark.parametrize("form", ["bare", "bias", "link"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_quack_layernorm_statistics_at_large_mean(dtype, form, quack_only):
    """LayerNorm statistics written by quack (each tile's mean from its prepass, then the squared deviations
    from it) of rows at |mean| / std ~ 300 (from the bias or the residual): per tile, mean and M2 within fp32
    rounding of those of y in float64 before c's rounding; c within the oracle's tolerance. A plain sum of
    squares would be off by far more than the whole M2 here."""
    from .test_gluon_deferred_mm import make_args

    link = form.startswith("link")
    args = list(make_args(257, 1000, 1024, dtype, LN if link else NONE, LN, a_tile=96, out_tile=128,
                          bias=form != "bare", residual=False, affine=link))
    if form != "bare":
        args[2] = (300 + torch.randn(1024, device="cuda")).to(dtype)
    args = tuple(args)
    y = _unrounded(args)
    ref = dk.partial_stats(y, LN, 128)
    case = DeferredCase.of(args)
    assert QUACK.deferred_unsupported(case) is None, QUACK.deferred_unsupported(case)
    from .test_gluon_deferred_mm import oracle

    expected = oracle(args)
    for cfg in QUACK.deferred_candidates(case):
        c, stats = op.deferred_mm_tuned(args, config=cfg)
        _check(args[:10] + (NONE, 0) + args[12:], (c, stats[:0]), expected)  # c alone
        assert stats.shape == (2, 257, 8) and bool(torch.isfinite(stats).all()), cfg
        # fp32 sums of 128 values near 300 (std 1): the mean to a few fp32 units of 300, far below the std
        torch.testing.assert_close(stats[0].cpu(), ref[0], rtol=1e-5, atol=2e-3, msg=lambda m: f"{cfg}: mean {m}")
        torch.testing.assert_close(stats[1].cpu(), ref[1], rtol=2e-3, atol=1e-3, msg=lambda m: f"{cfg}: M2 {m}")


@gpu_quack
@pytest.mark.parametrize("norm", [RMS, LN], ids=["rms", "ln"])
def test_merge_kernel(norm):
    torch.manual_seed(1)
    y = 500 + torch.randn(1000, 3000, device="cuda")
    stats = dk.partial_stats(y, norm, 128)
    compiled: list = []
    for _ in range(2):  # the compiled launch too
        s, t = row_scales(stats, 3000, 128, 1e-5, norm, compiled=compiled)
        rs, rt = row_scales_reference(stats.cpu(), 3000, 128, 1e-5, norm)
        torch.testing.assert_close(s.cpu(), rs, rtol=1e-5, atol=0)
        if norm == LN:
            torch.testing.assert_close(t.cpu(), rt, rtol=1e-5, atol=1e-6)
    assert len(compiled) == 1


# ---- GPU: compiled models with quack serving every deferred GEMM ---------------------------------------------


class _RMSTower(nn.Module):
    """linear -> (+ its input) -> RMSNorm, three times (post-norm residuals), biases."""

    def __init__(self, d):
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        self.norms = nn.ModuleList([nn.RMSNorm(d, eps=1e-6) for _ in range(3)])
        self.out = nn.Linear(d, d)

    def forward(self, x):
        for lin, norm in zip(self.lins, self.norms):
            x = norm(lin(x) + x)
        return self.out(x)


class _PreNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.o, self.norm = nn.Linear(d, d, bias=False), nn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x, h):
        x = x + self.o(h)
        n = self.norm(x)
        return self.q(n) * self.k(n) + self.v(n)


def _err(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


@gpu_quack
@pytest.mark.parametrize("model", ["rms_tower", "prenorm_fanout", "ln_prenorm"])
def test_compiled_models_on_quack(model, monkeypatch):
    """Gluon off and measuring off: every deferred GEMM runs quack's first candidate (the models' producers are
    GEMMs writing RMSNorm statistics or pointwise code: quack writes no LayerNorm statistics). Within 1.5x
    Inductor's own error against the fp32 model (plus bf16's half unit), every quack launch counted."""
    from fusenorm_inductor.backends import quack

    launches = []
    real = quack._Quack.deferred_launch

    def spy(self, args, cfg, alloc, plan_out=None):
        launches.append(cfg)
        return real(self, args, cfg, alloc, plan_out)

    monkeypatch.setattr(quack._Quack, "deferred_launch", spy)
    torch.manual_seed(3)
    d = 256
    m = {"rms_tower": _RMSTower, "prenorm_fanout": _PreNorm, "ln_prenorm": LayerNormOfSum}[model](d).cuda().bfloat16()
    inputs = [torch.randn(3, 87, d, device="cuda", dtype=BF16)]
    if model != "rms_tower":
        inputs.append(torch.randn(3, 87, d, device="cuda", dtype=BF16))
    if model == "ln_prenorm":  # LayerNorm at a large mean: 100 * std in bf16
        inputs[0] = inputs[0] * 4 + 400
    with torch.no_grad():
        ref = copy.deepcopy(m).float()(*[t.float() for t in inputs])
    torch._dynamo.reset()
    with torch.no_grad():
        ind = torch.compile(m)(*inputs)
        torch._dynamo.reset()
        with config.patch({"gluon": False, "quack": True, "tuning.measure": False,
                           "patterns.linear_norm_fwd": False, "patterns.norm_linear_fwd": False}):
            out = torch.compile(m, backend="fusenorm")(*inputs)
            rep = fi.last_report()
    assert [r for r in rep.rewrites if r.pattern == "deferred_norm"], rep
    assert launches and all(isinstance(c, QuackConfig) for c in launches)
    # Eager rounds the residual sum to bf16 before its LayerNorm, as the deferred norm's stored input does;
    # Inductor's fused kernel keeps it in fp32 (at |mean| / std = 100: 0.4% against eager's 19%)
    eager = m(*inputs)
    bar = max(_err(ind, ref), _err(eager, ref))
    assert _err(out, ref) <= 1.5 * bar + 2.0**-9, (_err(out, ref), _err(ind, ref), _err(eager, ref))
    assert math.isfinite(_err(out, ref))


def test_report_notes_are_listed_once():
    from fusenorm_inductor.report import GraphReport

    rep = GraphReport("0/0")
    rep.note("kernel backend quack not offered to deferred normalization: not installed")
    rep.note("kernel backend quack not offered to deferred normalization: not installed")
    assert rep.notes == ["kernel backend quack not offered to deferred normalization: not installed"]
    assert "## Notes" in rep.to_markdown() and '"notes"' in rep.to_json()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_missing_backend_is_named_once_per_graph():
    """Two deferred sites on CUDA with quack switched off: the report names quack once, as a note."""
    torch.manual_seed(4)
    m = _RMSTower(128).cuda().bfloat16()
    x = torch.randn(300, 128, device="cuda", dtype=BF16)
    torch._dynamo.reset()
    with torch.no_grad(), config.patch({"quack": False, "tuning.measure": False, "patterns.linear_norm_fwd": False}):
        torch.compile(m, backend="fusenorm")(x)
        rep = fi.last_report()
    quack_notes = [n for n in rep.notes if "quack" in n]
    assert quack_notes == ["kernel backend quack not offered to deferred normalization: off (config.quack / "
                           "FUSENORM_QUACK)"], rep.notes


def test_epilogue_forms_read_only_what_they_need():
    """The lean forms where they fit (no vector loaded for nothing), the general affine elsewhere."""
    from fusenorm_inductor.backends.quack import _FNS, _form

    assert _form(RMS, False, False, False) == "scale" and _FNS["scale"][1] == ("s",)
    assert _form(NONE, False, False, True) == "stats" and _FNS["stats"][1] == ()
    assert _form(NONE, True, False, True) == "bias_stats"
    assert _form(LN, False, False, False) == "general"  # LayerNorm's rank-1 term
    assert _form(RMS, True, False, False) == "general"
    assert _form(RMS, False, True, True) == "general_residual_stats"
    assert _form(NONE, False, False, LN) == "ln_stats" and _FNS["ln_stats"][1] == ()
    assert _form(NONE, True, False, LN) == "bias_ln_stats" and _FNS["bias_ln_stats"][1] == ("wb",)
    assert _form(RMS, False, False, LN) == "general_ln_stats"
    for form, (fn, names, prepass) in _FNS.items():  # a prepass repeats its epilogue's y: the same operands
        if prepass is not None:
            pre = prepass.__code__.co_varnames[:prepass.__code__.co_argcount]
            main = fn.__code__.co_varnames[:fn.__code__.co_argcount]
            assert set(pre) | {"mu"} == set(main), form
