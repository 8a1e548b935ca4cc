"""Triton kernels and launchers for ``fusenorm::gdpa`` / ``fusenorm::gdpa_backward`` (gdpa.py has the math).

Semantics are those of ``gdpa_reference`` / ``gdpa_backward_reference``: S = Q K^T and every other product
accumulate in fp32, act and act' run on fp32 tiles (activations.act_fwd / act_bwd), outputs are rounded once
to the inputs' dtype. Unlike the reference, P (forward, dV) and dS (dQ, dK) are rounded to the inputs' dtype
before their second GEMM, so both GEMMs run on the tensor cores (the reference Triton GDPA does the same):
an error of u * sum_s |P[t, s]| |v[s, d]| (u = the dtype's unit roundoff) on top of the output rounding.

Layout (contiguous; the launchers copy non-contiguous inputs): q, dout, O, dq are [T, H, D], element
(t, h, d) at (t * H + h) * D + d; k, v, dk, dv are [B, S, H, D], element (b, s, h, d) at ((b * S + s) * H + h)
* D + d. Tile bases are int64 (T * H * D may pass 2^31), offsets inside a tile int32 (``_row_tile``).

Three kernels, each a 1-D grid (no 65535 limit on any axis):
- ``_gdpa_fwd_kernel``: one program per (Q tile, b, h), the Q tiles of one (b, h) adjacent in launch order
  (they read the same K/V, which stays in L2). The grid has cdiv(max_seq_len_q, BLOCK_M) Q tiles per (b, h),
  sized without reading the offsets on the host; tiles past their sequence's end do nothing. A program keeps
  its Q tile and the fp32 O tile on chip and walks K/V in BLOCK_S chunks (S <= 256: 1-4 chunks):
  S_tile = q k^T, P = act(S_tile) * scale rounded to the dtype, O += P v.
- ``_gdpa_bwd_dq_kernel``: the same grid; per Q tile and K/V chunk it recomputes S, dP = dO v^T,
  dS = act'(S) * scale * dP and accumulates dQ += dS k.
- ``_gdpa_bwd_dkdv_kernel``: one program per (S tile, b, h): its K/V tile and the fp32 dK/dV tiles stay on
  chip while it walks the sequence's Q tiles, recomputing S^T = k q^T (the transposed tile, so no transpose
  of the result is needed): dV += P^T dO, dS^T = act'(S^T) * scale * (v dO^T), dK += dS^T q. Each dK/dV
  element has one owner, so no atomics; a sequence of length 0 writes zeros.
Padding: rows past a sequence's end and K/V rows past S load as 0, so their S entries are 0, act(0) = 0 for
every activation, and their P, dP and dS entries are 0: nothing leaks into valid outputs.

Offsets are not validated on CUDA by default (gdpa.py says why): ``_seq_bounds`` clamps [start, end) into
[0, T] so that bad offsets cannot address memory outside q and O.

Block sizes (``fwd_config``, ``dq_config``, ``dkdv_config``): at D = 128 the fastest of a sweep on the H200
(forward 64 x 32 (Q rows x K/V rows per chunk), dQ and dK/dV 64 x 64, 4 warps); at D <= 64 not timed, chosen
so that ptxas reports no spills for sm_90 (forward 128 x 64, dQ 128 x 32, dK/dV 64 x 64, 8 warps); dK/dV
tiles of 32 K/V rows when the grid would not fill the SMs; fp32 inputs 32 x 16 at 4 warps. Tiles shrink to
the next power of two >= 16 of short sequences / short S. The loads are masked pointer loads; TMA
(device-side descriptors bounded per sequence) would free the registers the pointer tiles take and allow
larger tiles: the next speed step.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import config as settings
from .common import dot_input_precision, num_sms, pow2_at_least
from ...activations import activation_code
from .activations import act_bwd, act_fwd

__all__ = ["GdpaConfig", "fwd_config", "dq_config", "dkdv_config", "gdpa_fwd_triton", "gdpa_bwd_triton",
           "gluon_unsupported", "run_gluon"]


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _seq_bounds(off_ptr, b, T):
    """[start, end) of sequence b as int64, clamped into [0, T] (unvalidated offsets stay inside q)."""
    start = tl.load(off_ptr + b).to(tl.int64)
    end = tl.load(off_ptr + b + 1).to(tl.int64)
    end = tl.minimum(tl.maximum(end, 0), T)
    start = tl.minimum(tl.maximum(start, 0), end)
    return start, end


@triton.jit
def _tile_coords(n_tiles, H):
    """(tile, b, h) of this program on a 1-D grid of n_tiles * B * H, the tiles of one (b, h) adjacent."""
    pid = tl.program_id(0)
    tile = pid % n_tiles
    bh = pid // n_tiles
    return tile, (bh // H).to(tl.int64), bh % H


@triton.jit
def _row_tile(row0, h, n_rows, H, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """(base, offsets, mask) of rows row0 .. row0 + BLOCK_M of head h in a contiguous [rows, H, D] tensor:
    element (row0 + i, h, d) is at base + offsets[i, d]; rows i >= n_rows are masked. Only the scalar base is
    int64; the per-element offsets are int32 (a [BLOCK_M, D] tile of int64 offsets costs two registers per
    element: the first version spilled on sm_90)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs = offs_m[:, None] * (H * D) + tl.arange(0, D)[None, :]
    return (row0 * H + h) * D, offs, (offs_m < n_rows)[:, None]


