"""Deferred normalization's arithmetic outside the GEMM (plain torch, no triton): the statistics a producer
writes and their merge, the fold of a norm's affine into a consumer's operand and its cache per weight
version, and the launch of the Gluon kernel on folded operands (kernels/hopper/deferred_mm.py).

The op (ops/deferred_norm.py) documents the semantics; its reference is ``folded`` then ``applied`` here,
which the Gluon kernel reproduces. ``partial_stats`` and ``merge_stats`` are also what the pattern inlines
into a graph as aten ops (patterns/deferred_norm.py), and what the tuning measures with.

Statistics layout: [Q, M, T] fp32, T = ceil(N / tile), Q = 1 for RMSNorm (each tile's sum of squares), 2 for
LayerNorm (each tile's mean, and its sum of squared deviations from that mean: Chan's partials, which merge
exactly at any |mean| / std, each weighed by its tile's column count).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import memory
from .fold import fold_norm_affine

NONE, RMS, LN = 0, 1, 2  # which norm statistics serve (the op's a_norm / out_norm)


def n_tiles(n: int, tile: int) -> int:
    return -(-n // tile)


def stats_shape(m, n: int, norm: int, tile: int) -> tuple:
    """The statistics of [m, n] values for ``norm`` in tiles of ``tile`` columns (0-size without a norm)."""
    if norm == NONE:
        return (0,)
    return (1 if norm == RMS else 2, m, n_tiles(n, tile))


def _tile_counts(n: int, tile: int, device) -> Tensor:
    """Columns of each statistics tile (the last one may be short)."""
    t = n_tiles(n, tile)
    return (n - torch.arange(t, device=device) * tile).clamp(max=tile).float()


def partial_stats(c: Tensor, norm: int, tile: int) -> Tensor:
    """The statistics [Q, M, T] of c [M, N] as stored (its own dtype, read as fp32): per row and tile of
    ``tile`` columns, RMSNorm's sum of squares, or LayerNorm's (tile mean, sum of squared deviations)."""
    m, n = c.shape
    t = n_tiles(n, tile)
    cf = torch.nn.functional.pad(c.float(), (0, t * tile - n)).view(m, t, tile)
    if norm == RMS:
        return cf.square().sum(-1).unsqueeze(0)
    valid = (torch.arange(t * tile, device=c.device) < n).view(t, tile)
    mean_t = cf.sum(-1) / _tile_counts(n, tile, c.device)
    dev = torch.where(valid, cf - mean_t.unsqueeze(-1), 0.0)
    return torch.stack([mean_t, dev.square().sum(-1)])


def merge_stats(stats: Tensor, n: int, tile: int, eps: float, norm: int) -> tuple[Tensor, Tensor]:
    """(mean [M] (0-size for RMSNorm), rstd [M]) of rows of n columns from their partial statistics: the
    norm's own statistics (biased variance), merged in fp32 by Chan's formula for LayerNorm. Plain torch ops:
    in a graph, Inductor fuses them into the kernel that reads them."""
    if norm == RMS:
        return stats.new_empty((0,)), torch.rsqrt(stats[0].sum(-1) / n + eps)
    w = _tile_counts(n, tile, stats.device)
    mean_t, m2_t = stats[0], stats[1]
    mean = (mean_t * w).sum(-1) / n
    m2 = m2_t.sum(-1) + ((mean_t - mean.unsqueeze(-1)).square() * w).sum(-1)
    return mean, torch.rsqrt(m2 / n + eps)


def folded(b, bias, norm_weight, norm_bias, a_norm) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(b', bias', colsum) the epilogue applies (module docstring); b and bias themselves without a norm."""
    if a_norm == NONE:
        return b, bias, None
    return fold_norm_affine(b, bias, norm_weight, norm_bias, b.dtype, a_norm == RMS)


def row_residual(residual: Tensor, res_rows: Optional[Tensor]) -> Tensor:
    """The residual's term of the epilogue in fp32: the residual, or with its per-row terms ``res_rows``
    [1 or 3, M] applied: scale * r, or scale * (r - center) + shift."""
    r = residual.float()
    if res_rows is None:
        return r
    if res_rows.shape[0] == 3:
        return (r - res_rows[1].unsqueeze(-1)) * res_rows[0].unsqueeze(-1) + res_rows[2].unsqueeze(-1)
    return r * res_rows[0].unsqueeze(-1)


def applied(a, b, bias, colsum, residual, a_stats, a_eps, a_norm, a_tile, out_norm, out_tile, res_rows=None):
    """The op's semantics on operands already folded (``folded``): the reference's epilogue."""
    acc = a.float() @ b.float()
    if a_norm != NONE:
        mean, rstd = merge_stats(a_stats, a.shape[1], a_tile, a_eps, a_norm)
        if a_norm == LN:
            acc = acc - mean.unsqueeze(-1) * colsum
        acc = acc * rstd.unsqueeze(-1)
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        acc = acc + row_residual(residual, res_rows)
    c = acc.to(a.dtype)
    stats = partial_stats(c, out_norm, out_tile) if out_norm != NONE else c.new_empty((0,), dtype=torch.float32)
    return c, stats


