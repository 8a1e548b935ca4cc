"""What a kernel backend is: the one interface the dispatch (tuning/) and the ops' CUDA paths use to reach the
GEMM kernels of a library, ours or a peer's.

A backend, for one op and one concrete case (shapes, dtypes, strides, the epilogue's flags, the device), either
says why it cannot take the case (a sentence for the match report) or lists its candidates: configurations
the dispatch times against each other and against Inductor's own code, and caches by the op's key. Each
candidate is a NamedTuple whose first field, ``kind``, names the backend's family (``owns``), so a cached
entry (a list) turns back into the candidate that made it (``config_from``; our kernels' GemmConfig is read
by tuning/measure.config_of). Backends launch; they never
decide: the math, the reference and the autograd stay with the ops (ops/), the decision with tuning/.

Only ``fusenorm::deferred_mm`` (ops/deferred_norm.py) goes through this interface so far; the whole-row
post-norm, Lazy Pre-Norm, GDPA and FlashNormAttention ops keep their own launchers (kernels/triton, whose
Gluon and ``tl`` variants are chosen in tuning/mm_norm.py, norm_mm.py, mm_norm_backward.py, gdpa.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol

from torch import Tensor

__all__ = ["Backend", "DeferredArgs", "DeferredCase"]


class DeferredArgs(NamedTuple):
    """The arguments of one ``fusenorm::deferred_mm`` call, by name and in the op's order (ops/deferred_norm.py
    says what each is): c = norm_a(a) @ b (+ bias) (+ residual), with the statistics of the norm ``out_norm``
    of c written in tiles of ``out_tile`` columns. A tuple still: the launchers unpack it as the op's own
    argument list."""

    a: Tensor
    b: Tensor
    bias: Optional[Tensor] = None
    residual: Optional[Tensor] = None
    a_stats: Optional[Tensor] = None
    norm_weight: Optional[Tensor] = None
    norm_bias: Optional[Tensor] = None
    a_eps: float = 0.0
    a_norm: int = 0
    a_tile: int = 0
    out_norm: int = 0
    out_tile: int = 0
    cache_fold: bool = False
    res_rows: Optional[Tensor] = None

    @classmethod
    def of(cls, args) -> "DeferredArgs":
        """``args`` (the op's arguments as a tuple; the trailing optional ones may be left out) by name."""
        return args if isinstance(args, cls) else cls(*args)


@dataclass(frozen=True)
class DeferredCase:
    """One ``fusenorm::deferred_mm`` call as a backend sees it (example or real tensors): the GEMM a @ b
    ([M, K] @ [K, N]), its epilogue's parts (bias, residual, the backward's per-row residual terms
    ``res_rows``), the norm it applies to a (``a_norm``: 0 none, 1 RMSNorm, 2 LayerNorm) and the one whose
    statistics it writes (``out_norm``, tiles of ``out_tile`` columns)."""

    a: Tensor
    b: Tensor
    bias: Optional[Tensor] = None
    residual: Optional[Tensor] = None
    a_norm: int = 0
    out_norm: int = 0
    out_tile: int = 0
    res_rows: Optional[Tensor] = None

    @classmethod
    def of(cls, args) -> "DeferredCase":
        """The case of the op's arguments (``DeferredArgs``, or the op's tuple; res_rows may be left out)."""
        d = DeferredArgs.of(args)
        return cls(d.a, d.b, d.bias, d.residual, d.a_norm, d.out_norm, d.out_tile, d.res_rows)


class Backend(Protocol):
    """A GEMM library behind fusenorm's ops (module docstring)."""

    name: str

    def unavailable(self) -> Optional[str]:
        """Why this backend cannot run anything here (not installed, switched off, no GPU it serves); None
        when it can."""

    def owns(self, config) -> bool:
        """Whether ``config`` is one of this backend's candidates."""

    def config_from(self, fields: list):
        """The candidate a cache entry's list holds (its first field a kind this backend owns); ValueError
        saying what is wrong. Only for backends whose candidates are not kernels/triton's GemmConfig."""

    def deferred_unsupported(self, case: DeferredCase) -> Optional[str]:
        """Why this backend cannot take the case; None when it can."""

    def deferred_candidates(self, case: DeferredCase) -> list:
        """The configurations to time for the case, the one to run untimed first."""

    def deferred_launch(self, args: tuple, config, alloc: Callable, plan_out: Optional[list] = None
                        ) -> tuple[Tensor, Tensor]:
        """(c, stats) of the op's arguments ``args`` with ``config``, outputs from ``alloc(shape, dtype,
        device)``; ``plan_out``: where the function that launches the same again on arguments of this
        signature goes. Raises ``Refused`` (nothing launched) for a configuration the kernel cannot build."""


class Refused(RuntimeError):
    """A candidate that cannot be built for its case (nothing was launched): the dispatch leaves it out of the
    timings rather than counting a failed measurement (tuning/measure.refused)."""

    refusal = True
