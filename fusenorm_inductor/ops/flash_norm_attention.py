"""FlashNormAttention: the fused PFFN attention block (docs/algorithms.md section 5), norms over all H*D features.

For a jagged q [T, H, D] (sequence b owns tokens q_offsets[b] .. q_offsets[b+1]) and dense short k, v
[B, S, H, D] (S <= 256), per token t of sequence b and head h, in fp32:

    ln_q  = LayerNorm_{H*D}(q[t]) (* ln_weight + ln_bias)          viewed [H, D]
    o_h   = (act(ln_q_h K_bh^T) * scale) V_bh + ln_q_h              GDPA (an activation, no softmax); residual 1
    out   = RMSNorm_{H*D}(o) (* rms_weight) + q[t]                  residual 2

Ops (registered on import):
- ``fusenorm::flash_norm_attention(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps,
  rms_eps, activation, scale) -> (out, ln_mean, ln_rstd, rms_rstd, rms_in)``: out [T, H, D] in q's dtype; the
  three statistics fp32 [T] and rms_in = o (the RMSNorm's input, [T, H, D] in q's dtype), saved for the
  backward (only out is differentiable). Autograd: gradients for q, k, v and the three weights.
- ``fusenorm::flash_norm_attention_backward(dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias,
  rms_weight, ln_mean, ln_rstd, rms_rstd, rms_in, activation, scale) -> (dq, dk, dv, d_ln_weight, d_ln_bias,
  d_rms_weight)``: the gradients (a missing weight's gradient is a 0-size tensor).
Python: ``flash_norm_attention(...) -> out`` and the references ``flash_norm_attention_reference(...)``
(the 5-tuple) and ``flash_norm_attention_backward_reference(...)``.

CPU runs the references; CUDA runs the Triton kernels of kernels/triton/flash_norm_attention.py (module docstring
there: the cross-head design).

Rounding (both the reference and the kernels; "what an unfused bf16 graph does, or better"): everything is fp32
except three roundings to q's dtype, each at a place where the unfused graph rounds too:
  1. ln_q as the operand of ln_q K^T (the tensor-core operand; the residual adds the unrounded fp32 ln_q),
  2. P = act(S) * scale before P V (likewise),
  3. o = P V + ln_q before the RMSNorm (o is stored, rms_in; the unfused graph rounds the attention block's
     output before its RMSNorm too).
For fp32 inputs these are no-ops; an fp64 q (reference only) computes in fp64. The backward computes in fp32
and rounds d(o) and dS to q's dtype as MMA operands and d(ln_q) = dS K + d(o) to q's dtype (the unfused graph's
autograd rounds them to bf16 too).

Backward: ln_q is rebuilt from q and the saved LayerNorm statistics (never saved). o, the RMSNorm's input,
is saved (rms_in), not derived from the output as (out - q) / (rms_rstd * rms_weight) (the seed's way), which
divides by rms_weight (infinite or garbage where a weight is ~0) and cancels where |q| >> |out - q| (bf16 out
rounded at |q| loses o's low bits); nor recomputed as P V + ln_q, which cost the first backward two more
matmuls per head and S tile (measured on the H200: docs/history/, Attention). Saved for the backward: q,
the three statistics and o, one [T, H, D] tensor fewer than the unfused graph keeps (ln_q and the attention
output or o); under no_grad o is a temporary of the op.

Offsets: int32 [B+1], q_offsets[0] == 0, non-decreasing, q_offsets[-1] == T, every length <= max_seq_len_q
(the kernels' grid covers max_seq_len_q rows per sequence). Checking them reads the offsets on the host
(a device sync on CUDA; skipped while a CUDA graph is captured); the op's ``check_offsets=False`` argument
skips it for one call (the dense-form rewrite passes it: it builds the offsets itself), ``CHECK_OFFSETS = False``
for every call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validate import check_eps, check_jagged_attention, check_offsets_values, check_tensor
from ..activations import act_grad_reference, act_reference

__all__ = [
    "flash_norm_attention",
    "flash_norm_attention_op",
    "flash_norm_attention_backward",
    "flash_norm_attention_reference",
    "flash_norm_attention_backward_reference",
    "MAX_KV_LEN",
]

_OP = "fusenorm::flash_norm_attention"
_OP_BWD = "fusenorm::flash_norm_attention_backward"
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MAX_KV_LEN = 256
CHECK_OFFSETS = True


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def _check(op, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, activation, scale) -> None:
    """Metadata checks (shapes, dtypes, devices, scalars): run by the real and the fake implementations."""
    check_tensor(op, "q", q, ndim=3, dtypes=FLOATS)
    t, h, d = q.shape
    if h == 0 or d == 0:
        raise ValueError(f"{op}: q is {tuple(q.shape)}: the norms need at least one feature (H*D > 0)")
    check_jagged_attention(op, q, k, v, q_offsets, max_seq_len_q, activation)
    if k.shape[1] > MAX_KV_LEN:
        raise ValueError(f"{op}: the KV length {k.shape[1]} exceeds {MAX_KV_LEN} (short-KV attention)")
    for name, w in (("ln_weight", ln_weight), ("ln_bias", ln_bias), ("rms_weight", rms_weight)):
        check_tensor(op, name, w, shape=(h * d,), device=q.device, dtypes=(q.dtype, torch.float32), required=False)
    if not isinstance(scale, (int, float)):
        raise ValueError(f"{op}: scale must be a number, got {scale!r}")


def _check_offsets(op, q_offsets: Tensor, t: int, max_seq_len_q: int) -> None:
    """Data checks of the offsets (host read: a sync on CUDA), skipped when ``CHECK_OFFSETS`` is False and
    while a CUDA graph is being captured (a host read is not allowed there: under ``mode="reduce-overhead"``
    the op runs uncaptured first, and is checked then)."""
    if not CHECK_OFFSETS or (q_offsets.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    check_offsets_values(op, q_offsets, t, max_seq_len_q)


def _check_all(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation,
               scale) -> None:
    _check(_OP, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, activation, scale)
    check_eps(_OP, ln_eps)
    check_eps(_OP, rms_eps)


# ----------------------------------------------------------------------------------------------------------
# Reference (CPU implementation and the tests' oracle)
# ----------------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to ``dtype`` and back (an MMA operand / a stored intermediate); gradient passes through."""
    return x.to(dtype).to(x.dtype) if dtype != x.dtype else x


