"""The process's in-memory caches that hold launch plans and their by-products (the ops' launch plans, the
Gluon GDPA plans, the fold cache, a backend's constant vectors), registered here so that
``tuning.measure.clear_memory`` forgets them all with the measurements they were made from. Imports nothing of
fusenorm: every layer may register a cache."""

from __future__ import annotations

__all__ = ["cache", "clear"]

_CACHES: list = []


def cache(store=None):
    """``store`` (a new dict by default), registered to be emptied by ``clear``; returned."""
    store = {} if store is None else store
    _CACHES.append(store)
    return store


def clear() -> None:
    """Empty every registered cache."""
    for store in _CACHES:
        store.clear()
