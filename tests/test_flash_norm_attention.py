"""``fusenorm::flash_norm_attention`` (FlashNormAttention, the fused PFFN attention block) and its backward.

- The reference against an independent fp64 computation (a loop over sequences with F.layer_norm, per-head
  einsum attention, F.rms_norm), every activation, affine on/off; its statistics.
- Autograd (the op's backward op, run by the reference's explicit formulas on CPU) against fp64 torch autograd
  through the reference: q, k, v and the three weights.
- Jagged edge cases (empty sequences, length 1, B = 1, T = 0, H = 1), validation errors.
- The Triton kernels under the interpreter (CPU, fp32/fp16; bf16 is broken in the Triton 3.6 interpreter),
  B = 3, lengths (0, 1, 37), S = 24, H = 2, D = 16, 16 x 16 tiles (several Q and S tiles), outputs NaN-poisoned,
  forward and backward against the reference (same roundings), both forward staging precisions, strided q.
- CUDA (skipped without CUDA): bf16, B = 8, lengths up to 300, S = 128, H in {1, 2, 4}, D = 128, forward and
  every gradient against the reference computed on the GPU in fp32.
- torch.compile (aot_eager, fullgraph) and ``torch.library.opcheck``: fake impls and autograd are traceable.

Tolerances are per tensor: |got - want| <= c * u * (|want| + max |want|), u the compared dtype's unit
roundoff (fp32: 2^-24), c stated at each use (the kernel and the reference make the same roundings; what
differs is fp32 summation order and the rare rounding of an intermediate that falls the other way).
"""

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    # Triton reads the switch when a kernel is decorated (conftest.py normally sets it first).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("fusenorm_inductor.activations", "fusenorm_inductor.kernels.triton.flash_norm_attention"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from fusenorm_inductor.ops import flash_norm_attention as fna  # noqa: E402
from fusenorm_inductor.activations import ACTIVATIONS, act_reference  # noqa: E402
from fusenorm_inductor.ops.flash_norm_attention import (  # noqa: E402
    flash_norm_attention,
    flash_norm_attention_backward,
    flash_norm_attention_op,
    flash_norm_attention_reference,
)

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
U = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24, F64: 2.0**-53}
LN_EPS, RMS_EPS, SCALE = 1e-5, 1e-6, 0.5
INTERPRETER = pytest.mark.skipif(CUDA, reason="CUDA is available: the CUDA tests cover the kernels")
ON_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
ACTS = pytest.mark.parametrize("activation", ACTIVATIONS)
AFFINE = pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])


def _offsets(lengths, device="cpu"):
    off = [0]
    for n in lengths:
        off.append(off[-1] + n)
    return torch.tensor(off, dtype=torch.int32, device=device)


def _inputs(lengths, s, h, d, dtype=F32, affine=True, device="cpu", w_dtype=F32, seed=0):
    """q ~ N(1, 1) (a nonzero mean for the LayerNorm), k small enough that act() sees |S| ~ 1, weights ~ 1."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    t, b = sum(lengths), len(lengths)
    q = (1 + r(t, h, d)).to(device, dtype)
    k = (r(b, s, h, d) / d**0.5).to(device, dtype)
    v = r(b, s, h, d).to(device, dtype)
    ws = (None, None, None)
    if affine:
        ws = tuple(w.to(device, w_dtype) for w in (1 + 0.3 * r(h * d), 0.2 * r(h * d), 1 + 0.3 * r(h * d)))
    return q, k, v, _offsets(lengths, device), max(lengths, default=0), ws


def _fp64_loop(q, k, v, off, ws, activation):
    """Independent oracle: each sequence densely, fp64, torch's own norms."""
    t, h, d = q.shape
    w1, b1, w2 = (w.double() if w is not None else None for w in ws)
    outs = []
    for b in range(k.shape[0]):
        x = q[off[b]:off[b + 1]].double().reshape(-1, h * d)
        ln = F.layer_norm(x, (h * d,), w1, b1, LN_EPS).reshape(-1, h, d)
        s = torch.einsum("lhd,shd->lhs", ln, k[b].double())
        o = torch.einsum("lhs,shd->lhd", act_reference(s, activation) * SCALE, v[b].double()) + ln
        outs.append((F.rms_norm(o.reshape(-1, h * d), (h * d,), w2, RMS_EPS) + x).reshape(-1, h, d))
    return torch.cat(outs) if outs else q.double().new_zeros(q.shape)


