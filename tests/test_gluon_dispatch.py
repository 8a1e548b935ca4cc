"""Which inputs the Gluon sm_90 path takes and which configurations it lists (kernels/hopper/mm_norm.py), on
the CPU: the device checks are stubbed to an sm_90 GPU and tensors are on the meta device (shapes, strides
and dtypes are all these rules read; storage alignment is checked only for real tensors)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402
from fusenorm_inductor.kernels.hopper import common as hopper_common  # noqa: E402
from fusenorm_inductor.kernels.hopper import launch as L  # noqa: E402
from fusenorm_inductor.kernels.hopper import mm_norm as hopper  # noqa: E402

pytestmark = pytest.mark.skipif(not _compat.available(), reason=f"no usable Gluon: {_compat.GLUON_ERROR}")

BF16 = torch.bfloat16


@pytest.fixture
def sm90(monkeypatch):
    """unsupported() sees an sm_90 GPU; meta tensors have no storage, so alignment is taken as given."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(hopper_common, "tma_ok", lambda t: True)


def _ab(m, k, n, dtype=BF16, b_t=True):
    a = torch.empty((m, k), device="meta", dtype=dtype)
    b = torch.empty((n, k), device="meta", dtype=dtype).t() if b_t else torch.empty((k, n), device="meta", dtype=dtype)
    return a, b


class _CudaView:
    """Forwards everything to a meta tensor but says it is on CUDA."""

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)

    @property
    def device(self):
        return torch.device("cuda", 0)


def _as_cuda(t):
    return _CudaView(t) if t is not None else None


def _why(a, b, residual=None, out_dtype=None):
    return hopper.unsupported(_as_cuda(a), _as_cuda(b), None, residual, None, None, out_dtype, False)


@pytest.mark.parametrize("n", [40, 64, 96, 128, 200, 256, 320, 512, 1000, 1024, 2048, 3000, 4096, 8192])
@pytest.mark.parametrize("k", [40, 512])
def test_takes_aligned_16bit_inputs(sm90, n, k):
    a, b = _ab(1000, k, n)
    assert _why(a, b) is None
    a, b = _ab(1000, k, n, dtype=torch.float16, b_t=False)
    assert _why(a, b) is None


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: _ab(257, 200, 128, dtype=torch.float32), "float32"),
        (lambda: _ab(257, 196 + 2, 128), "multiple of 8"),
        (lambda: _ab(257, 200, 100), "multiple of 8"),
        (lambda: (_ab(257, 200, 128)[0].t().contiguous().t(), _ab(257, 200, 128)[1]), "row-major"),
        (lambda: _ab(257, 200, 9216), "N=9216"),
        (lambda: _ab(257, 200, 4352), "N=4352"),
        (lambda: _ab(257, 200, 4616), "N=4616"),
    ],
    ids=["fp32", "k_odd", "n_odd", "a_colmajor", "n_9216", "n_4352", "n_4616"],
)
def test_declines_with_a_reason(sm90, make, reason):
    a, b = make()
    why = _why(a, b)
    assert why is not None and reason in why, why


def test_declines_other_output_dtype_and_residual(sm90):
    a, b = _ab(257, 200, 128)
    assert "output dtype" in _why(a, b, out_dtype=torch.float32)
    res = torch.empty((257, 128), device="meta", dtype=torch.float32)
    assert "residual" in _why(a, b, residual=_as_cuda(res))


def test_declines_off_sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    a, b = _ab(257, 200, 128)
    assert "sm_90" in _why(a, b)


@pytest.mark.parametrize("n", [40, 64, 96, 128, 200, 256])
@pytest.mark.parametrize("save", [False, True])
def test_one_tile_candidates(n, save):
    a, b = _ab(262144, 512, n)
    cands = hopper.candidates(a, b, save)
    assert cands, n
    for c in cands:
        assert c.kind in ("gl_coop", "gl_pp") and c.block_n >= n and c.block_n == hopper.pow2_tile(n)
        shape = hopper.launch_shape(c, n, save, False)
        assert shape.num_out == 1 or save
        staging = shape.ncons * shape.num_out
        assert L.smem_bytes(c.block_m, c.block_n, c.block_k, c.stages, staging) <= L.SMEM_LIMIT
        assert c.stages >= 2


