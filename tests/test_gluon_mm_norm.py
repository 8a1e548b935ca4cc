"""The Gluon sm_90 post-norm forward (kernels/hopper/mm_norm.py) on the GPU, against the fp32 reference.

Every configuration the dispatch can pick is run at odd shapes (M = 257 and 1000; N = 64, 96, 320, 1000,
2048, 3000, 4096, 8192 over one tile, clusters of 2-8 CTAs, or clusters whose CTAs compute 2-4 tiles of a
row block; K = 40 and 200), with bias, residual, affine and hh (the "full"
case, B as W.t()) and without any (the "bare" case, B row-major [K, N]); LayerNorm at |mean| / std = 1000;
inputs the TMA path cannot take fall back to the ``tl`` path (right results, the Gluon launcher never
called, the dispatch's reason says why). Every buffer the launcher allocates is NaN-poisoned.
Needs an sm_90 GPU; the CPU suite compiles the same kernels (test_gluon_compile.py).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402

from fusenorm_inductor.ops.mm_norm import mm_norm_reference  # noqa: E402

from . import kernel_cases as kc  # noqa: E402
from .kernel_cases import BF16, F16, F32, FWD_CASES, NORMS, fwd_k  # noqa: E402

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (_SM90 and _compat.available()), reason="needs an sm_90 GPU and Gluon")

TARGET = kc.Target(torch.device("cuda"), kc.CUDA_TOL)


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    from fusenorm_inductor import config

    kc.poison_and_seed(monkeypatch)
    kc.force_block_n(monkeypatch, None)
    with config.patch(gluon=True):
        yield


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records every configuration the Gluon launcher runs."""
    from fusenorm_inductor.kernels.hopper import mm_norm as hopper

    calls = []
    real = hopper.mm_norm_gluon

    def spy(*args, **kwargs):
        calls.append(args[13])
        return real(*args, **kwargs)

    monkeypatch.setattr(hopper, "mm_norm_gluon", spy)
    return calls


@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("k", [40, 200])
@pytest.mark.parametrize("n", [64, 96, 320, 1000, 2048, 3000, 4096, 8192])
@pytest.mark.parametrize("m", [257, 1000])
@NORMS
def test_every_candidate_matches_reference(m, n, k, case, is_rms, gluon_calls):
    from fusenorm_inductor.kernels.hopper import mm_norm as hopper
    from fusenorm_inductor.kernels.hopper.common import SpillError

    args = TARGET.fwd_args(FWD_CASES[case], m, k, n, BF16, is_rms)
    cands = hopper.candidates(args[0], args[1], args[-1])
    assert cands and hopper.unsupported(*args[:6], args[8], args[9]) is None
    refs = mm_norm_reference(*args)
    ran = 0
    for cfg in cands:
        try:
            outs = fwd_k.mm_norm_triton(*args, config=cfg)
        except SpillError:
            # refused, never launched (the tuner drops it; without tuning the tl path runs): only epilogues
            # with bias, residual and affine spill
            assert case == "full", cfg.label()
            continue
        ran += 1
        TARGET.check(outs, refs, [f"{name} [{cfg.label()}]" for name in kc.FWD_NAMES])
    assert gluon_calls == cands
    if ran == 0:
        # Every Gluon specialization of this case spills: what a user gets is the op's fallback to the tl
        # kernels, which must then run and match (a case where no kernel ran must not pass).
        from fusenorm_inductor.ops.mm_norm import mm_norm_tuned

        TARGET.check(mm_norm_tuned(*args), refs, [f"{name} [tl fallback]" for name in kc.FWD_NAMES])
        ran += 1
    assert ran > 0


@pytest.mark.parametrize("n", [128, 1024, 4096])
def test_layernorm_large_mean(n, gluon_calls):
    """|mean| / std = 1000: two-pass in the tile, Chan across a cluster's tiles."""
    TARGET.check_layernorm_large_mean(1000, 200, n, BF16, w_max=5.0)
    assert len(gluon_calls) == 1
    assert (gluon_calls[0].kind == "gl_cluster") == (n > 256)