def _jagged_index(q_offsets: Tensor, t: int) -> tuple[Tensor, Tensor, int]:
    """(batch index [T], position in its sequence [T], longest length) of the jagged tokens."""
    off = q_offsets.to(torch.int64)
    lengths = off[1:] - off[:-1]
    b = lengths.numel()
    bidx = torch.repeat_interleave(torch.arange(b, device=off.device), lengths, output_size=t)
    pos = torch.arange(t, device=off.device) - off[bidx]
    max_len = int(lengths.max()) if b > 0 and t > 0 else 0
    return bidx, pos, max_len


def _attention(lnq_op: Tensor, k: Tensor, v: Tensor, index, activation: str, scale: float, op_dtype):
    """Per head (S, P_op, dense [B, H, L, *] views) of S = ln_q K^T, P = act(S) * scale (rounded to op_dtype),
    and O = P V gathered back to [T, H, D]."""
    bidx, pos, max_len = index
    t, h, d = lnq_op.shape
    b = k.shape[0]
    qp = lnq_op.new_zeros((b, max_len, h, d))
    qp[bidx, pos] = lnq_op
    qp = qp.transpose(1, 2)  # [B, H, L, D]
    kt = k.to(lnq_op.dtype).transpose(1, 2)  # [B, H, S, D]
    vt = v.to(lnq_op.dtype).transpose(1, 2)
    s = qp @ kt.transpose(-1, -2)  # [B, H, L, S]
    p = _rounded(act_reference(s, activation) * scale, op_dtype)
    o = (p @ vt).transpose(1, 2)[bidx, pos]  # [T, H, D]
    return s, p, qp, kt, vt, o


