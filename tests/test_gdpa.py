"""``fusenorm::gdpa`` (generalized dot-product attention, an activation instead of softmax) and its backward.

- The reference: against an independent dense, padded computation in fp64 (torch.nn.functional's activations,
  torch autograd for the gradients), every activation; the backward reference in fp64 against that autograd.
- The op on the CPU (fp32): values and autograd gradients against fp64 autograd, every activation and the
  jagged edge cases (empty sequences, length 1, lengths not a multiple of a tile, H = 1, B = 1, B = 0, T = 0);
  torch.compile against eager (forward and gradients); input validation (one case per error).
- The Triton kernels under the interpreter (CPU, fp32/fp16; skipped when CUDA is present): forward, dQ and
  dK/dV launchers at small odd shapes with small tiles (several Q tiles and K/V chunks, ragged ends), every
  activation, the launchers' own block sizes, non-contiguous inputs, T = 0.
- CUDA (skipped without CUDA): the op and its three gradients at B = 8, lengths up to 300 (including 0 and 1),
  S = 128, H = 2, D in {64, 128}, bf16/fp16, every activation; the offsets check behind VALIDATE_CUDA_OFFSETS.

Every output the launchers allocate is NaN-poisoned (kernels/triton/gdpa._alloc), so an element no program writes
fails. Kernel tolerances are per element, from the dtypes' unit roundoff times the magnitudes that carry each
rounding (``error_bounds``), never a blanket atol. bf16 arithmetic is broken in the Triton 3.6 interpreter
(docs/platform.md): bf16 runs only on CUDA.
"""

import importlib
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    # Triton reads the switch when a kernel is decorated: set it before the kernel modules are imported, and
    # reload any imported without it (conftest.py normally sets it first).
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("fusenorm_inductor.kernels.triton.common", "fusenorm_inductor.activations",
                  "fusenorm_inductor.kernels.triton.gdpa"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from fusenorm_inductor.ops import gdpa as gdpa_mod  # noqa: E402
from fusenorm_inductor.activations import ACTIVATIONS, act_grad_reference, act_reference  # noqa: E402
from fusenorm_inductor.ops.gdpa import gdpa, gdpa_backward, gdpa_backward_reference, gdpa_reference  # noqa: E402

F16, F32, F64, BF16 = torch.float16, torch.float32, torch.float64, torch.bfloat16
U32 = 2.0**-24
# Rounding x to a dtype errs by <= u |x| + eta: eta, half the smallest subnormal, covers results that underflow
# (an fp16 gradient of 2e-5 is subnormal, spaced 2^-24 apart). None: no rounding.
ROUNDING = {BF16: (2.0**-8, 2.0**-134), F16: (2.0**-11, 2.0**-25), F32: (U32, 2.0**-150), None: (0.0, 0.0)}
DTYPE_IDS = {BF16: "bf16", F16: "fp16", F32: "fp32"}
SCALE = 0.7

INTERPRETER = pytest.mark.skipif(
    CUDA, reason="CUDA is available: the CUDA tests cover the kernels (no interpreter in a GPU session)"
)
ON_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
ACTS = pytest.mark.parametrize("activation", ACTIVATIONS)
# The interpreter's `range` with runtime bounds goes through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# Independent of activations.py: torch.nn.functional's versions (autograd gives their derivatives).
F_ACTS = {
    "fast_gelu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "raw": lambda x: x,
}


# ----------------------------------------------------------------------------------------------------------
# Inputs, the dense fp64 oracle, error bounds
# ----------------------------------------------------------------------------------------------------------


def offsets_of(lengths, device="cpu"):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, dtype=torch.int32, device=device)


