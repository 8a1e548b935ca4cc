"""The kernel backends behind fusenorm's ops (base.py says what a backend is) and the one place that asks
all of them: which can take a case, their candidates pooled, and which backend a chosen candidate belongs to.

Order matters only where nothing is timed (measuring off, deterministic mode, a CPU compile): the first
candidate runs then, so our Gluon kernels come first, as before quack was offered.
"""

from __future__ import annotations

from typing import Callable, Optional

from .base import Backend, DeferredArgs, DeferredCase, Refused
from .gluon import GLUON, gluon_off
from .quack import QUACK

__all__ = ["Backend", "DeferredArgs", "DeferredCase", "Refused", "BACKENDS", "backend_of", "config_from", "deferred_candidates",
           "deferred_launch", "deferred_unsupported", "gluon_off", "unavailable"]

BACKENDS: tuple = (GLUON, QUACK)


def deferred_unsupported(case: DeferredCase) -> Optional[str]:
    """None where some backend takes the case, else why none does (each backend's reason)."""
    whys = []
    for backend in BACKENDS:
        why = backend.deferred_unsupported(case)
        if why is None:
            return None
        whys.append(f"{backend.name}: {why}")
    return "; ".join(whys)


def deferred_candidates(case: DeferredCase) -> list:
    """Every backend's candidates for the case, in ``BACKENDS`` order, from those that take it."""
    out: list = []
    for backend in BACKENDS:
        if backend.deferred_unsupported(case) is None:
            out.extend(backend.deferred_candidates(case))
    return out


def backend_of(config) -> Backend:
    for backend in BACKENDS:
        if backend.owns(config):
            return backend
    raise ValueError(f"no backend owns the configuration {config!r}")


def deferred_launch(args: tuple, config, alloc: Callable, plan_out: Optional[list] = None):
    """(c, stats) of ``fusenorm::deferred_mm``'s arguments from the backend that owns ``config``."""
    return backend_of(config).deferred_launch(args, config, alloc, plan_out)


def config_from(fields: list):
    """The candidate of a backend with its own configuration type (quack) that a cache entry's list holds;
    None where the list is not such a backend's (kernels/triton's GemmConfig: tuning/measure.config_of)."""
    for backend in BACKENDS:
        make = getattr(backend, "config_from", None)
        if make is not None and fields and fields[0] == getattr(backend, "name", None):
            return make(fields)
    return None


def unavailable() -> dict:
    """{backend name: why it cannot run here} for each backend that cannot."""
    return {b.name: why for b in BACKENDS if (why := b.unavailable()) is not None}