# ----------------------------------------------------------------------------------------------------------
# The backward of a deferred norm (training graphs: patterns/deferred_norm.py inlines these as aten ops)
# ----------------------------------------------------------------------------------------------------------
#
# A consumer computes h = rstd * (x @ W'^T) [- rstd * mean * colsum] + bias' with W' = W * gamma (the fold). Its
# output gradient dh therefore reaches the norm's input through the same algebra: with g = dh * rstd,
#     dx = g @ W' + scale * (x - center) + shift            (summed over the consumers: one GEMM over [g_1 g_2 ..])
#     scale = -rstd^2 * B / N,  B = sum_j dh_j * (h_j - bias'_j)   (the row's dot product of dxhat and xhat,
#                                                                 read from the consumer's own output)
#     center = mean, shift = -rstd * A / N,  A = dh . colsum       (LayerNorm; RMSNorm: center = shift = 0)
# so the GEMM that computes dx applies the norm's whole backward in its epilogue (``res_rows``), with x as
# its residual; the row reductions B and A read dh and h, which the kernel that computes dh reads anyway.
# The weight gradient reads x, never norm(x): dW = (g^T @ x - [LayerNorm] (g^T mean) 1^T) * gamma + colsum(dh)
# beta^T, and the norm's own parameter gradients follow from the same [N2, N] product:
# dgamma = sum_j W_jk * (dh^T xhat)_jk, dbeta = colsum(dh) @ W.
# In a tower h is the next norm's input and dh that norm's input gradient, which a norm makes orthogonal to
# its input up to eps: sum_j dh_j h_j = eps * rstd'^2 * B' = -eps' * N' * scale' from the next norm's own
# per-row scale (``tower_dot``), so the B reduction need not read h at all there.


def output_dot(dh: Tensor, h: Tensor) -> Tensor:
    """sum_j dh_j h_j per row (fp32): the part of B that reads the consumer's output."""
    return (dh.float() * h.float()).sum(-1)


def tower_dot(res_rows: Tensor, eps: float, n: int) -> Tensor:
    """``output_dot`` where dh is a deferred norm's input gradient and h that norm's input (see above), from
    the norm's backward's per-row terms."""
    return -eps * n * res_rows[0]


def consumer_gradients(dhs, hdots, bs, biases, rstd, mean, gamma, beta, norm: int, dtype):
    """For the consumers (their output gradients ``dhs`` [M, N2_i], ``hdots`` = ``output_dot`` of each with its
    output, forward operands ``bs`` [N, N2_i] and biases): (the GEMM's operands g_i = dh_i * rstd and W'_i^T,
    the residual's per-row terms [1 or 3, M]) of the norm's input gradient (see above). fp32 terms; the
    operands in ``dtype``."""
    n = bs[0].shape[0]
    r = rstd.unsqueeze(-1)
    dots = sums = 0.0
    gs, ws = [], []
    for dh, hdot, b, bias in zip(dhs, hdots, bs, biases):
        b_f, bias_f, colsum = fold_norm_affine(b, bias, gamma, beta, dtype, norm == RMS)
        dhf = dh.float()
        dots = dots + hdot
        if bias_f is not None:
            dots = dots - (dhf * bias_f.float()).sum(-1)
        if norm == LN:
            sums = sums + (dhf * colsum).sum(-1)
        gs.append((dhf * r).to(dtype))
        ws.append(b_f.t())
    scale = -(rstd * rstd) * dots / n
    rows = [scale] if norm == RMS else [scale, mean, -rstd * sums / n]
    return gs, ws, torch.stack(rows)


def mm_fp32(a: Tensor, b: Tensor, fp32_out: bool = True) -> Tensor:
    """a @ b as fp32: 16-bit operands on CUDA through cuBLAS's fp32 output (``fp32_out``: where the torch has
    it), else rounded to their dtype and widened (``fp32_out`` False) or, off CUDA, multiplied in fp32."""
    if a.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16) and a.dtype == b.dtype:
        return torch.mm(a, b, out_dtype=torch.float32) if fp32_out else torch.mm(a, b).float()
    return a.float() @ b.float()


