"""The Gluon sm_90 regrouped backward (kernels/hopper/mm_norm_backward.py) on the GPU, against the fp32 reference.

Every configuration the dispatch can pick runs at odd shapes (M = 257 and 1000; N = 40, 128, 200, 256: one
tile per row, masked and whole; N = 320, 1000, 2048: rows over clusters of 2, 4 and 8 CTAs; K = 40 and 200), with extra, weight and bias, src the norm's input and b the
next linear's row-major weight (the "full" case), and with none of them, src the saved hh and b as W.t()
(the "bare" case); M = 40001, several tiles per program; LayerNorm from x at |mean| / std = 1000; dw and db the same bits run to run; inputs the
path cannot take fall back to the ``tl`` kernels (right results, the Gluon plan never made). Every buffer
the launcher allocates is NaN-poisoned. Needs an sm_90 GPU; the CPU suite compiles the same kernels
(test_gluon_compile.py).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402

from fusenorm_inductor.tuning import mm_norm_backward as bwd_t  # noqa: E402

from . import kernel_cases as kc  # noqa: E402
from .kernel_cases import BF16, BWD_CASES, NORMS, bwd_k  # noqa: E402

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
def plans(monkeypatch):
    """Records the configuration of every Gluon backward plan made."""
    from fusenorm_inductor.kernels.hopper import mm_norm_backward as hopper

    made = []
    real = hopper.BackwardPlan

    def spy(*args, **kwargs):
        made.append(args[10])
        return real(*args, **kwargs)

    monkeypatch.setattr(hopper, "BackwardPlan", spy)
    return made


def _gluon_args(args):
    dy, b, extra, src, weight, mean, rstd, _, _, _, dx_dtype = args
    return extra, src, weight, mean, rstd, dx_dtype


def _check_every_candidate(args, plans):
    from fusenorm_inductor.kernels.hopper import common as hopper_common
    from fusenorm_inductor.kernels.hopper import mm_norm_backward as hopper

    assert bwd_t.gluon_unsupported(args[0], args[1], *_gluon_args(args)) is None
    cands = hopper.candidates(args[0], args[1])
    assert cands and bwd_t.backward_candidates(args[0], args[1], args[1].shape[1], 2, _gluon_args(args)) == cands
    rdx, rdw, rdb = kc.mm_norm_backward_reference(*args)
    ran = 0
    for cfg in cands:
        try:
            dx, dw, db = bwd_k.mm_norm_backward_triton(*args, config=cfg)
        except hopper_common.SpillError:
            continue  # refused, never launched (the offline compile test lists the specializations that spill)
        ran += 1
        TARGET.check([dx], [rdx], [f"dx [{cfg.label()}]"])
        TARGET.check_colsum(dw, rdw, f"dw [{cfg.label()}]")
        TARGET.check_colsum(db, rdb, f"db [{cfg.label()}]")
    assert plans == cands and ran > 0


@pytest.mark.parametrize("case", ["full", "bare"])
@pytest.mark.parametrize("n", [40, 128, 200, 256, 320, 1000, 2048])
@pytest.mark.parametrize("m", [257, 1000])
@NORMS
def test_every_candidate_matches_reference(m, n, case, is_rms, plans):
    k = 200 if case == "full" else 40
    _check_every_candidate(TARGET.bwd_args(BWD_CASES[case], m, k, n, BF16, is_rms), plans)


@pytest.mark.parametrize("n", [128, 256, 1000])
@NORMS
def test_many_tiles_per_program(n, is_rms, plans):
    """M = 40001: more row blocks than SMs, so each program computes several tiles and its warps add their
    dw / db column sums over them (the shapes above give every program one tile, ping-pong ones an idle
    consumer)."""
    _check_every_candidate(TARGET.bwd_args(BWD_CASES["full"], 40001, 200, n, BF16, is_rms), plans)


def test_normed_layernorm_with_extra_and_affine(plans):
    """src the saved hh with extra, weight and bias (the combination neither case above takes)."""
    args = list(TARGET.bwd_args(BWD_CASES["full"], 1000, 200, 200, BF16, False))
    x = args[3]
    args[3] = ((x.float() - args[5][:, None]) * args[6][:, None]).to(BF16)
    args[8] = True
    _check_every_candidate(tuple(args), plans)


@pytest.mark.parametrize("n", [128, 256, 1000])
def test_layernorm_from_x_at_large_mean(n, plans):
    """x = 1000 + N(0, 2): x_hat is rebuilt as (x - mean) * rstd in fp32 (not x * rstd - mean * rstd, which
    cancels at |mean| / std = 1000)."""
    args = list(TARGET.bwd_args(BWD_CASES["full"], 1000, 200, n, BF16, False))
    x = (1000.0 + 2.0 * torch.randn(1000, n, device="cuda")).to(BF16)
    var, mean = torch.var_mean(x.float(), dim=1, unbiased=False)
    args[3], args[5], args[6] = x, mean, torch.rsqrt(var + kc.EPS)
    _check_every_candidate(tuple(args), plans)


@pytest.mark.parametrize("n", [40, 256, 1000])
def test_same_bits_run_to_run(n):
    args = TARGET.bwd_args(BWD_CASES["full"], 40001, 512, n, BF16, False)  # several tiles per program
    from fusenorm_inductor.kernels.hopper.common import SpillError

    first = cfg = None
    for cfg in bwd_t.backward_candidates(args[0], args[1], n, 2, _gluon_args(args)):
        assert cfg.kind.startswith("gl_")
        try:  # the first candidate that runs: the launcher refuses a specialization that spills
            first = bwd_k.mm_norm_backward_triton(*args, config=cfg)
            break
        except SpillError:
            continue
    assert first is not None, "every Gluon candidate spills"
    second = bwd_k.mm_norm_backward_triton(*args, config=cfg)
    for a, b, name in zip(first, second, ("dx", "dw", "db")):
        assert torch.equal(a, b), name


def test_cached_plan_relaunch_through_the_op():
    """The op as compiled graphs call it: the first call makes and caches the plan, the second launches it on
    new inputs of the same signature; both match the reference."""
    import importlib

    op = importlib.import_module("fusenorm_inductor.ops.mm_norm_backward")  # the module, not the op it exports

    op._PLANS.clear()
    for _ in range(2):
        args = TARGET.bwd_args(BWD_CASES["full"], 1000, 200, 256, BF16, True)
        dx, dw, db = op._cuda(*args)
        rdx, rdw, rdb = kc.mm_norm_backward_reference(*args)
        TARGET.check([dx], [rdx], ["dx"])
        TARGET.check_colsum(dw, rdw, "dw")
    assert len(op._PLANS) == 1


FALLBACKS = {
    "n_too_wide": lambda args: args,  # N = 2304: rows over 9 tiles, more than a cluster of 8
    "fp32": lambda args: tuple(t.float() if isinstance(t, torch.Tensor) and t.dtype == BF16 else t
                               for t in args[:10]) + (torch.float32,),
    "dy_noncontiguous": lambda args: (kc.col_major(args[0]),) + args[1:],
    "dx_fp32": lambda args: args[:10] + (torch.float32,),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_fallbacks_are_correct(name, plans):
    n = 2304 if name == "n_too_wide" else 128
    args = FALLBACKS[name](TARGET.bwd_args(BWD_CASES["full"], 257, 200, n, BF16, False))
    assert bwd_t.gluon_unsupported(args[0], args[1], *_gluon_args(args)) is not None
    TARGET.check_backward(args)
    assert plans == []
