"""Our Gluon sm_90 kernels (kernels/hopper/) behind the backend interface (backends/base.py)."""

from __future__ import annotations

from typing import Callable, Optional

from .. import config as settings
from .base import DeferredCase

__all__ = ["GLUON", "gluon_off"]


def gluon_off(force_block_n: Optional[int] = None) -> Optional[str]:
    """Why no Gluon sm_90 kernel can run at all (switched off, a test hook forcing the tl tiles, a triton
    without a usable Gluon), else None: what every op's Gluon check asks before the kernel's own checks of the
    inputs."""
    if not settings.gluon:
        return "off (config.gluon / FUSENORM_GLUON)"
    if force_block_n is not None:
        return "test hook _FORCE_BLOCK_N set"
    from ..kernels.hopper import _compat

    if _compat.GLUON_ERROR is not None:  # the kernel modules themselves need Gluon to import
        return f"this triton has no usable Gluon ({_compat.GLUON_ERROR})"
    return None


class _Gluon:
    name = "gluon"

    def unavailable(self) -> Optional[str]:
        return gluon_off()

    def owns(self, config) -> bool:
        return isinstance(getattr(config, "kind", None), str) and config.kind.startswith("gl_")

    def deferred_unsupported(self, case: DeferredCase) -> Optional[str]:
        why = self.unavailable()
        if why is not None:
            return why
        from ..kernels.hopper import deferred_mm as hopper

        return hopper.unsupported(case.a, case.b, case.residual, case.out_norm, case.out_tile)

    def deferred_candidates(self, case: DeferredCase) -> list:
        from ..kernels.hopper import deferred_mm as hopper

        return hopper.candidates(case.a, case.b, case.out_tile, case.residual is not None,
                                 case.res_rows is not None)

    def deferred_launch(self, args: tuple, config, alloc: Callable, plan_out: Optional[list] = None):
        from ..kernels import deferred

        return deferred.launch(args, config, alloc, plan_out)


GLUON = _Gluon()
