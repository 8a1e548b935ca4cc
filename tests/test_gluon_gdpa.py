"""The sm_90 Gluon GDPA kernels (kernels/hopper/gdpa.py) on the H200: numerics of the forward and of the
backward (dQ, dK/dV) against the fp64 dense oracle with test_gdpa.py's per-element error bounds, the op's
dispatch to the forward, and its fallbacks.

Outputs are NaN-poisoned before the kernel writes them, so a row no program stores fails; lengths include 0, 1,
a single partial tile, a length that is a multiple of the 64-row tile (no partial tile) and sequences that span
several programs (8 tiles of 64 rows each). The compile of every variant for sm_90a runs on the CPU in
test_gluon_compile.py.
"""

import pytest

torch = pytest.importorskip("torch")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402
from tests.test_gdpa import (  # noqa: E402
    BF16,
    F16,
    SCALE,
    assert_within,
    check_all,
    error_bounds,
    make_inputs,
    oracle_with_grads,
)
from fusenorm_inductor.activations import ACTIVATIONS, activation_code  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (SM90 and _compat.available()),
                                reason="needs an sm_90 GPU and a triton with Gluon")


class Refuse:
    """Stands in for a Triton kernel that must not run here: launching it (``kernel[grid](...)``) fails the test."""

    def __init__(self, why: str):
        self.why = why

    def __getitem__(self, grid):
        raise AssertionError(self.why)