def _weights(cd, ln_weight, ln_bias, rms_weight):
    return tuple(w.to(cd) if w is not None else None for w in (ln_weight, ln_bias, rms_weight))


def flash_norm_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    max_seq_len_q: int,
    ln_weight: Optional[Tensor] = None,
    ln_bias: Optional[Tensor] = None,
    rms_weight: Optional[Tensor] = None,
    ln_eps: float = 1e-5,
    rms_eps: float = 1e-6,
    activation: str = "fast_gelu",
    scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, ln_mean, ln_rstd, rms_rstd, rms_in): the block in fp32 (fp64 for an fp64 q) with the module
    docstring's three roundings to q's dtype; differentiable by torch autograd. Statistics in the compute
    dtype; rms_in (o) in q's dtype."""
    t, h, d = q.shape
    cd = _compute_dtype(q.dtype)
    w1, b1, w2 = _weights(cd, ln_weight, ln_bias, rms_weight)
    x = q.to(cd).reshape(t, h * d)
    mean = x.mean(1)
    rstd = torch.rsqrt((x - mean[:, None]).square().mean(1) + ln_eps)  # two-pass variance
    lnq = (x - mean[:, None]) * rstd[:, None]
    if w1 is not None:
        lnq = lnq * w1
    if b1 is not None:
        lnq = lnq + b1
    lnq = lnq.reshape(t, h, d)
    index = _jagged_index(q_offsets, t)
    *_, attn = _attention(_rounded(lnq, q.dtype), k, v, index, activation, scale, q.dtype)
    o = _rounded(attn + lnq, q.dtype).reshape(t, h * d)
    rms_rstd = torch.rsqrt(o.square().mean(1) + rms_eps)
    y = o * rms_rstd[:, None]
    if w2 is not None:
        y = y * w2
    out = (y + x).reshape(t, h, d).to(q.dtype)
    return out, mean, rstd, rms_rstd, o.reshape(t, h, d).to(q.dtype)