def _close(got, want, dtype, c, name=""):
    """|got - want| <= c * u(dtype) * (|want| + max |want|), elementwise, and both finite."""
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if want.numel() == 0:
        assert got.numel() == 0
        return
    bound = c * U[dtype] * (want.abs() + want.abs().max())
    err = (got - want).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    if os.environ.get("FNA_TOL_REPORT"):
        print(f"TOL {name} {dtype} c={c} worst={worst:.3f}")
    msg = f"{name}: error {err.max().item():.3g} is {worst:.2f}x the bound (c = {c}, {dtype})"
    assert bool((err <= bound).all()), msg


def _call(fn, q, k, v, off, max_len, ws, activation, **kw):
    return fn(q, k, v, off, max_len, *ws, LN_EPS, RMS_EPS, activation, SCALE, **kw)


# ----------------------------------------------------------------------------------------------------------
# Reference and op on CPU
# ----------------------------------------------------------------------------------------------------------


@AFFINE
@ACTS
def test_reference_matches_fp64_loop(activation, affine):
    q, k, v, off, max_len, ws = _inputs((5, 0, 33, 1), 24, 2, 16, affine=affine)
    out, mean, rstd, r2, rms_in = _call(flash_norm_attention_op, q, k, v, off, max_len, ws, activation)
    # fp32 through LayerNorm, two GEMMs of <= 24 terms and RMSNorm (seen: <= 2 u32 of the bound's scale).
    _close(out, _fp64_loop(q, k, v, off, ws, activation), F32, 16, "out")
    x = q.double().reshape(q.shape[0], -1)
    _close(mean, x.mean(1), F32, 16, "ln_mean")
    _close(rstd, torch.rsqrt(x.var(1, unbiased=False) + LN_EPS), F32, 16, "ln_rstd")
    assert out.dtype == F32 and mean.dtype == rstd.dtype == r2.dtype == F32 and r2.shape == (q.shape[0],)
    # rms_in is o, the RMSNorm's input: out - q = o * rms_rstd * rms_weight.
    y = (rms_in * r2[:, None, None]).reshape(q.shape[0], -1)
    if ws[2] is not None:
        y = y * ws[2]
    _close((out - q).reshape(q.shape[0], -1), y, F32, 16, "rms_in")


def _leaves(q, k, v, ws, dtype):
    return [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (q, k, v, *ws)]