@triton.jit
def _gdpa_fwd_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, o_ptr, T, H, S, n_m_tiles, scale,
    ACT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """O[rows, h] = sum_s act(q[rows, h] . k[b, s, h]) * scale * v[b, s, h] for one Q tile of sequence b."""
    pid_m, b, h = _tile_coords(n_m_tiles, H)
    start, end = _seq_bounds(off_ptr, b, T)
    row0 = start + pid_m * BLOCK_M
    if row0 < end:  # tiles past the sequence's end (the grid covers max_seq_len_q) do nothing
        n_rows = (end - row0).to(tl.int32)
        q_base, q_offs, row_ok = _row_tile(row0, h, n_rows, H, D, BLOCK_M)
        q = tl.load(q_ptr + q_base + q_offs, mask=row_ok, other=0.0)
        kv_base, kv_offs, _ = _row_tile(b * S, h, S, H, D, BLOCK_S)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            s_ok = (tl.arange(0, BLOCK_S) < S - s0)[:, None]
            k = tl.load(k_ptr + kv_base + kv_offs, mask=s_ok, other=0.0)
            v = tl.load(v_ptr + kv_base + kv_offs, mask=s_ok, other=0.0)
            # S chunk in fp32; the activation in fp32; P rounded to the dtype for the tensor cores.
            scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
            p = act_fwd(scores, ACT) * scale
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
            kv_base += BLOCK_S * H * D
        tl.store(o_ptr + q_base + q_offs, acc.to(o_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gdpa_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, off_ptr, dq_ptr, T, H, S, n_m_tiles, scale,
    ACT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dQ[rows, h] = sum_s act'(S) * scale * (dO . v[b, s, h]) * k[b, s, h] for one Q tile (S recomputed)."""
    pid_m, b, h = _tile_coords(n_m_tiles, H)
    start, end = _seq_bounds(off_ptr, b, T)
    row0 = start + pid_m * BLOCK_M
    if row0 < end:
        n_rows = (end - row0).to(tl.int32)
        q_base, q_offs, row_ok = _row_tile(row0, h, n_rows, H, D, BLOCK_M)
        q = tl.load(q_ptr + q_base + q_offs, mask=row_ok, other=0.0)
        do = tl.load(do_ptr + q_base + q_offs, mask=row_ok, other=0.0)
        kv_base, kv_offs, _ = _row_tile(b * S, h, S, H, D, BLOCK_S)
        dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            s_ok = (tl.arange(0, BLOCK_S) < S - s0)[:, None]
            k = tl.load(k_ptr + kv_base + kv_offs, mask=s_ok, other=0.0)
            v = tl.load(v_ptr + kv_base + kv_offs, mask=s_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            ds = act_bwd(scores, ACT) * scale * dp
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
            kv_base += BLOCK_S * H * D
        tl.store(dq_ptr + q_base + q_offs, dq.to(dq_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gdpa_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, off_ptr, dk_ptr, dv_ptr, T, H, S, n_s_tiles, scale,
    ACT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dV[b, s_tile, h] = P^T dO and dK[b, s_tile, h] = dS^T q over all Q tiles of sequence b (transposed
    tiles: S^T = k q^T is [BLOCK_S, BLOCK_M])."""
    pid_s, b, h = _tile_coords(n_s_tiles, H)
    start, end = _seq_bounds(off_ptr, b, T)
    s0 = pid_s * BLOCK_S
    kv_base, kv_offs, s_ok = _row_tile(b * S + s0, h, S - s0, H, D, BLOCK_S)
    k = tl.load(k_ptr + kv_base + kv_offs, mask=s_ok, other=0.0)
    v = tl.load(v_ptr + kv_base + kv_offs, mask=s_ok, other=0.0)
    dk = tl.zeros((BLOCK_S, D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_S, D), dtype=tl.float32)
    q_base, q_offs, _ = _row_tile(start, h, 0, H, D, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        row_ok = (offs_m < end - m0)[:, None]
        q = tl.load(q_ptr + q_base + q_offs, mask=row_ok, other=0.0)
        do = tl.load(do_ptr + q_base + q_offs, mask=row_ok, other=0.0)
        scores_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        p_t = act_fwd(scores_t, ACT) * scale
        dv = tl.dot(p_t.to(q.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = act_bwd(scores_t, ACT) * scale * dp_t
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        q_base += BLOCK_M * H * D
    tl.store(dk_ptr + kv_base + kv_offs, dk.to(dk_ptr.dtype.element_ty), mask=s_ok)
    tl.store(dv_ptr + kv_base + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=s_ok)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


class GdpaConfig(NamedTuple):
    """One kernel's launch configuration: the Q tile (rows), the K/V tile (rows of S), warps, stages."""

    block_m: int
    block_s: int
    warps: int
    stages: int


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output the launchers write comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fit(cfg: GdpaConfig, max_seq_len_q: int, s: int) -> GdpaConfig:
    """Tiles no larger than the next power of two >= 16 of the longest sequence and of S (tl.dot's minimum)."""
    return cfg._replace(block_m=min(cfg.block_m, pow2_at_least(max_seq_len_q)),
                        block_s=min(cfg.block_s, pow2_at_least(s)))


# D <= 64: the register budget (sm_90, Triton 3.6, ptxas's resource usage of the AOT-compiled kernels, every
# activation): these tiles compile without spills.
# D = 128 (bf16) from a sweep on the H200 (B = 768, S = 128, Lmax = 1024, H in {2, 8}; 24 forward, 16 dQ and
# 12 dK/dV configurations): 4 warps won every kernel (a 64-row wgmma tile is one warpgroup's), forward
# 64 x 32 x 3 stages 0.28 ms at H = 2 against 0.53 ms for the first guess (128 x 32, 8 warps), backward
# 0.79 ms against 1.60. D <= 64: not measured (the offline register budget's choice).
_FWD = {64: GdpaConfig(128, 64, 8, 3), 128: GdpaConfig(64, 32, 4, 3)}
_DQ = {64: GdpaConfig(128, 32, 8, 2), 128: GdpaConfig(64, 64, 4, 2)}
_DKDV = {64: GdpaConfig(64, 64, 8, 2), 128: GdpaConfig(64, 64, 4, 2)}
_FP32 = GdpaConfig(32, 16, 4, 2)  # fp32 operands: twice the bytes per element, the smallest tiles


def fwd_config(max_seq_len_q: int, s: int, d: int, dtype: torch.dtype) -> GdpaConfig:
    """Forward: the tiles of ``_FWD`` (measured at D = 128), shrunk to short sequences / short S."""
    cfg = _FP32 if dtype == torch.float32 else _FWD[64 if d <= 64 else 128]
    return _fit(cfg, max_seq_len_q, s)


def dq_config(max_seq_len_q: int, s: int, d: int, dtype: torch.dtype) -> GdpaConfig:
    """dQ: it holds q, dO, the dQ accumulator and two score-sized tiles (S, dP); tiles of ``_DQ``."""
    cfg = _FP32 if dtype == torch.float32 else _DQ[64 if d <= 64 else 128]
    return _fit(cfg, max_seq_len_q, s)


def dkdv_config(max_seq_len_q: int, s: int, d: int, dtype: torch.dtype, bh: int, device: torch.device) -> GdpaConfig:
    """dK/dV: two fp32 [BLOCK_S, D] accumulators besides the K/V tile and two score-sized tiles (``_DKDV``);
    32-row K/V tiles when 64-row ones would not give every SM a program (few sequences: each program walks
    a whole sequence)."""
    if dtype == torch.float32:
        return _fit(_FP32, max_seq_len_q, s)
    cfg = _DKDV[64 if d <= 64 else 128]
    if triton.cdiv(s, cfg.block_s) * bh < num_sms(device):
        cfg = cfg._replace(block_s=32)
    return _fit(cfg, max_seq_len_q, s)


def _common_args(q: Tensor, k: Tensor, activation: str):
    return dict(ACT=activation_code(activation, "fusenorm::gdpa"), D=q.shape[2],
                INPUT_PRECISION=dot_input_precision(q.dtype, q.device))


def _check_head_dim(d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"fusenorm::gdpa kernels: head dim D = {d} must be a power of two >= 16")


_GLUON_SPILLED: set = set()  # signatures whose Gluon specialization spilled: the Triton kernel serves them
# The Gluon backward (kernels/hopper/gdpa.py: dQ, dK/dV) on sm_90 where it takes the inputs; a switch so the
# benchmarks and tests can time and check the Triton backward beside it (results in docs/history/design-history.md).
GLUON_BACKWARD = True


def gluon_unsupported(q: Tensor, k: Tensor) -> Optional[str]:
    """Why the sm_90 Gluon forward (kernels/hopper/gdpa.py) cannot take these inputs; None when it can."""
    if not settings.gluon:
        return "off (config.gluon / FUSENORM_GLUON)"
    from ..hopper import _compat

    if _compat.GLUON_ERROR is not None:  # the kernel module itself needs Gluon to import
        return f"this triton has no usable Gluon ({_compat.GLUON_ERROR})"
    from ..hopper import gdpa as hopper

    return hopper.unsupported(q, k)


def run_gluon(key: tuple, tensors: tuple, launch: Callable[[], None]) -> bool:
    """Run ``launch()``, a launch of a Gluon kernel of kernels/hopper/gdpa.py whose inputs the caller has found
    supported, unless a tensor's storage address is one TMA cannot use or this signature (``key``) spilled
    before (its specialization is then never compiled again). False: the caller runs its Triton kernel."""
    from ..hopper import gdpa as hopper
    from ..hopper.common import SpillError

    if key in _GLUON_SPILLED or hopper.misaligned(*tensors) is not None:
        return False
    try:
        launch()
    except SpillError:
        _GLUON_SPILLED.add(key)
        return False
    return True


def _gluon_forward(q, k, v, q_offsets, o, max_seq_len_q: int, activation: str, scale: float) -> bool:
    """Run the Gluon forward into o where it takes the inputs; False where the Triton kernel must."""
    if gluon_unsupported(q, k) is not None:
        return False
    from ..hopper import gdpa as hopper

    act = activation_code(activation, "fusenorm::gdpa")
    return run_gluon(("fwd", q.shape[1:], k.shape[1:], q.dtype, act), (q, k, v, o),
                     lambda: hopper.gdpa_fwd_gluon(q, k, v, q_offsets, o, max_seq_len_q, act, scale))


def _gluon_backward(dout, q, k, v, q_offsets, dq, dk, dv, max_seq_len_q: int, activation: str,
                    scale: float) -> bool:
    """Run the Gluon backward into (dq, dk, dv) where it is switched on and takes the inputs."""
    if not GLUON_BACKWARD or gluon_unsupported(q, k) is not None:
        return False
    from ..hopper import gdpa as hopper

    if hopper.backward_unsupported(q, k) is not None:
        return False
    act = activation_code(activation, "fusenorm::gdpa_backward")
    return run_gluon(("bwd", q.shape[1:], k.shape[1:], q.dtype, act), (dout, q, k, v, dq, dk, dv),
                     lambda: hopper.gdpa_bwd_gluon(dout, q, k, v, q_offsets, dq, dk, dv, max_seq_len_q, act, scale))


def gdpa_fwd_triton(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int, activation: str,
                    scale: float, config: Optional[GdpaConfig] = None) -> Tensor:
    """O of ``gdpa_reference``; inputs already checked by the op (non-contiguous ones are copied here).
    On sm_90 the Gluon kernel runs where it takes the inputs (``gluon_unsupported``), else the Triton
    kernel. ``config``: a test hook (the Triton kernel's block sizes; given, the Triton kernel runs)."""
    t, h, d = q.shape
    nb, s = k.shape[0], k.shape[1]
    _check_head_dim(d)
    o = _alloc((t, h, d), q.dtype, q.device)
    if t == 0 or nb * h == 0 or max_seq_len_q == 0:
        return o
    q, k, v, q_offsets = q.contiguous(), k.contiguous(), v.contiguous(), q_offsets.contiguous()
    if config is None and _gluon_forward(q, k, v, q_offsets, o, max_seq_len_q, activation, scale):
        return o
    cfg = config or fwd_config(max_seq_len_q, s, d, q.dtype)
    n_m = triton.cdiv(max_seq_len_q, cfg.block_m)
    _gdpa_fwd_kernel[(n_m * nb * h,)](
        q, k, v, q_offsets, o, t, h, s, n_m, float(scale),
        BLOCK_M=cfg.block_m, BLOCK_S=cfg.block_s, num_warps=cfg.warps, num_stages=cfg.stages,
        **_common_args(q, k, activation),
    )
    return o


def gdpa_bwd_triton(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, max_seq_len_q: int,
                    activation: str, scale: float, dq_cfg: Optional[GdpaConfig] = None,
                    dkdv_cfg: Optional[GdpaConfig] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``gdpa_backward_reference``; inputs already checked by the op (non-contiguous ones are
    copied here). ``dq_cfg`` / ``dkdv_cfg``: test hooks (block sizes); None takes the heuristics."""
    t, h, d = q.shape
    nb, s = k.shape[0], k.shape[1]
    _check_head_dim(d)
    dq = _alloc((t, h, d), q.dtype, q.device)
    dk = _alloc((nb, s, h, d), k.dtype, k.device)
    dv = _alloc((nb, s, h, d), v.dtype, v.device)
    if nb * h * s == 0:
        return dq, dk, dv
    if t == 0 or max_seq_len_q == 0:  # no tokens at all: K and V get no gradient
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    q, k, v, dout, q_offsets = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), q_offsets.contiguous()
    if dq_cfg is None and dkdv_cfg is None and _gluon_backward(dout, q, k, v, q_offsets, dq, dk, dv, max_seq_len_q,
                                                              activation, scale):
        return dq, dk, dv
    common = _common_args(q, k, activation)
    cfg = dq_cfg or dq_config(max_seq_len_q, s, d, q.dtype)
    n_m = triton.cdiv(max_seq_len_q, cfg.block_m)
    _gdpa_bwd_dq_kernel[(n_m * nb * h,)](
        q, k, v, dout, q_offsets, dq, t, h, s, n_m, float(scale),
        BLOCK_M=cfg.block_m, BLOCK_S=cfg.block_s, num_warps=cfg.warps, num_stages=cfg.stages, **common,
    )
    cfg = dkdv_cfg or dkdv_config(max_seq_len_q, s, d, q.dtype, nb * h, q.device)
    n_s = triton.cdiv(s, cfg.block_s)
    _gdpa_bwd_dkdv_kernel[(n_s * nb * h,)](
        q, k, v, dout, q_offsets, dk, dv, t, h, s, n_s, float(scale),
        BLOCK_M=cfg.block_m, BLOCK_S=cfg.block_s, num_warps=cfg.warps, num_stages=cfg.stages, **common,
    )
    return dq, dk, dv
