"""fusenorm's custom ops (``torch.ops.fusenorm.*``). Importing this package registers them.

- ``norm`` / ``norm_backward``: the canonical LayerNorm/RMSNorm every norm form is rewritten to (norm.py);
- ``mm_norm``: GEMM with the norm in its epilogue, the post-norm forward (mm_norm.py);
- ``mm_norm_backward``: data-gradient GEMM with the norm backward in its epilogue (mm_norm_backward.py);
- ``norm_mm`` / ``mm_normed``: the pre-norm forward (norm -> linear, the norm applied lazily in the GEMM)
  and the linear's weight gradient with the normalized input rebuilt from the row statistics (norm_mm.py);
- ``gdpa`` / ``gdpa_backward``: generalized dot-product attention (an activation instead of softmax) over
  jagged Q and short dense K/V (gdpa.py);
- ``flash_norm_attention`` / ``flash_norm_attention_backward``: the PFFN block, LayerNorm -> GDPA -> + ln_q ->
  RMSNorm -> + q with both norms over all heads, in one kernel (flash_norm_attention.py).
- ``host_probe``: an op that does nothing, timed to weigh the fused ops' host cost (host_probe.py).
Each module holds one op: schema, fake implementation, reference (its CPU implementation and the tests'
oracle), autograd, and the CUDA call into fusenorm_inductor/kernels/ with a configuration from
fusenorm_inductor/tuning/ (the kernel modules are imported only when a CUDA tensor reaches the op).

Every module of this package is imported here, so a new op's module registers its op without being listed.
"""

import importlib
import pkgutil

# The attention ops' modules keep their names here (tests and tools set module flags such as
# gdpa.VALIDATE_CUDA_OFFSETS): their functions are fusenorm_inductor.gdpa / fusenorm_inductor.flash_norm_attention.
from . import flash_norm_attention, gdpa  # noqa: F401  (registers the ops)
from .flash_norm_attention import flash_norm_attention_reference
from .gdpa import gdpa_reference
from .mm_norm import mm_norm, mm_norm_reference
from .mm_norm_backward import mm_norm_backward, mm_norm_backward_reference
from .norm import norm, norm_backward, norm_backward_reference, norm_reference
from .norm_mm import mm_normed, mm_normed_reference, norm_mm, norm_mm_reference

__all__ = [
    "norm",
    "norm_backward",
    "norm_reference",
    "norm_backward_reference",
    "mm_norm",
    "mm_norm_reference",
    "mm_norm_backward",
    "mm_norm_backward_reference",
    "norm_mm",
    "norm_mm_reference",
    "mm_normed",
    "mm_normed_reference",
    "gdpa_reference",
    "flash_norm_attention_reference",
]

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
del _module


def _show_docstrings(*ops) -> None:
    """``help()`` of a custom op object shows its function's docstring, not the op wrapper class's."""
    for op in ops:
        fn = getattr(op, "_init_fn", None)  # torch's CustomOpDef keeps the decorated function here
        if fn is not None and fn.__doc__:
            op.__doc__ = fn.__doc__


_show_docstrings(norm, norm_backward, mm_norm, mm_norm_backward, norm_mm, mm_normed, gdpa.gdpa)