def flash_norm_attention_backward_reference(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    max_seq_len_q: int,
    ln_weight: Optional[Tensor],
    ln_bias: Optional[Tensor],
    rms_weight: Optional[Tensor],
    ln_mean: Tensor,
    ln_rstd: Tensor,
    rms_rstd: Tensor,
    rms_in: Tensor,
    activation: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dq, dk, dv, d_ln_weight, d_ln_bias, d_rms_weight) from the saved statistics and o (rms_in), explicit
    formulas in fp32 (docs/algorithms.md, Norms and section 5); gradients in their inputs' dtypes, None for a
    missing weight. The same math as the Triton backward, for any device."""
    t, h, d = q.shape
    n = h * d
    cd = _compute_dtype(q.dtype)
    w1, b1, w2 = _weights(cd, ln_weight, ln_bias, rms_weight)
    x = q.to(cd).reshape(t, n)
    g = dout.to(cd).reshape(t, n)
    mean, rstd, r2 = ln_mean.to(cd)[:, None], ln_rstd.to(cd)[:, None], rms_rstd.to(cd)[:, None]
    lnhat = (x - mean) * rstd
    lnq = lnhat * w1 if w1 is not None else lnhat
    if b1 is not None:
        lnq = lnq + b1
    lnq3 = lnq.reshape(t, h, d)
    lnq_op = _rounded(lnq3, q.dtype)
    index = _jagged_index(q_offsets, t)
    bidx, pos, max_len = index
    s, p, qp, kt, vt, _ = _attention(lnq_op, k, v, index, activation, scale, q.dtype)
    o = rms_in.to(cd).reshape(t, n)  # saved by the forward (module docstring)
    ohat = o * r2
    # RMSNorm backward: t2 = g * w2, do = r2 * (t2 - ohat * mean(t2 * ohat)).
    t2 = g * w2 if w2 is not None else g
    do = r2 * (t2 - ohat * (t2 * ohat).mean(1, keepdim=True))
    d_w2 = (g * ohat).sum(0) if w2 is not None else None
    # Attention backward, dense per (b, h): dV = P^T dO, dP = dO V^T, dS = act'(S) * scale * dP.
    b = k.shape[0]
    dop = do.new_zeros((b, max_len, h, d))
    dop[bidx, pos] = _rounded(do.reshape(t, h, d), q.dtype)
    dop = dop.transpose(1, 2)  # [B, H, L, D]
    dv = p.transpose(-1, -2) @ dop  # [B, H, S, D]
    dp = dop @ vt.transpose(-1, -2)
    ds = _rounded(act_grad_reference(s, activation) * scale * dp, q.dtype)
    dk = ds.transpose(-1, -2) @ qp
    # + residual 1; d(o) as rounded for the MMAs, the sum rounded to q's dtype (the unfused graph's gradients
    # of ln_q through GDPA and through the residual are q's dtype too).
    dlnq = _rounded((ds @ kt).transpose(1, 2)[bidx, pos].reshape(t, n) + _rounded(do, q.dtype), q.dtype)
    # LayerNorm backward: t1 = dlnq * w1, dq = rstd * (t1 - mean(t1) - lnhat * mean(t1 * lnhat)), + residual 2.
    t1 = dlnq * w1 if w1 is not None else dlnq
    dq = rstd * (t1 - t1.mean(1, keepdim=True) - lnhat * (t1 * lnhat).mean(1, keepdim=True)) + g
    d_w1 = (dlnq * lnhat).sum(0) if w1 is not None else None
    d_b1 = dlnq.sum(0) if b1 is not None else None
    cast = lambda gr, like: gr.to(like.dtype) if like is not None else None  # noqa: E731
    return (
        dq.reshape(t, h, d).to(q.dtype),
        dk.transpose(1, 2).contiguous().to(k.dtype),
        dv.transpose(1, 2).contiguous().to(v.dtype),
        cast(d_w1, ln_weight),
        cast(d_b1, ln_bias),
        cast(d_w2, rms_weight),
    )


# ----------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(_OP, mutates_args=())
def flash_norm_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    max_seq_len_q: int,
    ln_weight: Optional[Tensor],
    ln_bias: Optional[Tensor],
    rms_weight: Optional[Tensor],
    ln_eps: float,
    rms_eps: float,
    activation: str,
    scale: float,
    check_offsets: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused block; see the module docstring. CPU: the reference. ``check_offsets=False``: the caller
    guarantees valid offsets (the dense-form rewrite builds them itself), no host read."""
    args = (q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation, scale)
    _check_all(*args)
    if check_offsets:
        _check_offsets(_OP, q_offsets, q.shape[0], max_seq_len_q)
    out, mean, rstd, r2, rms_in = flash_norm_attention_reference(*args)
    return out, mean.float(), rstd.float(), r2.float(), rms_in


@flash_norm_attention_op.register_kernel("cuda")
def _(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation, scale,
      check_offsets=True):
    args = (q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation, scale)
    _check_all(*args)
    if check_offsets:
        _check_offsets(_OP, q_offsets, q.shape[0], max_seq_len_q)
    from ..kernels.triton.flash_norm_attention import flash_norm_attention_triton

    return flash_norm_attention_triton(*args)


@flash_norm_attention_op.register_fake
def _(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation, scale,
      check_offsets=True):
    _check_all(q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation,
               scale)
    t = q.shape[0]
    stat = lambda: q.new_empty((t,), dtype=torch.float32)  # noqa: E731
    like_q = lambda: torch.empty_like(q, memory_format=torch.contiguous_format)  # noqa: E731
    return like_q(), stat(), stat(), stat(), like_q()


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_eps, rms_eps, activation, scale, _ = inputs
    _, mean, rstd, r2, rms_in = output
    # q, the statistics and o; never ln_q (rebuilt) or out.
    ctx.save_for_backward(q, k, v, q_offsets, ln_weight, ln_bias, rms_weight, mean, rstd, r2, rms_in)
    ctx.mark_non_differentiable(mean, rstd, r2, rms_in)
    ctx.max_seq_len_q, ctx.activation, ctx.scale = max_seq_len_q, activation, scale


