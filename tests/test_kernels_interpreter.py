"""The Triton kernels of mm_norm / mm_norm_backward under the Triton interpreter (CPU), against references.

Covers both paths of each launcher (single tile, and multi tile forced with ``_FORCE_BLOCK_N = 16``),
LayerNorm and RMSNorm, every optional input, odd shapes (M = 33, 257; K = 17, 40; N = 17, 24, 40),
non-contiguous operands, the scratch choices of the multi-tile path, |mean| >> std, and degenerate shapes.
Every buffer the launchers allocate is poisoned with NaN, so an element a kernel fails to write fails.
The cases, inputs, references, checks and tolerances are shared with test_kernels_cuda.py (kernel_cases.py).

fp32 and fp16 only: bf16 arithmetic is broken in the Triton 3.6 interpreter (docs/platform.md); bf16 and the
larger shapes run in test_kernels_cuda.py. With CUDA present these tests are skipped (the device file covers
the kernels there, and the interpreter must not be switched on in a GPU session).
"""

import importlib
import os
import sys
from dataclasses import replace

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
    "fusenorm_inductor.kernels.triton.common",
    "fusenorm_inductor.kernels.triton.mm_norm",
    "fusenorm_inductor.kernels.triton.mm_norm_backward",
):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

from fusenorm_inductor.kernels.triton import common  # noqa: E402

from . import kernel_cases as kc  # noqa: E402  (imports the kernel modules)
from .kernel_cases import EPS, F16, F32, FWD_CASES, NORMS, Recording, bwd_k, fwd_k  # noqa: E402

# The interpreter's `range(0, K, ...)` with a runtime K goes through a deprecated numpy conversion (the
# reason numpy 2.4 breaks it, docs/platform.md); not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TARGET = kc.Target(torch.device("cpu"), kc.INTERPRETER_TOL)
DTYPES = kc.parametrize_dtypes(F32, F16)


def _case_grid(cases):
    return kc.stack(pytest.mark.parametrize("case", list(cases)), DTYPES, NORMS)


# (m, k, n) of each case.
FWD_SHAPES = {
    "full": (33, 40, 40),
    "bare": (257, 40, 24),
    "mixed": (33, 40, 40),
    "no_save": (33, 17, 40),
    "out_f32": (33, 40, 40),
}
BWD_SHAPES = {"full": (33, 40, 40), "bare": (257, 40, 24), "mixed": (33, 17, 40), "dx_f32": (33, 40, 40)}
# Here "full" takes b = W.t() and "bare" a contiguous [K, N] b, the CUDA file's the other way round.
BWD_CASES = {
    **kc.BWD_CASES,
    "full": replace(kc.BWD_CASES["full"], b_t=True),
    "bare": replace(kc.BWD_CASES["bare"], b_t=False),
}


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    kc.poison_and_seed(monkeypatch)


@pytest.fixture(params=["single", "multi"])
def path(request, monkeypatch):
    """single: tuning's own config (N <= 256 fits one tile); multi: 16-wide N tiles."""
    kc.force_block_n(monkeypatch, None if request.param == "single" else 16)
    return request.param


def _assert_path(path, m, n, k, dtype, module):
    single = TARGET.single_tile(m, n, k, dtype, module._FORCE_BLOCK_N)
    assert single == (path == "single"), "the test does not exercise the path it names"


@_case_grid(FWD_CASES)
def test_forward_matches_reference(path, case, dtype, is_rms):
    m, k, n = FWD_SHAPES[case]
    _assert_path(path, m, n, k, dtype, fwd_k)
    TARGET.run_forward(FWD_CASES[case], m, k, n, dtype, is_rms)


@DTYPES
def test_forward_layernorm_large_mean(path, dtype):
    """Rows of 1000 + N(0, ~2): two-pass / Chan variance, h - tile_mean in the multi-tile scratch."""
    m, k, n = 65, 24, 40
    _assert_path(path, m, n, k, dtype, fwd_k)
    TARGET.check_layernorm_large_mean(m, k, n, dtype, w_max=4.0)


@_case_grid(BWD_CASES)
def test_backward_matches_reference(path, case, dtype, is_rms):
    m, k, n = BWD_SHAPES[case]
    _assert_path(path, m, n, k, dtype, bwd_k)
    TARGET.run_backward(BWD_CASES[case], m, k, n, dtype, is_rms)


class _Forbidden:
    """Stands in for a kernel that must not be launched."""

    def __getitem__(self, grid):
            raise AssertionError("a pointer-load kernel ran where a TMA kernel was expected")