def _poisoned(shape, dtype, device):
    """The ops' output allocator with NaN in every element: what a kernel leaves unwritten shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _gluon(q, k, v, offs, maxlen, activation, scale=SCALE):
    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    o = torch.full_like(q, float("nan"))
    hopper.gdpa_fwd_gluon(q, k, v, offs, o, maxlen, activation_code(activation), scale)
    return o


def _check(lengths, s, h, d, dtype, activation, seed=0, run=_gluon):
    q, k, v, dout, offs, maxlen = make_inputs(lengths, s, h, d, dtype, "cuda", seed=seed)
    got = run(q, k, v, offs, maxlen, activation)
    want = oracle_with_grads(q, k, v, dout, offs, activation, SCALE)[0]
    bound = error_bounds(q, k, v, dout, offs, activation, SCALE, dtype, dtype)["o"]
    assert got.dtype == dtype
    assert_within("o", got, want, 2.0 * bound)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_every_activation(dtype, d, activation):
    g = torch.Generator().manual_seed(d)
    lengths = [300, 0, 1, 128, 65] + torch.randint(0, 301, (4,), generator=g).tolist()
    _check(lengths, 128, 2, d, dtype, activation, seed=d)


@pytest.mark.parametrize("s", [16, 32, 64])
def test_short_kv_and_long_sequences(s):
    """Sequences over several programs (512 rows each) and K/V shorter than the Q tile."""
    _check([1100, 3, 513, 512], s, 3, 128, BF16, "fast_gelu", seed=s)


@pytest.mark.parametrize("h", [1, 2])
def test_many_items_per_program(h):
    """More work items than SMs, so each persistent program walks several: sequences of 1-70 tokens (one
    consumer often without a tile) between long ones, K and V changing per item."""
    g = torch.Generator().manual_seed(h)
    lengths = torch.randint(1, 71, (400,), generator=g).tolist()
    lengths[::50] = [300] * 8
    _check(lengths, 64, h, 64, BF16, "fast_gelu", seed=h)


def test_one_head_one_sequence_and_last_rows():
    """H = 1, and a last sequence that ends at T inside a tile (TMA zero-fills the rows past T)."""
    _check([77], 128, 1, 64, BF16, "silu", seed=5)
    _check([64, 129], 64, 1, 128, F16, "gelu", seed=6)


def test_op_dispatches_to_gluon(monkeypatch):
    """The op takes the Gluon kernel for bf16, D = 128, S = 128: the Triton forward kernel must not run."""
    from fusenorm_inductor.kernels.triton import gdpa as gk
    from fusenorm_inductor.ops.gdpa import gdpa

    monkeypatch.setattr(gk, "_gdpa_fwd_kernel",
                        Refuse("the Triton forward ran where the Gluon kernel takes the inputs"))
    monkeypatch.setattr(gk, "_alloc", _poisoned)
    assert gk.gluon_unsupported(torch.empty(1, 2, 128, device="cuda", dtype=BF16),
                                torch.empty(1, 128, 2, 128, device="cuda", dtype=BF16)) is None
    _check([200, 0, 31], 128, 2, 128, BF16, "fast_gelu", run=lambda q, k, v, o, m, a: gdpa(q, k, v, o, m, a, SCALE))
    # the cached plan on fresh tensors of the same signature (new addresses, new values)
    _check([200, 0, 31], 128, 2, 128, BF16, "fast_gelu", seed=9,
           run=lambda q, k, v, o, m, a: gdpa(q, k, v, o, m, a, SCALE))


def test_bad_offsets_stay_inside_the_buffers():
    """Unvalidated offsets (decreasing, past T) are clamped: no memory error, rows of q only."""
    q, k, v, _, _, _ = make_inputs([40, 40], 64, 2, 64, BF16, "cuda")
    bad = torch.tensor([0, 70, 10_000], dtype=torch.int32, device="cuda")
    o = torch.zeros(q.shape[0] + 64, *q.shape[1:], device="cuda", dtype=BF16)[: q.shape[0]]
    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    hopper.gdpa_fwd_gluon(q, k, v, bad, o, 200, activation_code("relu"), 1.0)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    # decreasing offsets: an empty second sequence, nothing written past T
    bad = torch.tensor([0, 70, 5], dtype=torch.int32, device="cuda")
    hopper.gdpa_fwd_gluon(q, k, v, bad, o, 200, activation_code("relu"), 1.0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("what", ["s256", "s40", "d32", "fp32"])
def test_unsupported_inputs_fall_back(what, monkeypatch):
    """Inputs outside the kernel get a reason from ``gluon_unsupported`` and the op's Triton kernel runs."""
    from fusenorm_inductor.kernels.triton import gdpa as gk
    from fusenorm_inductor.ops.gdpa import gdpa

    s, d, dtype = {"s256": (256, 64, BF16), "s40": (40, 64, BF16), "d32": (128, 32, BF16),
                   "fp32": (128, 64, torch.float32)}[what]
    q, k, v, dout, offs, maxlen = make_inputs([70, 5], s, 2, d, dtype, "cuda")
    assert gk.gluon_unsupported(q, k) is not None
    got = gdpa(q, k, v, offs, maxlen, "gelu", SCALE)
    want = oracle_with_grads(q, k, v, dout, offs, "gelu", SCALE)[0]
    bound = error_bounds(q, k, v, dout, offs, "gelu", SCALE, dtype, dtype)["o"]
    assert_within("o", got, want, 2.0 * bound)


def test_misaligned_view_takes_the_triton_kernel():
    """q at an odd storage offset (contiguous, but 2 bytes past a 16-byte boundary): TMA cannot address it, so
    the op runs the Triton forward, with the same results."""
    from fusenorm_inductor.ops.gdpa import gdpa

    q, k, v, dout, offs, maxlen = make_inputs([70, 5], 128, 2, 64, BF16, "cuda")
    flat = torch.empty(q.numel() + 1, device="cuda", dtype=BF16)
    q_odd = flat[1:].view(q.shape)
    q_odd.copy_(q)
    got = gdpa(q_odd, k, v, offs, maxlen, "gelu", SCALE)
    want = oracle_with_grads(q, k, v, dout, offs, "gelu", SCALE)[0]
    assert_within("o", got, want, 2.0 * error_bounds(q, k, v, dout, offs, "gelu", SCALE, BF16, BF16)["o"])