def make_inputs(lengths, s, h, d, dtype, device="cpu", seed=0):
    """(q, k, v, dout, q_offsets, max_seq_len_q): q, k ~ N(0, 1) / D^(1/4), so the scores are ~N(0, 1) and
    the activations' curved parts are exercised; v and dout ~ N(0, 1); rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    t, b = sum(lengths), len(lengths)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q = (r(t, h, d) / d**0.25).to(dtype).to(device)
    k = (r(b, s, h, d) / d**0.25).to(dtype).to(device)
    v = r(b, s, h, d).to(dtype).to(device)
    dout = r(t, h, d).to(dtype).to(device)
    return q, k, v, dout, offsets_of(lengths, device), max(lengths, default=0)


def pad(x, offs, length):
    """Jagged [T, H, D] -> zero-padded [B, length, H, D] (differentiable)."""
    o = offs.tolist()
    rows = [F.pad(x[o[i]:o[i + 1]], (0, 0, 0, 0, 0, length - (o[i + 1] - o[i]))) for i in range(len(o) - 1)]
    return torch.stack(rows) if rows else x.reshape((0, length) + tuple(x.shape[1:]))  # B = 0: still x's graph


def unpad(x, offs):
    o = offs.tolist()
    rows = [x[i, : o[i + 1] - o[i]] for i in range(len(o) - 1)]
    return torch.cat(rows) if rows else x.reshape((0,) + tuple(x.shape[2:]))


def dense_oracle(q, k, v, offs, activation, scale):
    """O in the inputs' dtype as one padded batched computation (no per-sequence loop, other activations)."""
    length = max(1, max((offs[1:] - offs[:-1]).tolist(), default=0))
    qp = pad(q, offs, length)
    scores = torch.einsum("blhd,bshd->bhls", qp, k)
    o = torch.einsum("bhls,bshd->blhd", F_ACTS[activation](scores) * scale, v)
    return unpad(o, offs)