def test_gemm_base_is_the_plain_product():
    from fusenorm_inductor.kernels.hopper import mm_norm as hopper

    a = TARGET.randn_scaled(1000, 200, BF16)
    b = TARGET.randn(1024, 200, dtype=BF16).t()
    ref = (a.float() @ b.float()).to(BF16)
    for cfg in hopper.candidates(a, b, False):
        y = fwd_k.mm_norm_triton(a, b, None, None, None, None, 1e-5, True, None, False, config=cfg, gemm_only=True)[0]
        torch.testing.assert_close(y, ref, **kc.CUDA_TOL[BF16])


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """Same values in storage starting 2 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


FALLBACKS = {
    "fp32": lambda a, b: (a.float(), b.float()),
    "a_noncontiguous": lambda a, b: (kc.col_major(a), b),
    "k_not_multiple_of_8": lambda a, b: (a[:, :196], b[:196]),
    "n_not_multiple_of_8": lambda a, b: (a, b[:, :100]),
    "a_misaligned": lambda a, b: (_misaligned(a), b),
    "n_too_wide": lambda a, b: (a, torch.cat([b] * 72, dim=1)),  # N = 9216: 36 tiles, over 8 CTAs x 4
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_fallbacks_are_correct_and_reported(name, gluon_calls):
    from fusenorm_inductor.tuning import mm_norm as tuning

    a = TARGET.randn_scaled(257, 200, BF16)
    b = TARGET.randn(128, 200, dtype=BF16).t()
    a, b = FALLBACKS[name](a, b)
    args = (a, b, None, None, TARGET.randn(b.shape[1]), None, 1e-5, False, None, True)
    TARGET.check_forward(args)
    assert gluon_calls == []
    reason = tuning.forward_choice(*args).reason
    assert "Gluon sm_90 path not taken" in reason, reason


def test_custom_op_runs_gluon(gluon_calls):
    a = TARGET.randn_scaled(1000, 512, BF16)
    w = TARGET.randn(256, 512, dtype=BF16)
    y, hh, mean, rstd = torch.ops.fusenorm.mm_norm(a, w.t(), None, None, None, None, 1e-6, True, None, False)
    ref = torch.nn.functional.rms_norm((a.float() @ w.float().t()), (256,), eps=1e-6)
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2e-2)
    assert len(gluon_calls) == 1


@pytest.mark.parametrize("dtype", [F16])
def test_fp16(dtype):
    args = TARGET.fwd_args(FWD_CASES["full"], 257, 200, 320, dtype, False)
    TARGET.check_forward(args)


def test_cached_plan_relaunches_on_new_and_reused_buffers(gluon_calls):
    """The compiled graph's call (graph_calls): the first call makes the launch plan, later calls reuse it
    with TMA maps kept per data pointer; new inputs, then the first inputs again, each give their own result."""
    from torch._inductor.select_algorithm import extern_kernels

    from fusenorm_inductor import graph_calls
    from fusenorm_inductor.tuning import measure

    graph_calls.install()
    measure.clear_memory()  # plans made by earlier tests are stale now
    call = getattr(extern_kernels, graph_calls.call_name("mm_norm"))
    w = TARGET.randn(320, 200, dtype=BF16)
    lw, lb = TARGET.randn(320, dtype=BF16), TARGET.randn(320, dtype=BF16)
    inputs = [TARGET.randn_scaled(257, 200, BF16) for _ in range(2)]
    for a in inputs + inputs[:1]:
        y, hh, mean, rstd = call(a, w.t(), None, None, lw, lb, 1e-5, False, None, True)
        ref = torch.nn.functional.layer_norm(a.float() @ w.float().t(), (320,), lw.float(), lb.float(), 1e-5)
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(rstd, 1 / (a.float() @ w.float().t()).var(-1, unbiased=False).add(1e-5).sqrt(),
                                   atol=1e-3, rtol=1e-3)
    assert len(gluon_calls) == 1  # one plan made, relaunched twice


def test_fast_launcher_refuses_another_signature():
    from fusenorm_inductor.kernels.hopper import launch as L

    class Probe(L.FastLauncher):
        def __init__(self):  # only what _encoded reads
            self.signature, self.cache, self.metas = [None], [{}], [None]
            self._encode = lambda desc, meta: [desc.base.data_ptr()]

    probe = Probe()
    probe._encoded(0, torch.empty(4, 8, device="cuda"))
    with pytest.raises(ValueError, match="parameter 0"):
        probe._encoded(0, torch.empty(8, 4, device="cuda"))