def test_switch_off_takes_the_triton_kernel():
    from fusenorm_inductor import config
    from fusenorm_inductor.kernels.triton import gdpa as gk

    q = torch.empty(4, 2, 128, device="cuda", dtype=BF16)
    k = torch.empty(1, 128, 2, 128, device="cuda", dtype=BF16)
    with config.patch(gluon=False):
        assert "config.gluon" in gk.gluon_unsupported(q, k)


# ---- the backward (dQ, dK/dV) ----


def _check_backward(lengths, s, h, d, dtype, activation, seed=0):
    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    q, k, v, dout, offs, maxlen = make_inputs(lengths, s, h, d, dtype, "cuda", seed=seed)
    assert hopper.backward_unsupported(q, k) is None
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    hopper.gdpa_bwd_gluon(dout, q, k, v, offs, dq, dk, dv, maxlen, activation_code(activation), SCALE)
    want = oracle_with_grads(q, k, v, dout, offs, activation, SCALE)
    bounds = error_bounds(q, k, v, dout, offs, activation, SCALE, dtype, dtype)
    check_all((None, dq, dk, dv), want, bounds)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_backward_every_activation(dtype, d, activation):
    """Lengths 0 (dK/dV zeros), 1, a partial tile, a multiple of the tile, and longer; S = 128 (two dK/dV
    warpgroups)."""
    g = torch.Generator().manual_seed(d + 1)
    lengths = [300, 0, 1, 128, 65] + torch.randint(0, 301, (4,), generator=g).tolist()
    _check_backward(lengths, 128, 2, d, dtype, activation, seed=d)


def test_backward_one_warpgroup_and_long_sequences():
    """S = 64 (one dK/dV warpgroup), sequences over several dQ work items, H = 3."""
    _check_backward([1100, 3, 513, 0, 64], 64, 3, 128, BF16, "fast_gelu", seed=3)


def test_op_backward_dispatches_to_gluon(monkeypatch):
    """The op's autograd backward takes the Gluon kernels for bf16, D = 128, S = 128 (the Triton backward kernels
    must not run), into NaN-poisoned gradients, against the oracle; with the switch off the Triton kernels give
    the same gradients within the same bounds."""
    from fusenorm_inductor.kernels.triton import gdpa as gk
    from tests.test_gdpa import op_with_grads

    refuse = Refuse("a Triton backward kernel ran where the Gluon backward takes the inputs")
    monkeypatch.setattr(gk, "_alloc", _poisoned)
    q, k, v, dout, offs, maxlen = make_inputs([200, 0, 31, 1, 128], 128, 2, 128, BF16, "cuda", seed=11)
    want = oracle_with_grads(q, k, v, dout, offs, "fast_gelu", SCALE)
    bounds = error_bounds(q, k, v, dout, offs, "fast_gelu", SCALE, BF16, BF16)
    with monkeypatch.context() as m:
        m.setattr(gk, "_gdpa_bwd_dq_kernel", refuse)
        m.setattr(gk, "_gdpa_bwd_dkdv_kernel", refuse)
        check_all(op_with_grads(q, k, v, dout, offs, maxlen, "fast_gelu", SCALE), want, bounds)
    monkeypatch.setattr(gk, "GLUON_BACKWARD", False)
    check_all(op_with_grads(q, k, v, dout, offs, maxlen, "fast_gelu", SCALE), want, bounds)


def test_backward_rejects_other_kv_lengths():
    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    q, k, *_ = make_inputs([5], 32, 2, 64, BF16, "cuda")
    assert "64 or 128" in hopper.backward_unsupported(q, k)


# ---- FlashNormAttention's attention step (GLUON_ATTENTION) ----


