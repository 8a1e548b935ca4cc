"""fusenorm's custom ops (``torch.ops.fusenorm.*``). Importing this package registers them.

- ``norm`` / ``norm_backward``: the canonical LayerNorm/RMSNorm every norm form is rewritten to (norm.py);
- ``mm_norm``: GEMM with the norm in its epilogue, the post-norm forward (mm_norm.py);
- ``mm_norm_backward``: data-gradient GEMM with the norm backward in its epilogue (mm_norm_backward.py).
Each module holds the op's reference (its CPU implementation and the tests' oracle); the Triton kernels
and launchers are in ``*_kernels.py`` and are imported only when a CUDA tensor reaches the op.
"""

from .mm_norm import mm_norm, mm_norm_reference
from .mm_norm_backward import mm_norm_backward, mm_norm_backward_reference
from .norm import norm, norm_backward, norm_backward_reference, norm_reference

__all__ = [
    "norm",
    "norm_backward",
    "norm_reference",
    "norm_backward_reference",
    "mm_norm",
    "mm_norm_reference",
    "mm_norm_backward",
    "mm_norm_backward_reference",
]
