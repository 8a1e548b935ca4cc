"""The norm's affine folded into the next GEMM's operand (plain torch: the kernels' host side and the ops'
references share it; no triton).

For ``c = norm(a) @ b + bias`` with the norm's weight and bias (docs/algorithms.md section 2):
    b'     = weight[:, None] * b            rounded once to the operand dtype (the tensor cores' type)
    bias'  = bias + norm_bias @ b           fp32 [N]
    colsum = sum_k b'[k, :]                 fp32 [N] (LayerNorm), from the *rounded* b', so the rank-1
                                            correction subtracts exactly what the GEMM added
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["fold_norm_affine"]


def fold_norm_affine(
    b: Tensor,
    bias: Optional[Tensor],
    weight: Optional[Tensor],
    norm_bias: Optional[Tensor],
    operand_dtype: torch.dtype,
    is_rms: bool,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(b', bias', colsum) of the module docstring.

    b' = weight[:, None] * b computed in fp32 and rounded once to ``operand_dtype``, with b's strides (a
    transposed weight stays one, so the TMA layout is unchanged); b itself without a weight. bias' (fp32) is
    None without bias and norm_bias, ``bias`` as given without norm_bias. colsum (fp32, LayerNorm only) sums
    the rounded b' so the rank-1 correction matches the GEMM operand exactly.
    """
    if weight is not None:
        # elementwise ops keep a dense b's strides; functional, so a graph can inline it (patterns/deferred_norm.py)
        b_fold = (b * weight.float()[:, None]).to(operand_dtype)
    else:
        b_fold = b
    bias_fold = bias
    if norm_bias is not None:
        # mv, not matmul: a matrix-vector product, which cuBLAS never runs in TF32.
        bias_fold = torch.mv(b.float().t(), norm_bias.float())
        if bias is not None:
            bias_fold += bias.float()
    colsum = None if is_rms else b_fold.sum(0, dtype=torch.float32)
    return b_fold, bias_fold, colsum
