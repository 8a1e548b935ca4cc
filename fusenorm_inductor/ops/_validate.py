"""Input checks shared by the fused ops: clear errors naming the argument, raised before any kernel runs."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    op: str,
    name: str,
    t: Optional[Tensor],
    *,
    shape: Optional[Sequence[int]] = None,
    ndim: Optional[int] = None,
    device: Optional[torch.device] = None,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    required: bool = True,
) -> None:
    """Raise ValueError/TypeError if ``t`` is missing, of the wrong rank/shape/dtype or on another device."""
    if t is None:
        if required:
            raise ValueError(f"{op}: '{name}' is required")
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: '{name}' must be a Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: '{name}' must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: '{name}' must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: '{name}' must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: '{name}' is on {t.device}, expected {device} like the other inputs")


def check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")


def check_jagged_attention(op: str, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
                           activation: str) -> None:
    """The inputs every jagged-attention op takes (gdpa, flash_norm_attention): q [T, H, D] (fp32/fp16/bf16),
    k and v [B, S, H, D] of q's dtype and device, int32 q_offsets [B + 1], max_seq_len_q a non-negative int,
    a known activation. Metadata only: the fake implementations run it too."""
    from ..activations import activation_code

    check_tensor(op, "q", q, ndim=3)
    h, d = q.shape[1], q.shape[2]
    check_tensor(op, "k", k, ndim=4, device=q.device, dtypes=(q.dtype,))
    check_tensor(op, "v", v, ndim=4, device=q.device, dtypes=(q.dtype,))
    if tuple(k.shape[2:]) != (h, d):
        raise ValueError(f"{op}: k and v must both be [B, S, H, D] with q's (H, D): q is [T, H, D] = "
                         f"{tuple(q.shape)}, k is {tuple(k.shape)}: expected [B, S, {h}, {d}]")
    if v.shape != k.shape:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B, S, H, D]: v must have "
                         f"k's shape")
    check_tensor(op, "q_offsets", q_offsets, shape=(k.shape[0] + 1,), device=q.device, dtypes=(torch.int32,))
    if isinstance(max_seq_len_q, bool) or not isinstance(max_seq_len_q, int) or max_seq_len_q < 0:
        raise ValueError(f"{op}: max_seq_len_q must be a non-negative int, got {max_seq_len_q!r}")
    activation_code(activation, op)


def check_offsets_values(op: str, q_offsets: Tensor, t: int, max_seq_len_q: int) -> None:
    """The offsets' values: start at 0, non-decreasing, end at T, no length above max_seq_len_q. Reads them
    on the host: a sync on CUDA, so the ops decide when to call it."""
    offs = q_offsets.cpu()
    if offs[0].item() != 0:
        raise ValueError(f"{op}: q_offsets must start at 0: q_offsets[0] must be 0, got {offs[0].item()}")
    if offs[-1].item() != t:
        raise ValueError(f"{op}: q_offsets must end at T: q_offsets[-1] = {offs[-1].item()} must equal T = "
                         f"q.shape[0] = {t}")
    lengths = offs[1:] - offs[:-1]
    if lengths.numel():
        if (lengths < 0).any():
            i = int((lengths < 0).nonzero()[0])
            raise ValueError(f"{op}: q_offsets must be non-decreasing, but q_offsets[{i + 1}] = "
                             f"{offs[i + 1].item()} < q_offsets[{i}] = {offs[i].item()}")
        longest = int(lengths.max())
        if longest > max_seq_len_q:
            raise ValueError(f"{op}: a sequence has {longest} tokens but max_seq_len_q = {max_seq_len_q}")