@pytest.mark.parametrize("n, size", [(320, 2), (512, 2), (1000, 4), (2048, 8), (3000, 6), (4096, 8), (8192, 8)])
@pytest.mark.parametrize("save", [False, True])
def test_cluster_candidates(n, size, save):
    a, b = _ab(262144, 1024, n)
    cands = hopper.candidates(a, b, save)
    assert [(c.kind, c.block_m, c.block_n, c.warps) for c in cands] == [
        ("gl_cluster", 128, 256, 8), ("gl_cluster", 64, 256, 4)]
    for c in cands:
        shape = hopper.launch_shape(c, n, save, False)
        assert shape.cluster == size and shape.sync and c.stages >= 3
        assert shape.cluster * shape.span * c.block_n >= n > (shape.cluster * shape.span - 1) * c.block_n
        assert L.smem_bytes(c.block_m, c.block_n, c.block_k, c.stages, shape.num_out) <= L.SMEM_LIMIT


def test_hh_shares_the_staging_tile_only_where_two_do_not_fit():
    """save_normed: hh gets its own staging tile where that leaves >= 3 stages, else y and hh take turns."""
    a, b = _ab(262144, 1024, 1024)
    wide, narrow = hopper.candidates(a, b, True)
    assert hopper.launch_shape(wide, 1024, True, False).num_out == 1  # 128x256: 2 x 64 KiB staging + 3 stages > 227
    assert hopper.launch_shape(narrow, 1024, True, False).num_out == 2
    assert hopper.launch_shape(wide, 1024, False, False).num_out == 1
    assert hopper.launch_shape(narrow, 1024, True, True).num_out == 1  # the GEMM base writes y alone


def test_cluster_size_rules():
    assert hopper.cluster_size(256) == 1 and hopper.cluster_size(40) == 1
    assert hopper.cluster_size(257) == 2 and hopper.cluster_size(2048) == 8
    assert hopper.cluster_shape(2304) == (3, 3)  # 9 tiles: more than a portable cluster, 3 x 3
    # wider rows: the fewest tiles per CTA that fit a cluster of <= 8 (16-CTA clusters lost: not offered)
    assert hopper.cluster_shape(4096) == (8, 2) and hopper.cluster_shape(8192) == (8, 4)
    assert hopper.cluster_shape(3000) == (6, 2) and hopper.cluster_shape(5000) == (5, 4)
    assert hopper.cluster_shape(4352) is None  # 17 tiles
    assert hopper.cluster_shape(9216) is None  # 36 tiles: 5 per CTA, over MAX_SPAN


def test_vectors_padded_to_whole_tiles():
    v = torch.arange(200, dtype=torch.float32)
    p = hopper_common.padded(v, 256)
    assert p.shape == (256,) and torch.equal(p[:200], v) and not p[200:].any()
    assert hopper_common.padded(v[:128], 128).data_ptr() == v.data_ptr()  # already whole: no copy


def test_register_budget():
    assert L.maxnreg(8) == 240 and L.maxnreg(12) == 168
    assert L.padded_warps(1) == 4 and L.padded_warps(8) == 8


@pytest.mark.parametrize("n, kind, save, gemm_only", [(128, "gl_pp", True, False), (1024, "gl_cluster", True, False),
                                                       (1024, "gl_cluster", False, True), (256, "gl_coop", False, False)])
def test_kernel_args_fill_every_parameter(n, kind, save, gemm_only):
    """The launcher's argument tuple has one value per kernel parameter (num_warps comes as an option), and its
    compile-time values are those the offline compile builds (both come from launch_shape)."""
    from fusenorm_inductor.kernels.triton.common import GemmConfig

    m, k = 300, 64
    a = torch.randn(m, k).to(BF16)
    b = torch.randn(n, k).to(BF16).t()
    y, hh = torch.empty(m, n, dtype=BF16), torch.empty(m, n, dtype=BF16)
    mean, rstd = torch.empty(m), torch.empty(m)
    cfg = next(c for c in hopper.candidates(a, b, save) if c.kind == kind)
    shape = hopper.launch_shape(cfg, n, save, gemm_only)
    args = hopper.kernel_args(a, b, None, None, torch.ones(n), None, 1e-5, True, y, hh, mean, rstd, rstd, rstd, cfg,
                              shape)
    names = list(hopper.mm_norm_kernel.arg_names)
    assert names[-1] == "num_warps" and len(args) == len(names) - 1
    got = dict(zip(names, args))
    assert (got["C"], got["NCONS"], got["NORM"], got["SYNC"], got["SAVE_NORMED"], got["LOAD_WARPS"]) == (
        shape.cluster, shape.ncons, not gemm_only, shape.cluster > 1 and not gemm_only, save and not gemm_only,
        4 if shape.sync else 1)
    assert got["M"] == m and got["N"] == n and got["K"] == k and got["HAS_W"] and not got["HAS_BIAS"]