@AFFINE
@ACTS
def test_gradients_match_fp64_autograd(activation, affine):
    q, k, v, off, max_len, ws = _inputs((5, 0, 33, 1), 24, 2, 16, affine=affine, seed=1)
    got_leaves = _leaves(q, k, v, ws, F32)
    out = _call(flash_norm_attention, *got_leaves[:3], off, max_len, got_leaves[3:], activation)
    want_leaves = _leaves(q, k, v, ws, F64)
    want_out = _call(flash_norm_attention_reference, *want_leaves[:3], off, max_len, want_leaves[3:], activation)[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    live = [i for i, t in enumerate(got_leaves) if t is not None]
    got = torch.autograd.grad(out, [got_leaves[i] for i in live], dout)
    want = torch.autograd.grad(want_out, [want_leaves[i] for i in live], dout.double())
    names = ["q", "k", "v", "ln_weight", "ln_bias", "rms_weight"]
    for i, gg, ww in zip(live, got, want):
        # Sums over <= 37 tokens of products through both norms (seen: <= 4 u32).
        _close(gg, ww, F32, 16, f"grad {names[i]}")


@pytest.mark.parametrize(
    "lengths,h", [((0, 0), 2), ((1,), 2), ((7,), 1), ((0, 1, 0, 3), 1), ((4, 0), 3)],
    ids=["T0", "len1", "B1-H1", "empties-H1", "H3"],
)
def test_jagged_edge_cases(lengths, h):
    q, k, v, off, max_len, ws = _inputs(lengths, 5, h, 8, seed=2)
    leaves = _leaves(q, k, v, ws, F32)
    out = _call(flash_norm_attention, *leaves[:3], off, max_len, leaves[3:], "silu")
    assert out.shape == q.shape
    _close(out, _fp64_loop(q, k, v, off, ws, "silu"), F32, 16, "out")
    grads = torch.autograd.grad(out.sum(), leaves)
    for leaf, gr in zip(leaves, grads):
        assert gr.shape == leaf.shape and torch.isfinite(gr).all()
    # The KV rows of an empty sequence get no gradient.
    for b, n in enumerate(lengths):
        if n == 0:
            assert grads[1][b].abs().max() == 0 and grads[2][b].abs().max() == 0


def test_validation():
    q, k, v, off, max_len, ws = _inputs((3, 0, 2), 4, 2, 8)
    w1, b1, w2 = ws

    def call(**kw):
        a = dict(q=q, k=k, v=v, q_offsets=off, max_seq_len_q=max_len, ln_weight=w1, ln_bias=b1, rms_weight=w2,
                 activation="fast_gelu")
        a.update(kw)
        return flash_norm_attention(**a)

    with pytest.raises(ValueError, match="non-decreasing"):
        call(q_offsets=torch.tensor([0, 3, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="end at T"):
        call(q_offsets=torch.tensor([0, 3, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="start at 0"):
        call(q_offsets=torch.tensor([1, 3, 3, 5], dtype=torch.int32))
    with pytest.raises(TypeError, match="'q_offsets' must have dtype"):
        call(q_offsets=off.long())
    with pytest.raises(ValueError, match="'q_offsets' must have shape"):
        call(q_offsets=off[:-1])
    with pytest.raises(ValueError, match="max_seq_len_q"):
        call(max_seq_len_q=2)
    with pytest.raises(TypeError, match="'ln_weight' must have dtype"):
        call(ln_weight=w1.half())
    with pytest.raises(TypeError, match="'rms_weight' must have dtype"):
        call(rms_weight=w2.double())
    with pytest.raises(ValueError, match="'ln_bias' must have shape"):
        call(ln_bias=b1[:-1])
    with pytest.raises(ValueError, match="unknown activation 'softmax'"):
        call(activation="softmax")
    with pytest.raises(TypeError, match="'k' must have dtype"):
        call(k=k.half())
    with pytest.raises(ValueError, match=r"must both be \[B, S, H, D\]"):
        call(v=v[:, :, :1])
    with pytest.raises(ValueError, match="exceeds 256"):
        call(k=torch.zeros(3, 257, 2, 8), v=torch.zeros(3, 257, 2, 8))
    with pytest.raises(ValueError, match="'q' must be 3-D"):
        call(q=q.reshape(q.shape[0], -1))
    with pytest.raises(ValueError, match="eps"):
        call(ln_eps=-1.0)


# ----------------------------------------------------------------------------------------------------------
# Tracing: fake impls, autograd registration, torch.compile
# ----------------------------------------------------------------------------------------------------------


def test_opcheck():
    q, k, v, off, max_len, ws = _inputs((3, 0, 5), 6, 2, 8)
    args = (q, k, v, off, max_len, *ws, LN_EPS, RMS_EPS, "gelu", SCALE)
    torch.library.opcheck(flash_norm_attention_op, args)
    out, mean, rstd, r2, rms_in = flash_norm_attention_op(*args)
    torch.library.opcheck(flash_norm_attention_backward,
                          (torch.randn_like(out), q, k, v, off, max_len, *ws, mean, rstd, r2, rms_in, "gelu", SCALE))


def test_torch_compile_matches_eager():
    q, k, v, off, max_len, ws = _inputs((3, 0, 9), 6, 2, 8, seed=4)

    def block(q, k, v, w1, b1, w2):
        out = flash_norm_attention(q, k, v, off, max_len, w1, b1, w2, LN_EPS, RMS_EPS, "fast_gelu", SCALE)
        return (out * out).sum()

    leaves = _leaves(q, k, v, ws, F32)
    eager = block(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    leaves_c = _leaves(q, k, v, ws, F32)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(*leaves_c)
    grads = torch.autograd.grad(compiled, leaves_c)
    torch.testing.assert_close(compiled, eager)
    for gc, ge in zip(grads, eager_grads):
        torch.testing.assert_close(gc, ge)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


def _kernels(monkeypatch):
    """The kernel module with every launcher-allocated output and scratch NaN-poisoned."""
    pytest.importorskip("triton")
    from fusenorm_inductor.kernels.triton import flash_norm_attention as kern

    monkeypatch.setattr(kern, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                device=device))
    return kern


def _check_kernels(kern, q, k, v, off, max_len, ws, activation, c_fwd, c_bwd, config=None):
    """Forward and backward launchers against the reference (forward) and the explicit backward reference,
    the latter computed from the reference's statistics; every output finite (nothing left unwritten)."""
    dtype = q.dtype
    got = _call(kern.flash_norm_attention_triton, q, k, v, off, max_len, ws, activation, config=config)
    want = _call(flash_norm_attention_reference, q, k, v, off, max_len, ws, activation)
    # The LayerNorm statistics see only q (fp32 sums, 16 u32); out and rms_rstd see the roundings in q's dtype.
    for name, gg, ww, u_dtype, c in zip(("out", "ln_mean", "ln_rstd", "rms_rstd", "rms_in"), got, want,
                                        (dtype, F32, F32, dtype, dtype), (c_fwd, 16, 16, c_fwd, c_fwd)):
        _close(gg, ww, u_dtype, c, name)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.device, dtype)
    stats = tuple(w.float() for w in want[1:4])
    args = (dout, q, k, v, off, max_len, *ws, *stats, want[4], activation, SCALE)
    got = kern.flash_norm_attention_backward_triton(*args, config=config, dkdv_config=config)
    want = fna.flash_norm_attention_backward_reference(*args)
    for name, gg, ww in zip(("dq", "dk", "dv", "d_ln_weight", "d_ln_bias", "d_rms_weight"), got, want):
        if ww is None:
            assert gg is None, name
            continue
        assert gg.dtype == ww.dtype and gg.shape == ww.shape, name
        # Relative to q's dtype, also for fp32 weight gradients (they sum terms carrying its roundings).
        _close(gg, ww, dtype, c_bwd, name)


INTERP_LENGTHS = (0, 1, 37)
# fp32: summation order only (<= 37-term sums; seen <= 6 u32): 16 u32. fp16: the output rounding plus rare
# flips of an intermediate's rounding (ln_q, P, o, d(o), dS; seen <= 0.4 u16): 2 u16.
INTERP_C = {F32: 16, F16: 2}


@INTERPRETER
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@ACTS
def test_triton_interpreter(monkeypatch, activation, dtype):
    kern = _kernels(monkeypatch)
    q, k, v, off, max_len, ws = _inputs(INTERP_LENGTHS, 24, 2, 16, dtype=dtype, seed=6)
    _check_kernels(kern, q, k, v, off, max_len, ws, activation, INTERP_C[dtype], INTERP_C[dtype])


@INTERPRETER
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_triton_interpreter_plain_strided_tiles(monkeypatch, dtype):
    """No affine; q a strided view ([T, D, H] transposed), k/v non-contiguous; H = 1 and 3; weights in q's
    dtype; 32-token Q tiles and 16-wide S tiles (the dK/dV kernel walks 32-row Q steps)."""
    kern = _kernels(monkeypatch)
    q, k, v, off, max_len, ws = _inputs(INTERP_LENGTHS, 24, 3, 16, dtype=dtype, affine=False, seed=7)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = k.transpose(0, 1).contiguous().transpose(0, 1)
    _check_kernels(kern, q, k, v, off, max_len, ws, "fast_gelu", INTERP_C[dtype], INTERP_C[dtype])
    cfg = kern.FnaConfig(32, 16, 4)
    q, k, v, off, max_len, ws = _inputs((2, 40, 0), 9, 1, 16, dtype=dtype, w_dtype=dtype, seed=8)
    _check_kernels(kern, q, k, v, off, max_len, ws, "relu", INTERP_C[dtype], INTERP_C[dtype], config=cfg)


@INTERPRETER
def test_triton_interpreter_edge_cases(monkeypatch):
    kern = _kernels(monkeypatch)
    for lengths in ((0, 0), (1,), (0, 17)):
        q, k, v, off, max_len, ws = _inputs(lengths, 5, 1, 8, seed=9)
        _check_kernels(kern, q, k, v, off, max_len, ws, "gelu", 16, 16)
    # A head dim that is not a power of two (D = 24 in 32-wide tiles: the column-masked path).
    q, k, v, off, max_len, ws = _inputs((3, 19), 7, 2, 24, seed=11)
    _check_kernels(kern, q, k, v, off, max_len, ws, "silu", 16, 16)


@ON_CUDA
@pytest.mark.parametrize("h", [1, 2, 4])
def test_cuda_bf16(h):
    """B = 8, lengths up to 300 (one of them empty), S = 128, D = 128, bf16, through the ops (forward and
    autograd) against the reference and the backward reference on the GPU."""
    lengths = (300, 0, 1, 157, 64, 299, 12, 200)
    q, k, v, off, max_len, ws = _inputs(lengths, 128, h, 128, dtype=BF16, device="cuda", seed=10)
    from fusenorm_inductor.kernels.triton import flash_norm_attention as kern

    # bf16 output; flips of bf16-rounded intermediates summed over S = 128 (forward) and up to 300 tokens
    # (dk, dv, weight gradients): 8 u16 forward, 16 u16 backward.
    _check_kernels(kern, q, k, v, off, max_len, ws, "fast_gelu", 8, 16)
    leaves = _leaves(q, k, v, ws, BF16)
    out = _call(flash_norm_attention, *leaves[:3], off, max_len, leaves[3:], "silu")
    want = _call(flash_norm_attention_reference, q, k, v, off, max_len, ws, "silu")
    _close(out, want[0], BF16, 8, "out")
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    args = (torch.ones_like(out), q, k, v, off, max_len, *ws, *want[1:], "silu", SCALE)  # stats and rms_in
    for name, gg, ww in zip("q k v w1 b1 w2".split(), grads, fna.flash_norm_attention_backward_reference(*args)):
        _close(gg, ww, BF16, 16, name)


def test_offset_check_skipped_only_while_capturing(monkeypatch):
    """The host read of the offsets is skipped while a CUDA graph is captured (not allowed there) and when
    CHECK_OFFSETS is off; otherwise bad offsets raise. (Capture is simulated: the check's own logic.)"""

    class CudaOffsets:  # what _check_offsets reads of a CUDA tensor before deciding to skip
        is_cuda = True

    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        fna._check_offsets("op", bad, 3, 8)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fna._check_offsets("op", CudaOffsets(), 3, 8)  # capturing: no host read (it would fail on this object)
    with pytest.raises(ValueError, match="non-decreasing"):
        fna._check_offsets("op", bad, 3, 8)  # a CPU tensor is never "captured"
    monkeypatch.setattr(fna, "CHECK_OFFSETS", False)
    fna._check_offsets("op", bad, 3, 8)


def test_check_offsets_argument(monkeypatch):
    """check_offsets=False skips the data check of the offsets for that call only (metadata still checked)."""
    q, k, v, off, max_len, ws = _inputs((3, 0, 5), 6, 2, 8)
    args = (q, k, v, off, max_len, *ws, LN_EPS, RMS_EPS, "gelu", SCALE)
    calls = []
    monkeypatch.setattr(fna, "check_offsets_values", lambda *a: calls.append(a))
    flash_norm_attention_op(*args, False)
    assert calls == []
    flash_norm_attention_op(*args)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="activation"):  # metadata checks still run
        flash_norm_attention_op(*args[:-2], "softmax", SCALE, False)