def oracle_with_grads(q, k, v, dout, offs, activation, scale):
    """(O, dq, dk, dv) from the dense oracle in fp64, gradients by torch autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o = dense_oracle(*leaves, offs, activation, scale)
    grads = torch.autograd.grad(o, leaves, dout.double(), allow_unused=True)
    return (o.detach(),) + tuple(torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads))


def error_bounds(q, k, v, dout, offs, activation, scale, in_dtype, out_dtype):
    """Per-element bounds (fp64) on |kernel - exact| for (O, dq, dk, dv), propagated through each step.

    Products of the inputs are exact in fp32 and every sum of n fp32 terms errs by <= (n + 2) u32 * sum|term|.
    Forward: S errs by eS = (D + 2) u32 |q||k|^T; P = act(S) * scale by |act'| eS + 8 u32 (|act| + |S|) (the
    activation's own evaluation) times scale, plus P's rounding to ``in_dtype`` for the second GEMM (None:
    not rounded, as in the reference); O by eP |v| + (S + 2) u32 |P||v| + its rounding to ``out_dtype``.
    Backward the same way with |act''| <= 1 (gelu's is <= 0.8, silu's <= 0.5) and, for relu, act' allowed to
    flip where |S| <= eS; dS is rounded to the inputs' dtype for dQ and dK. The reference's own error is below
    the same bound, so tests allow twice it.
    """
    f = lambda x: x.detach().double()  # noqa: E731
    qf, kf, vf, dof = f(q), f(k), f(v), f(dout)
    lens = (offs[1:] - offs[:-1]).tolist()
    length = max(1, max(lens, default=0))
    d, s = q.shape[2], k.shape[1]
    sc = abs(scale)
    (u_in, eta_in), (u_out, eta_out) = ROUNDING[in_dtype], ROUNDING[out_dtype]
    qp, dop = pad(qf, offs, length), pad(dof, offs, length)
    mm = lambda eq, a, b: torch.einsum(eq, a.abs(), b.abs())  # noqa: E731
    scores = torch.einsum("blhd,bshd->bhls", qp, kf)
    a, a1 = act_reference(scores, activation), act_grad_reference(scores, activation)
    p = a * scale
    e_s = (d + 2) * U32 * mm("blhd,bshd->bhls", qp, kf)
    e_p = sc * (a1.abs() * e_s + 8 * U32 * (a.abs() + scores.abs())) + u_in * p.abs() + eta_in
    o = torch.einsum("bhls,bshd->blhd", p, vf)
    e_o = mm("bhls,bshd->blhd", e_p, vf) + (s + 2) * U32 * mm("bhls,bshd->blhd", p, vf) + u_out * o.abs() + eta_out
    dp = torch.einsum("blhd,bshd->bhls", dop, vf)
    e_dp = (d + 2) * U32 * mm("blhd,bshd->bhls", dop, vf)
    flip = (scores.abs() <= e_s).double() if activation == "relu" else 0.0
    ds = a1 * scale * dp
    e_ds = sc * (e_s * dp.abs() + a1.abs() * e_dp + 8 * U32 * (a1.abs() + 1) * dp.abs() + flip * dp.abs())
    e_ds = e_ds + u_in * ds.abs() + eta_in
    dq = torch.einsum("bhls,bshd->blhd", ds, kf)
    dk = torch.einsum("bhls,blhd->bshd", ds, qp)
    dv = torch.einsum("bhls,blhd->bshd", p, dop)
    out = lambda x: u_out * x.abs() + eta_out  # noqa: E731  (rounding a result to out_dtype)
    e_dq = mm("bhls,bshd->blhd", e_ds, kf) + (s + 2) * U32 * mm("bhls,bshd->blhd", ds, kf) + out(dq)
    e_dk = mm("bhls,blhd->bshd", e_ds, qp) + (length + 2) * U32 * mm("bhls,blhd->bshd", ds, qp) + out(dk)
    e_dv = mm("bhls,blhd->bshd", e_p, dop) + (length + 2) * U32 * mm("bhls,blhd->bshd", p, dop) + out(dv)
    return {"o": unpad(e_o, offs), "dq": unpad(e_dq, offs), "dk": e_dk, "dv": e_dv}


def assert_within(name, got, want, bound):
    """Every element of ``got`` finite and within ``bound`` of ``want`` (all compared in fp64)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want, bound = got.detach().double().cpu(), want.detach().double().cpu(), bound.double().cpu()
    assert torch.isfinite(got).all(), f"{name}: {int((~torch.isfinite(got)).sum())} non-finite elements"
    err = (got - want).abs()
    bad = err > bound
    if bad.any():
        i = int((err - bound).flatten().argmax())
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{err.numel()} elements outside the bound; worst at flat index {i}: "
            f"got {got.flatten()[i].item():.6g}, want {want.flatten()[i].item():.6g}, "
            f"error {err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g}"
        )


def check_all(got, want, bounds, factor=2.0):
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        if g is not None:
            assert_within(name, g, w, factor * bounds[name])


# Jagged cases: (lengths, S, H, D).
CASES = {
    "empty_one_ragged": ((0, 1, 37), 24, 2, 16),
    "tile_multiples": ((16, 32), 16, 2, 16),
    "single_seq": ((17,), 40, 2, 32),
    "one_head": ((5, 0, 9), 24, 1, 16),
    "all_empty": ((0, 0), 24, 2, 16),
    "no_sequences": ((), 24, 2, 16),
}
CASE = pytest.mark.parametrize("case", list(CASES))


# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------