def consumer_weight_gradient(g, dh, x, mean, w, gamma, beta, norm: int, want_wgrad: bool, fp32_out: bool = True):
    """(dW [N2, N] in dh's dtype (None unless ``want_wgrad``), this consumer's share of dgamma and dbeta
    (fp32 [N], None where the norm has no weight / bias)) from g = dh * rstd, the norm's input x [M, N], its
    mean and the consumer's weight w [N2, N] (see above). ``fp32_out``: ``mm_fp32``'s; LayerNorm needs it (its
    centering cancels |mean| / std digits of a 16-bit product)."""
    t = mm_fp32(g.t(), x, fp32_out)
    if norm == LN:
        t = t - (g.float() * mean.unsqueeze(-1)).sum(0).unsqueeze(-1)
    col = dh.float().sum(0) if beta is not None else None
    dw = None
    if want_wgrad:
        dw = t * gamma.float() if gamma is not None else t
        if beta is not None:
            dw = dw + col.unsqueeze(-1) * beta.float()
        dw = dw.to(dh.dtype)
    dgamma = (t * w.float()).sum(0) if gamma is not None else None
    dbeta = col @ w.float() if beta is not None else None
    return dw, dgamma, dbeta


# ----------------------------------------------------------------------------------------------------------
# The fold, kept per weight version
# ----------------------------------------------------------------------------------------------------------

# The folds of the weights inference graphs read, by the identity and version of their inputs. An entry holds
# its inputs, so no other tensor can take their addresses while it stands; a new version of a weight (an
# optimizer step, load_state_dict, any in-place write) misses. Bounded: the oldest entries go first.
_FOLDS: "OrderedDict[tuple, tuple]" = memory.cache(OrderedDict())
FOLD_CACHE_SIZE = 256


def _version_key(ts) -> Optional[tuple]:
    key = []
    for t in ts:
        if t is None:
            key.append(None)
            continue
        try:
            version = t._version
        except RuntimeError:  # an inference tensor has no version counter: never cached
            return None
        key.append((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version))
    return tuple(key)


def cached_fold(b, bias, norm_weight, norm_bias, a_norm, cache: bool, fold: Callable):
    """``fold(b, bias, norm_weight, norm_bias)``, or the one kept for these inputs' versions (``cache``)."""
    key = _version_key((b, bias, norm_weight, norm_bias)) if cache and a_norm != NONE else None
    if key is not None:
        key = key + (a_norm,)
        hit = _FOLDS.get(key)
        if hit is not None:
            _FOLDS.move_to_end(key)
            return hit[1]
    out = fold(b, bias, norm_weight, norm_bias)
    if key is not None:
        _FOLDS[key] = ((b, bias, norm_weight, norm_bias), out)
        while len(_FOLDS) > FOLD_CACHE_SIZE:
            _FOLDS.popitem(last=False)
    return out


def fold_cuda(a_norm):
    """The fold on the GPU: one launch (kernels/triton/norm_mm.fold_one_launch) for 16-bit weights, the fold
    kernel compiled on the first call and launched directly after it (one launch plan's arguments keep their
    signature: no JIT argument binding per call)."""
    compiled: list = []

    def fold(b, bias, norm_weight, norm_bias):
        if a_norm == NONE:
            return b, bias, None
        if b.dtype in (torch.float16, torch.bfloat16) and 1 in b.stride():
            from .triton.norm_mm import fold_one_launch

            return fold_one_launch(b, bias, norm_weight, norm_bias, a_norm == RMS, compiled)
        return folded(b, bias, norm_weight, norm_bias, a_norm)

    return fold


def launch(args: tuple, config, alloc: Callable, plan_out: Optional[list] = None) -> tuple[Tensor, Tensor]:
    """(c, stats) of the op's arguments ``args`` from the Gluon kernel with ``config`` (one of its
    ``candidates``), the fold kept per weight version where the op says so, outputs from ``alloc(shape,
    dtype, device)``. Raises ``hopper.common.SpillError`` (nothing launched) for a specialization that spills.
    ``plan_out``: where the function that launches the same again on arguments of this signature goes."""
    from .hopper import deferred_mm as hopper

    a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile, cache, rows = args
    m, n = a.shape[0], b.shape[1]
    fold = fold_cuda(a_norm)
    shape = stats_shape(m, n, out_norm, out_tile)
    b_f, bias_f, colsum = cached_fold(b, bias, norm_weight, norm_bias, a_norm, cache, fold)
    c = alloc((m, n), a.dtype, a.device)
    stats = alloc(shape, torch.float32, a.device)
    plan = hopper.deferred_mm_gluon(a, b_f, bias_f, colsum, residual, a_stats, a_eps, a_norm, a_tile, out_norm,
                                    out_tile, c, stats, config, res_rows=rows)
    if plan_out is not None:
        dtype, device = a.dtype, a.device

        def again(*call):  # the op's arguments, as ``args``: the scalars are the plan's
            a, b, bias, residual, a_stats, norm_weight, norm_bias, res_rows = call[:7] + call[13:]
            c = alloc((m, n), dtype, device)
            stats = alloc(shape, torch.float32, device)
            b_f, bias_f, colsum = cached_fold(b, bias, norm_weight, norm_bias, a_norm, cache, fold)
            plan(a, b_f, bias_f, colsum, residual, a_stats, c, stats, res_rows)
            return c, stats

        plan_out.append(again)
    return c, stats
