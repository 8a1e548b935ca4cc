"""GDPA, generalized dot-product attention: an elementwise activation instead of softmax (docs/algorithms.md section 5).

Per sequence b (tokens t in [q_offsets[b], q_offsets[b+1])) and head h:
    S[t, s] = sum_d q[t, h, d] k[b, s, h, d]
    P       = act(S) * scale                      (no row max or row sum: P is elementwise in S)
    O[t, h] = sum_s P[t, s] v[b, s, h, :]
Backward (``fusenorm::gdpa_backward``): dV = P^T dO, dP = dO V^T, dS = act'(S) * scale * dP, dQ = dS K,
dK = dS^T Q. Activations and their derivatives are activations.py's (``ACTIVATIONS``).

Layout: q jagged [T, H, D] with int32 ``q_offsets`` [B + 1] (T = sum of the B lengths); k and v dense
[B, S, H, D] (S short: up to 256, the whole K/V of one (b, h) fits on chip). ``max_seq_len_q`` (>= every
length) sizes the kernels' grid without reading the offsets on the host.

Two ops, both graph-visible (fake impls, so torch.compile traces through them):
- ``fusenorm::gdpa(q, k, v, q_offsets, max_seq_len_q, activation="fast_gelu", scale=1.0) -> O`` [T, H, D]
  in q's dtype, with registered autograd (gradients for q, k and v);
- ``fusenorm::gdpa_backward(dout, q, k, v, q_offsets, max_seq_len_q, activation, scale) -> (dq, dk, dv)``,
  what the autograd formula calls (an op of its own, so the traced backward holds one node, not a kernel
  launch on fake tensors).
CPU: the references below (fp32 math, a loop over sequences). CUDA: the Triton kernels of kernels/triton/gdpa.py; on
sm_90 the forward runs the Gluon kernel of kernels/hopper/gdpa.py where it takes the inputs (bf16/fp16, D 64
or 128, S a power of two <= 128; ``kernels/triton/gdpa.gluon_unsupported`` says why not otherwise).

Validation (``_check``, before anything runs): shapes, dtypes (q, k, v one of fp32/fp16/bf16, all the same;
offsets int32), one device, the activation's name, max_seq_len_q a non-negative int, scale a finite number.
The offsets' *values* (q_offsets[0] == 0, non-decreasing, q_offsets[-1] == T, every length <=
max_seq_len_q) are checked on the CPU, where reading them is free. On CUDA they are not by default: reading
them back is a host sync per call (per step, forward and backward), and no shape carries them. Instead the
kernels clamp each sequence's [start, end) into [0, T], so bad offsets cannot make them read or write outside
q and O (the result is then wrong, not a memory error; rows past start + max_seq_len_q stay unwritten). Set
``VALIDATE_CUDA_OFFSETS = True`` to check them on CUDA too, at the cost of that sync.
The kernels need D a power of two in [16, 128] (tl.dot needs >= 16; 64 and 128 are the tuned sizes); other
head dims on CUDA run the references with torch ops on the GPU (correct, slower, and the offsets read on the
host: a sync). Non-contiguous inputs are made contiguous by the CUDA launcher (a copy); outputs are
contiguous everywhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._validate import check_jagged_attention, check_offsets_values, check_tensor
from ..activations import act_grad_reference, act_reference

__all__ = ["gdpa", "gdpa_reference", "gdpa_backward", "gdpa_backward_reference", "VALIDATE_CUDA_OFFSETS"]

_OP = "fusenorm::gdpa"
_OP_BWD = "fusenorm::gdpa_backward"
CUDA_HEAD_DIMS = (16, 32, 64, 128)

# Check the offsets' values on CUDA too (one host sync per call); see the module docstring.
VALIDATE_CUDA_OFFSETS = False


def _check(op: str, q, k, v, q_offsets, max_seq_len_q, activation, scale, *, values: bool) -> None:
    """Raise a clear error for malformed inputs; ``values``: also check the offsets' values (reads them)."""
    check_jagged_attention(op, q, k, v, q_offsets, max_seq_len_q, activation)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite number, got {scale!r}")
    if values:  # a host sync on CUDA (only with VALIDATE_CUDA_OFFSETS, or without a kernel for D)
        check_offsets_values(op, q_offsets, q.shape[0], max_seq_len_q)


def _dims(q: Tensor, k: Tensor) -> tuple[int, int, int, int]:
    return k.shape[0], k.shape[1], q.shape[1], q.shape[2]


# ----------------------------------------------------------------------------------------------------------
# Reference (CPU implementation and the tests' oracle): fp32 math (fp64 for fp64 inputs), one sequence at a
# time. Differentiable by torch autograd (no in-place writes), which the tests use as a second oracle.
# ----------------------------------------------------------------------------------------------------------


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gdpa_reference(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
                   activation: str = "fast_gelu", scale: float = 1.0) -> Tensor:
    """O [T, H, D] in q's dtype (module docstring); max_seq_len_q is not needed here (the offsets are read)."""
    nb, _, h, d = _dims(q, k)
    f = _math_dtype(q.dtype)
    offs = q_offsets.tolist()
    pieces = []
    for b in range(nb):
        lo, hi = offs[b], offs[b + 1]
        if hi == lo:
            continue
        scores = torch.einsum("lhd,shd->hls", q[lo:hi].to(f), k[b].to(f))
        p = act_reference(scores, activation) * scale
        pieces.append(torch.einsum("hls,shd->lhd", p, v[b].to(f)))
    if not pieces:
        return q.new_empty((0, h, d))
    return torch.cat(pieces).to(q.dtype)