def _backward(ctx, dout, _dmean, _drstd, _dr2, _drms_in):
    q, k, v, q_offsets, ln_weight, ln_bias, rms_weight, mean, rstd, r2, rms_in = ctx.saved_tensors
    dq, dk, dv, dw1, db1, dw2 = flash_norm_attention_backward(
        dout.contiguous(), q, k, v, q_offsets, ctx.max_seq_len_q, ln_weight, ln_bias, rms_weight, mean, rstd, r2,
        rms_in, ctx.activation, ctx.scale,
    )
    pick = lambda gr, w: gr if w is not None else None  # noqa: E731
    return (dq, dk, dv, None, None, pick(dw1, ln_weight), pick(db1, ln_bias), pick(dw2, rms_weight),
            None, None, None, None, None)


flash_norm_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _check_bwd(dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_mean, ln_rstd,
               rms_rstd, rms_in, activation, scale) -> None:
    _check(_OP_BWD, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, activation, scale)
    check_tensor(_OP_BWD, "dout", dout, shape=tuple(q.shape), device=q.device)
    check_tensor(_OP_BWD, "rms_in", rms_in, shape=tuple(q.shape), device=q.device, dtypes=(q.dtype,))
    for name, st in (("ln_mean", ln_mean), ("ln_rstd", ln_rstd), ("rms_rstd", rms_rstd)):
        check_tensor(_OP_BWD, name, st, shape=(q.shape[0],), device=q.device, dtypes=(torch.float32,))


def _empty_if_none(grads, like):
    return tuple(gr if gr is not None else w_like.new_empty((0,)) for gr, w_like in zip(grads, like))


@torch.library.custom_op(_OP_BWD, mutates_args=())
def flash_norm_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    max_seq_len_q: int,
    ln_weight: Optional[Tensor],
    ln_bias: Optional[Tensor],
    rms_weight: Optional[Tensor],
    ln_mean: Tensor,
    ln_rstd: Tensor,
    rms_rstd: Tensor,
    rms_in: Tensor,
    activation: str,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_ln_weight, d_ln_bias, d_rms_weight); a missing weight's gradient is 0-size."""
    args = (dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_mean, ln_rstd, rms_rstd,
            rms_in, activation, scale)
    _check_bwd(*args)
    dq, dk, dv, *dws = flash_norm_attention_backward_reference(*args)
    return (dq, dk, dv) + _empty_if_none(dws, (q, q, q))


@flash_norm_attention_backward.register_kernel("cuda")
def _(dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_mean, ln_rstd, rms_rstd,
      rms_in, activation, scale):
    args = (dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_mean, ln_rstd, rms_rstd,
            rms_in, activation, scale)
    _check_bwd(*args)
    from ..kernels.triton.flash_norm_attention import flash_norm_attention_backward_triton

    dq, dk, dv, *dws = flash_norm_attention_backward_triton(*args)
    return (dq, dk, dv) + _empty_if_none(dws, (q, q, q))


@flash_norm_attention_backward.register_fake
def _(dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_mean, ln_rstd, rms_rstd,
      rms_in, activation, scale):
    _check_bwd(dout, q, k, v, q_offsets, max_seq_len_q, ln_weight, ln_bias, rms_weight, ln_mean, ln_rstd, rms_rstd,
               rms_in, activation, scale)
    dw = [w.new_empty(w.shape) if w is not None else q.new_empty((0,)) for w in (ln_weight, ln_bias, rms_weight)]
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), *dw)


def flash_norm_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    max_seq_len_q: int,
    ln_weight: Optional[Tensor] = None,
    ln_bias: Optional[Tensor] = None,
    rms_weight: Optional[Tensor] = None,
    ln_eps: float = 1e-5,
    rms_eps: float = 1e-6,
    activation: str = "fast_gelu",
    scale: float = 1.0,
) -> Tensor:
    """``out`` of ``fusenorm::flash_norm_attention`` (differentiable); see the module docstring."""
    return flash_norm_attention_op(q, k, v, q_offsets, int(max_seq_len_q), ln_weight, ln_bias, rms_weight,
                                   float(ln_eps), float(rms_eps), activation, float(scale))[0]