@pytest.mark.parametrize("stage", [False, True], ids=["stats-global", "stats-staged"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("h", [1, 2])
def test_flash_norm_attention_on_the_gluon_attention(monkeypatch, h, affine, stage):
    """The fused block's forward with its attention step on the Gluon kernel, against the reference, with the
    bounds test_flash_norm_attention.py uses for the Triton kernels (8 bf16 units); the LayerNorm statistics
    read per tile from global memory or staged in shared memory by the loader (hopper.gdpa.STAGE_STATS)."""
    from fusenorm_inductor.kernels.triton import flash_norm_attention as kern
    from fusenorm_inductor.ops.flash_norm_attention import flash_norm_attention_reference
    from tests.test_flash_norm_attention import _call, _close, _inputs

    monkeypatch.setattr(kern, "GLUON_ATTENTION", True)
    monkeypatch.setattr(kern, "GLUON_BLOCK", False)  # at H = 1 the whole block would run instead of the step
    monkeypatch.setattr(kern, "_alloc", _poisoned)
    calls = []
    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    monkeypatch.setattr(hopper, "STAGE_STATS", stage)
    real = hopper.fna_attention_gluon
    monkeypatch.setattr(hopper, "fna_attention_gluon", lambda *a: calls.append(1) or real(*a))
    lengths = (300, 0, 1, 157, 64, 299, 12, 200, 1100)
    q, k, v, off, max_len, ws = _inputs(lengths, 128, h, 128, dtype=BF16, device="cuda", seed=10 + h,
                                        affine=affine)
    got = _call(kern.flash_norm_attention_triton, q, k, v, off, max_len, ws, "fast_gelu")
    want = _call(flash_norm_attention_reference, q, k, v, off, max_len, ws, "fast_gelu")
    assert calls, "the Gluon attention did not run"
    for name, gg, ww, u_dtype, c in zip(("out", "ln_mean", "ln_rstd", "rms_rstd", "rms_in"), got, want,
                                        (BF16, torch.float32, torch.float32, BF16, BF16), (8, 16, 16, 8, 8)):
        _close(gg, ww, u_dtype, c, name)


# ---- the whole block in one kernel where H = 1 (GLUON_BLOCK) ----


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("d", [64, 128])
def test_flash_norm_attention_whole_block_at_one_head(monkeypatch, d, affine, activation):
    """H = 1: the LayerNorm's statistics from the tile, the attention, the RMSNorm and both residuals in one Gluon
    launch (no per-token kernels), every output against the reference with test_flash_norm_attention.py's bounds
    (8 bf16 units; the statistics 16 fp32 units); lengths 0, 1, a partial tile, several items."""
    from fusenorm_inductor.kernels.triton import flash_norm_attention as kern
    from fusenorm_inductor.ops.flash_norm_attention import flash_norm_attention_reference
    from tests.test_flash_norm_attention import _call, _close, _inputs

    monkeypatch.setattr(kern, "GLUON_BLOCK", True)
    monkeypatch.setattr(kern, "_alloc", _poisoned)

    # erf GELU at D = 128 spills 8 bytes on triton 3.6 (test_gluon_compile): refused at launch, the three
    # launches run instead, and that fallback's results are what is checked there
    spills = activation == "gelu" and d == 128
    if not spills:
        refuse = Refuse("a per-token Triton kernel ran where the whole block runs in one Gluon kernel")
        monkeypatch.setattr(kern, "_stats_kernel", refuse)
        monkeypatch.setattr(kern, "_fwd_finish_kernel", refuse)
    lengths = (300, 0, 1, 157, 64, 299, 12, 200, 1100)
    q, k, v, off, max_len, ws = _inputs(lengths, 128, 1, d, dtype=BF16, device="cuda", seed=d + affine,
                                        affine=affine)
    got = _call(kern.flash_norm_attention_triton, q, k, v, off, max_len, ws, activation)
    want = _call(flash_norm_attention_reference, q, k, v, off, max_len, ws, activation)
    for name, gg, ww, u_dtype, c in zip(("out", "ln_mean", "ln_rstd", "rms_rstd", "rms_in"), got, want,
                                        (BF16, torch.float32, torch.float32, BF16, BF16), (8, 16, 16, 8, 8)):
        _close(gg, ww, u_dtype, c, name)