def gdpa_backward_reference(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor,
                            max_seq_len_q: int, activation: str = "fast_gelu",
                            scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [T, H, D], dk [B, S, H, D], dv [B, S, H, D]) in the inputs' dtype; S is recomputed, not saved."""
    nb, s, h, d = _dims(q, k)
    f = _math_dtype(q.dtype)
    offs = q_offsets.tolist()
    zeros = q.new_zeros((s, h, d), dtype=f)
    dqs, dks, dvs = [], [], []
    for b in range(nb):
        lo, hi = offs[b], offs[b + 1]
        if hi == lo:  # no tokens: nothing reaches this sequence's K and V
            dks.append(zeros)
            dvs.append(zeros)
            continue
        qb, kb, vb, dob = q[lo:hi].to(f), k[b].to(f), v[b].to(f), dout[lo:hi].to(f)
        scores = torch.einsum("lhd,shd->hls", qb, kb)
        p = act_reference(scores, activation) * scale
        dvs.append(torch.einsum("hls,lhd->shd", p, dob))
        dp = torch.einsum("lhd,shd->hls", dob, vb)
        ds = act_grad_reference(scores, activation) * scale * dp
        dqs.append(torch.einsum("hls,shd->lhd", ds, kb))
        dks.append(torch.einsum("hls,lhd->shd", ds, qb))
    dq = torch.cat(dqs).to(q.dtype) if dqs else q.new_empty((0, h, d))
    if nb == 0:
        return dq, k.new_zeros(k.shape), v.new_zeros(v.shape)
    return dq, torch.stack(dks).to(k.dtype), torch.stack(dvs).to(v.dtype)


# ----------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(_OP, mutates_args=())
def gdpa(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
         activation: str = "fast_gelu", scale: float = 1.0) -> Tensor:
    """``act(Q K^T) * scale @ V`` per sequence and head, Q jagged [T, H, D], K/V [B, S, H, D] (module docstring)."""
    _check(_OP, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=True)
    return gdpa_reference(q, k, v, q_offsets, max_seq_len_q, activation, scale)


@gdpa.register_kernel("cuda")
def _(q, k, v, q_offsets, max_seq_len_q, activation="fast_gelu", scale=1.0):
    if q.shape[2] not in CUDA_HEAD_DIMS:  # no kernel for this head dim: the reference, on the GPU
        _check(_OP, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=True)
        return gdpa_reference(q, k, v, q_offsets, max_seq_len_q, activation, scale)
    _check(_OP, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=VALIDATE_CUDA_OFFSETS)
    from ..kernels.triton.gdpa import gdpa_fwd_triton

    return gdpa_fwd_triton(q, k, v, q_offsets, max_seq_len_q, activation, scale)


@gdpa.register_fake
def _(q, k, v, q_offsets, max_seq_len_q, activation="fast_gelu", scale=1.0):
    _check(_OP, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=False)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, max_seq_len_q, activation, scale = inputs
    # The inputs only: the backward recomputes S and P per tile (as the forward did) instead of saving them.
    ctx.save_for_backward(q, k, v, q_offsets)
    ctx.max_seq_len_q, ctx.activation, ctx.scale = max_seq_len_q, activation, scale


def _backward(ctx, dout):
    q, k, v, q_offsets = ctx.saved_tensors
    dq, dk, dv = gdpa_backward(dout.to(q.dtype), q, k, v, q_offsets, ctx.max_seq_len_q, ctx.activation, ctx.scale)
    return dq, dk, dv, None, None, None, None


gdpa.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(_OP_BWD, mutates_args=())
def gdpa_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
                  activation: str, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``gdpa`` for the output gradient ``dout`` [T, H, D]."""
    _check(_OP_BWD, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=True)
    check_tensor(_OP_BWD, "dout", dout, shape=q.shape, device=q.device, dtypes=(q.dtype,))
    return gdpa_backward_reference(dout, q, k, v, q_offsets, max_seq_len_q, activation, scale)


@gdpa_backward.register_kernel("cuda")
def _(dout, q, k, v, q_offsets, max_seq_len_q, activation, scale):
    check_tensor(_OP_BWD, "dout", dout, shape=q.shape, device=q.device, dtypes=(q.dtype,))
    if q.shape[2] not in CUDA_HEAD_DIMS:  # no kernel for this head dim: the reference, on the GPU
        _check(_OP_BWD, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=True)
        return gdpa_backward_reference(dout, q, k, v, q_offsets, max_seq_len_q, activation, scale)
    _check(_OP_BWD, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=VALIDATE_CUDA_OFFSETS)
    from ..kernels.triton.gdpa import gdpa_bwd_triton

    return gdpa_bwd_triton(dout, q, k, v, q_offsets, max_seq_len_q, activation, scale)


@gdpa_backward.register_fake
def _(dout, q, k, v, q_offsets, max_seq_len_q, activation, scale):
    _check(_OP_BWD, q, k, v, q_offsets, max_seq_len_q, activation, scale, values=False)
    check_tensor(_OP_BWD, "dout", dout, shape=q.shape, device=q.device, dtypes=(q.dtype,))
    c = torch.contiguous_format
    return (torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c),
            torch.empty_like(v, memory_format=c))