@pytest.mark.parametrize("case", [c for c, v in FWD_CASES.items() if v.b_t and not v.col_major])
@pytest.mark.parametrize(
    "mkn", [(257, 40, 24), (33, 64, 40), (130, 72, 256), (66, 40, 37)], ids=lambda s: "x".join(map(str, s))
)
@NORMS
def test_forward_tma_single_tile(monkeypatch, case, mkn, is_rms):
    """The Hopper path (TMA-fed persistent loop), forced onto CPU tensors: M, N, K not multiples of the
    blocks (TMA zero-fills out of bounds, the y store clips), several row blocks per program (4 programs
    here); N = 37 has a y row pitch TMA cannot store (74 bytes), so y leaves through pointer stores."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    monkeypatch.setattr(fwd_k, "_mm_norm_fwd_fused_kernel", _Forbidden())
    seen = Recording(fwd_k._mm_norm_fwd_tma_kernel, "Y_TMA")
    monkeypatch.setattr(fwd_k, "_mm_norm_fwd_tma_kernel", seen)
    m, k, n = mkn
    TARGET.run_forward(FWD_CASES[case], m, k, n, F16, is_rms)
    out_bytes = 4 if FWD_CASES[case].out == "f32" else 2
    assert seen.values and all(v == (n * out_bytes % 16 == 0) for v in seen.values), seen.values


# ----------------------------------------------------------------------------------------------------------
# Degenerate shapes and plumbing
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:var_mean.*degrees of freedom")  # the reference's var_mean at M = 0
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 17), (0, 8, 24)], ids=lambda s: "x".join(map(str, s)))
@NORMS
def test_degenerate_shapes(path, shape, is_rms):
    """N = 1 (zero variance), a last N tile of one column (17 = 16 + 1 when multi), K = 1, M = 0 and 1."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(n, k).t()
    bias, residual, weight, norm_bias = torch.randn(n), torch.randn(m, n), torch.randn(n), torch.randn(n)
    TARGET.check_forward((a, b, bias, residual, weight, norm_bias, EPS, is_rms, None, True))

    x = torch.randn(m, n) * 2 + 0.5
    _, mean, rstd = kc.norm_reference(x, None, None, EPS, is_rms)
    TARGET.check_backward(
        (torch.randn(m, k), torch.randn(k, n), torch.randn(m, n), x, torch.randn(n), mean, rstd, is_rms,
         False, True, F32)
    )


@NORMS
def test_default_multi_tile_config(is_rms):
    """Tuning's own multi-tile config (N = 300 > 256: three 128-wide N tiles, the last one of 44)."""
    m, k, n = 33, 17, 300
    assert not TARGET.single_tile(m, n, k, F16)
    TARGET.run_forward(FWD_CASES["full"], m, k, n, F16, is_rms)
    TARGET.run_backward(kc.BWD_CASES["full"], m, k, n, F16, is_rms)


def test_outputs_come_from_alloc(path, monkeypatch):
    """The poisoning is only as good as the hook: every returned buffer must have come from ``_alloc``."""
    made = []

    def recording_alloc(shape, dtype, device):
        t = kc.nan_alloc(shape, dtype, device)
        made.append(t)
        return t

    kc.poison_allocs(monkeypatch, recording_alloc)
    for t in kc.mm_norm_tuned(*TARGET.fwd_args(FWD_CASES["full"], *FWD_SHAPES["full"], F32, False)):
        assert any(t is u for u in made)

    made.clear()
    m, k, n = BWD_SHAPES["full"]
    dx, dw, db = kc.mm_norm_backward_tuned(*TARGET.bwd_args(BWD_CASES["full"], m, k, n, F32, False))
    assert any(dx is u for u in made)
    # dw/db are host sums of [m_tiles, N] partial buffers, which must be poisoned too.
    partials = [u for u in made if u.dim() == 2 and u.shape[1] == n and u.shape[0] < m]
    assert len(partials) == 2


_TMA_FWD = [c for c, v in FWD_CASES.items() if not v.col_major]
_TMA_BWD = [c for c, v in BWD_CASES.items() if not v.col_major]


@pytest.mark.parametrize("case", _TMA_FWD)
@pytest.mark.parametrize("mkn", [(257, 40, 40), (130, 32, 72)], ids=lambda s: "x".join(map(str, s)))
@NORMS
def test_forward_tma_cooperative(monkeypatch, case, mkn, is_rms):
    """Rows wider than the N tile on the Hopper path: the cooperative kernel (the last program of a row
    block normalizes it), forced onto CPU tensors with 16-wide N tiles: 3-5 tiles per row, a partial last
    tile, several tiles per program; neither pointer kernel may run."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    kc.force_block_n(monkeypatch, 16)
    monkeypatch.setattr(fwd_k, "_mm_norm_fwd_partial_kernel", _Forbidden())
    monkeypatch.setattr(fwd_k, "_mm_norm_fwd_fused_kernel", _Forbidden())
    m, k, n = mkn
    TARGET.run_forward(FWD_CASES[case], m, k, n, F16, is_rms)


def test_forward_tma_cooperative_large_mean(monkeypatch):
    """|mean| >> std through the cooperative kernel's centred scratch and Chan combine."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    kc.force_block_n(monkeypatch, 16)
    monkeypatch.setattr(fwd_k, "_mm_norm_fwd_partial_kernel", _Forbidden())
    TARGET.check_layernorm_large_mean(65, 24, 40, F16, w_max=4.0)


@pytest.mark.parametrize("case", _TMA_BWD)
@pytest.mark.parametrize("block_n", [None, 16], ids=["row", "coop"])
@NORMS
def test_backward_tma(monkeypatch, case, block_n, is_rms):
    """The Hopper backward kernels forced onto CPU tensors: whole rows per tile (row) and 16-wide N tiles
    with the cooperative finalize (coop); b as a transposed weight and as a row-major [K, N] matrix."""
    monkeypatch.setattr(common, "_FORCE_TMA", True)
    kc.force_block_n(monkeypatch, block_n)
    for name in ("_mm_norm_bwd_fused_kernel", "_mm_norm_bwd_partial_kernel"):
        monkeypatch.setattr(bwd_k, name, _Forbidden())
    TARGET.run_backward(BWD_CASES[case], 257, 40, 40, F16, is_rms)
