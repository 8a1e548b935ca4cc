"""fusenorm: LayerNorm/RMSNorm fused into the neighbouring GEMMs under torch.compile.

Use it one of two ways:
- ``torch.compile(model, backend="fusenorm")`` (no import needed once installed), or
- in a script that already calls ``torch.compile(model)``: ``import fusenorm_inductor;
  fusenorm_inductor.enable()`` (``disable()`` undoes it).
See README.md for what is fused, the match report (``FUSENORM_DEBUG_DIR``), and what is not supported.
"""

from __future__ import annotations

from . import config, ops
from .backend import fusenorm_backend
from .ops.flash_norm_attention import flash_norm_attention
from .ops.gdpa import gdpa
from .report import last_report, reports

__version__ = "0.1.0"


def enable() -> None:
    """Run fusenorm's passes under plain ``torch.compile`` (Inductor) from now on in this process.

    The same as ``config.enabled = True`` (or, for a block, ``with config.patch(enabled=True)``). Chains after
    any custom pass already installed in the same Inductor slots. Graphs compiled before this call keep their
    code: call ``torch._dynamo.reset()`` to recompile them.
    """
    config.enabled = True  # config installs the passes (passes.install)


def disable() -> None:
    """Stop running fusenorm's passes under plain ``torch.compile``; the user's own passes stay.

    The same as ``config.enabled = False``. Only later compiles are affected: functions and modules already
    compiled keep running the fused code they were compiled with until ``torch._dynamo.reset()`` (or until
    they recompile for another reason), so call ``torch._dynamo.reset()`` after ``disable()`` to get plain
    Inductor code everywhere.
    """
    config.enabled = False  # config uninstalls the passes (passes.uninstall)


if config.enabled:  # FUSENORM_ENABLE=1: enabled as soon as the package is imported
    enable()

__all__ = [
    "enable", "disable", "config", "ops", "fusenorm_backend", "last_report", "reports", "gdpa",
    "flash_norm_attention", "__version__",
]