@ACTS
def test_reference_matches_dense_fp64(activation):
    q, k, v, dout, offs, maxlen = make_inputs((0, 1, 37, 5), 24, 2, 16, F64)
    want, dq, dk, dv = oracle_with_grads(q, k, v, dout, offs, activation, SCALE)
    got = gdpa_reference(q, k, v, offs, maxlen, activation, SCALE)
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The backward reference's hand-written formulas against autograd of the dense oracle.
    grads = gdpa_backward_reference(dout, q, k, v, offs, maxlen, activation, SCALE)
    for name, g, w in zip(("dq", "dk", "dv"), grads, (dq, dk, dv)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_reference_rounds_once(dtype):
    """In fp32/fp16 the reference computes in fp32 and rounds O once: within the bound without P's rounding."""
    q, k, v, dout, offs, maxlen = make_inputs((0, 1, 37, 5), 24, 2, 16, dtype)
    want = oracle_with_grads(q, k, v, dout, offs, "fast_gelu", SCALE)
    bounds = error_bounds(q, k, v, dout, offs, "fast_gelu", SCALE, None, dtype)
    got = gdpa_reference(q, k, v, offs, maxlen, "fast_gelu", SCALE)
    assert got.dtype == dtype
    grads = gdpa_backward_reference(dout, q, k, v, offs, maxlen, "fast_gelu", SCALE)
    assert [g.dtype for g in grads] == [dtype] * 3
    check_all((got,) + grads, want, bounds, factor=1.0)


# ----------------------------------------------------------------------------------------------------------
# The op on the CPU: values, autograd, jagged edge cases, torch.compile, validation
# ----------------------------------------------------------------------------------------------------------


def op_with_grads(q, k, v, dout, offs, maxlen, activation, scale):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = gdpa(*leaves, offs, maxlen, activation, scale)
    return (o.detach(),) + tuple(torch.autograd.grad(o, leaves, dout))


@ACTS
def test_op_values_and_gradients(activation):
    q, k, v, dout, offs, maxlen = make_inputs((0, 1, 37, 5), 24, 2, 16, F32)
    got = op_with_grads(q, k, v, dout, offs, maxlen + 3, activation, SCALE)  # max_seq_len_q may exceed
    want = oracle_with_grads(q, k, v, dout, offs, activation, SCALE)
    check_all(got, want, error_bounds(q, k, v, dout, offs, activation, SCALE, F32, F32))


@CASE
def test_op_jagged_cases(case):
    lengths, s, h, d = CASES[case]
    q, k, v, dout, offs, maxlen = make_inputs(lengths, s, h, d, F32, seed=1)
    got = op_with_grads(q, k, v, dout, offs, maxlen, "fast_gelu", -0.5)
    want = oracle_with_grads(q, k, v, dout, offs, "fast_gelu", -0.5)
    assert got[0].shape == (sum(lengths), h, d)
    check_all(got, want, error_bounds(q, k, v, dout, offs, "fast_gelu", -0.5, F32, F32))
    for i, n in enumerate(lengths):
        if n == 0:  # a sequence without tokens gives its K and V no gradient
            assert not got[2][i].any() and not got[3][i].any()


def test_op_default_arguments():
    q, k, v, _, offs, maxlen = make_inputs((3, 7), 16, 2, 16, F32)
    torch.testing.assert_close(gdpa(q, k, v, offs, maxlen), gdpa_reference(q, k, v, offs, maxlen, "fast_gelu", 1.0),
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.fusenorm.gdpa(q, k, v, offs, maxlen, "silu", 0.5),
                               gdpa_reference(q, k, v, offs, maxlen, "silu", 0.5), rtol=0, atol=0)


def test_compile_matches_eager(device):
    if device == "cuda":
        q, k, v, dout, offs, maxlen = make_inputs((0, 1, 70, 33), 40, 2, 64, F16, device)
    else:
        q, k, v, dout, offs, maxlen = make_inputs((0, 1, 37, 5), 24, 2, 16, F32, device)
    fn = lambda q, k, v: gdpa(q, k, v, offs, maxlen)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (fn, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = f(*leaves)
        results.append((o.detach(),) + torch.autograd.grad(o, leaves, dout))
    for name, e, c in zip(("o", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(c, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _bad(change):
    """Valid inputs (lengths 3 and 5, S = 4, H = 2, D = 16) with ``change`` applied to their dict."""
    q, k, v, _, offs, _ = make_inputs((3, 5), 4, 2, 16, F32)
    args = dict(q=q, k=k, v=v, q_offsets=offs, max_seq_len_q=5, activation="fast_gelu", scale=1.0)
    change(args)
    return args


BAD_INPUTS = {
    "offsets_not_monotonic": (lambda a: a.update(q_offsets=torch.tensor([0, 9, 8], dtype=torch.int32)),
                              ValueError, "non-decreasing"),
    "offsets_not_from_0": (lambda a: a.update(q_offsets=torch.tensor([1, 4, 8], dtype=torch.int32)),
                           ValueError, r"q_offsets\[0\] must be 0"),
    "offsets_end_not_T": (lambda a: a.update(q_offsets=torch.tensor([0, 3, 7], dtype=torch.int32)),
                          ValueError, "must equal T"),
    "offsets_int64": (lambda a: a.update(q_offsets=a["q_offsets"].long()), TypeError, "'q_offsets' must have dtype"),
    "offsets_wrong_count": (lambda a: a.update(q_offsets=torch.tensor([0, 8], dtype=torch.int32)),
                            ValueError, "'q_offsets' must have shape"),
    "max_len_too_small": (lambda a: a.update(max_seq_len_q=4), ValueError, "5 tokens but max_seq_len_q = 4"),
    "max_len_negative": (lambda a: a.update(max_seq_len_q=-1), ValueError, "non-negative int"),
    "unknown_activation": (lambda a: a.update(activation="softmax"), ValueError, "unknown activation 'softmax'"),
    "scale_nan": (lambda a: a.update(scale=float("nan")), ValueError, "scale must be a finite number"),
    "k_dtype": (lambda a: a.update(k=a["k"].half()), TypeError, "'k' must have dtype"),
    "q_fp64": (lambda a: a.update(q=a["q"].double()), TypeError, "'q' must have dtype"),
    "q_2d": (lambda a: a.update(q=a["q"].flatten(1)), ValueError, "'q' must be 3-D"),
    "k_heads": (lambda a: a.update(k=a["k"][:, :, :1]), ValueError, r"expected \[B, S, 2, 16\]"),
    "v_shape": (lambda a: a.update(v=a["v"][:, :3]), ValueError, "v must have k's shape"),
    "k_device": (lambda a: a.update(k=a["k"].to("meta")), ValueError, "'k' is on meta"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_validation_errors(bad):
    change, exc, match = BAD_INPUTS[bad]
    with pytest.raises(exc, match=match):
        gdpa(**_bad(change))


def test_backward_op_validates_dout():
    a = _bad(lambda a: None)
    with pytest.raises(ValueError, match="'dout' must have shape"):
        gdpa_backward(a["q"][:4], a["q"], a["k"], a["v"], a["q_offsets"], 5, "fast_gelu", 1.0)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels in the interpreter
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def kernels(monkeypatch):
    """The kernel module with NaN-poisoned outputs (an element no program writes shows up)."""
    gk = pytest.importorskip("fusenorm_inductor.kernels.triton.gdpa")
    monkeypatch.setattr(gk, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                              device=device))
    return gk


def run_kernels(gk, q, k, v, dout, offs, maxlen, activation, scale, cfg=None):
    o = gk.gdpa_fwd_triton(q, k, v, offs, maxlen, activation, scale, cfg)
    return (o,) + gk.gdpa_bwd_triton(dout, q, k, v, offs, maxlen, activation, scale, cfg, cfg)


def check_kernels(gk, lengths, s, h, d, dtype, activation, cfg, seed=0, transform=None):
    q, k, v, dout, offs, maxlen = make_inputs(lengths, s, h, d, dtype, seed=seed)
    want = oracle_with_grads(q, k, v, dout, offs, activation, SCALE)
    bounds = error_bounds(q, k, v, dout, offs, activation, SCALE, dtype, dtype)
    if transform is not None:
        q, k, v, dout = transform(q, k, v, dout)
    got = run_kernels(gk, q, k, v, dout, offs, maxlen, activation, SCALE, cfg)
    assert [g.dtype for g in got] == [dtype] * 4
    check_all(got, want, bounds)


@INTERPRETER
@ACTS
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_kernels_small_tiles(kernels, dtype, activation):
    """16-row Q tiles and 16-row K/V chunks: 37 tokens span 3 tiles (the last ragged), S = 40 three chunks."""
    check_kernels(kernels, (0, 1, 37), 40, 2, 32, dtype, activation, kernels.GdpaConfig(16, 16, 4, 2))


@INTERPRETER
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_kernels_default_configs(kernels, dtype):
    """The launchers' own block sizes (None): D = 64, lengths past one 64-row tile, S < one K/V chunk."""
    check_kernels(kernels, (70, 0, 3), 24, 2, 64, dtype, "gelu", None, seed=2)


@INTERPRETER
@CASE
def test_kernels_jagged_cases(kernels, case):
    lengths, s, h, d = CASES[case]
    check_kernels(kernels, lengths, s, h, d, F32, "silu", kernels.GdpaConfig(16, 16, 4, 2), seed=3)


@INTERPRETER
def test_kernels_non_contiguous_inputs(kernels):
    """Strided views (a head slice of q, a transposed-then-back k, a sliced v): the launchers copy them."""

    def transform(q, k, v, dout):
        q2 = torch.cat([q, q], dim=1)[:, : q.shape[1]]
        k2 = k.transpose(1, 2).contiguous().transpose(1, 2)
        v2 = torch.cat([v, v], dim=3)[..., : v.shape[3]]
        return q2, k2, v2, dout.transpose(0, 1).contiguous().transpose(0, 1)

    check_kernels(kernels, (5, 19), 24, 2, 16, F16, "fast_gelu", kernels.GdpaConfig(16, 16, 4, 2),
                  transform=transform)


# ----------------------------------------------------------------------------------------------------------
# CUDA: the op end to end (forward + autograd), realistic shapes
# ----------------------------------------------------------------------------------------------------------


@ON_CUDA
@ACTS
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_cuda_op_and_gradients(kernels, dtype, d, activation):
    g = torch.Generator().manual_seed(d)
    lengths = [300, 0, 1] + torch.randint(0, 301, (5,), generator=g).tolist()
    q, k, v, dout, offs, maxlen = make_inputs(lengths, 128, 2, d, dtype, "cuda", seed=d)
    got = op_with_grads(q, k, v, dout, offs, maxlen, activation, SCALE)
    want = oracle_with_grads(q, k, v, dout, offs, activation, SCALE)
    check_all(got, want, error_bounds(q, k, v, dout, offs, activation, SCALE, dtype, dtype))


@ON_CUDA
def test_cuda_offsets_checked_only_when_asked(monkeypatch):
    q, k, v, _, offs, maxlen = make_inputs((3, 5), 16, 2, 64, F16, "cuda")
    bad = torch.tensor([0, 5, 3], dtype=torch.int32, device="cuda")
    gdpa(q[:3], k, v, bad, maxlen)  # not checked by default (no host sync); clamped, no memory error
    torch.cuda.synchronize()
    monkeypatch.setattr(gdpa_mod, "VALIDATE_CUDA_OFFSETS", True)
    with pytest.raises(ValueError, match="non-decreasing"):
        gdpa(q[:3], k, v, bad, maxlen)


@ON_CUDA
def test_cuda_unsupported_head_dim_runs_the_reference():
    """D = 48 has no kernel: the op runs the reference on the GPU, forward and backward, same results."""
    q, k, v, _, offs, maxlen = make_inputs((3, 5), 16, 2, 48, F32, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = gdpa(q, k, v, offs, maxlen)
    ref = gdpa_reference(q, k, v, offs, maxlen)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
