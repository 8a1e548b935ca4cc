"""quack (Dao-AILab's CuTeDSL GEMM kernels, the optional extra ``fusenorm[quack]``) behind the backend
interface (backends/base.py): the GEMMs of a deferred norm (``fusenorm::deferred_mm``).

quack is a dependency, used through its public epilogue surface (``quack.epilogue.frontend.gemm_epilogue``
with ``quack.epilogue.ops``' vector loads and reduces); the four epilogues below are fusenorm's own. One
arithmetic covers every form the op takes here, with vectors standing in for absent parts:

    y = s * acc - t * wg + wb (+ residual)        s, t per row; wg, wb per column; acc = a @ b' in fp32
    c = y rounded to a's dtype; with output statistics, each tile's sum of y^2 (RMSNorm's partials)

- the norm the GEMM applies to its input (``a_norm``): s = rstd, t = mean * rstd (LayerNorm; 0 for RMSNorm)
  from the input's partial statistics, merged in one launch (kernels/merge.py); wg = the folded weight's
  column sums (LayerNorm), wb = the folded bias (kernels/fold.py, kept per weight version like the Gluon
  path's); without a norm s = 1, t = 0, wg = 0 and wb = the bias or 0 (constant vectors, made once);
- the output statistics (``out_norm``): quack's partials are per CTA tile of ``tile_n`` columns, so only
  configurations whose ``tile_n`` is the op's ``out_tile`` write them. RMSNorm's: each tile's sum of y^2.
  LayerNorm's: each tile's mean (quack's accumulator prepass, a grouped statistic with one group per tile),
  then the sum of squared deviations from it: the op's (mean, M2) partials, stable at any |mean| / std (a
  plain sum of squares would lose the variance there). Both are of y in fp32 before its rounding (the
  Gluon kernel's are of c as stored: the two differ by c's rounding, which an fp32 reference favours).

Not taken (the report says so, and the Gluon kernel or Inductor serves the GEMM): LayerNorm applied
LayerNorm statistics where N is not whole tiles, with a residual (quack's prepass does not read C) or before
sm_90 (no prepass), the backward's per-row residual terms (``res_rows``),
operands that are not 16-bit, dims not multiples of 8, strides without a unit dim. Configurations are
chosen by the dispatch's own timing (tuning/deferred_norm.py), never by quack's autotuner: nothing is tuned
or compiled inside a user's step that the decision did not already run.

Tested on sm_90 (H100) with quack-kernels 0.6.4 and nvidia-cutlass-dsl 4.6.2; its sm_80, sm_100 and sm_120
GEMMs are offered there with the configurations of quack's own defaults, untested here.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .. import config as settings
from .. import memory
from .base import DeferredCase, Refused

__all__ = ["QUACK", "QuackConfig", "TESTED_VERSIONS"]

TESTED_VERSIONS = ("0.6.4",)
KIND = "quack"
PREPASS_ARCHS = (9, 10, 12)  # quack's accumulator prepass (LayerNorm's tile means)
HALF = (torch.float16, torch.bfloat16)


class QuackConfig(NamedTuple):
    """One quack GEMM configuration (the fields of ``quack.gemm_config.GemmConfig`` this backend sets; 0 for
    quack's own choice of tile_k and warps)."""

    kind: str
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    pingpong: bool
    capability: int = 9
    dynamic: bool = False
    tile_k: int = 0
    warps: int = 0

    def label(self) -> str:
        sched = "pp" if self.pingpong else "coop"
        return f"quack {self.tile_m}x{self.tile_n} c{self.cluster_m}x{self.cluster_n} {sched} sm{self.capability}0"

    def to_quack(self):
        from quack.gemm_config import GemmConfig

        return GemmConfig(tile_m=self.tile_m, tile_n=self.tile_n, tile_k=self.tile_k or None,
                          num_warps=self.warps or None, pingpong=self.pingpong,
                          is_dynamic_persistent=self.dynamic, cluster_m=self.cluster_m, cluster_n=self.cluster_n,
                          swap_ab=False, device_capacity=self.capability)


def _cfg(tile_m, tile_n, cluster_m, cluster_n, pingpong, capability=9, dynamic=False, tile_k=0, warps=0):
    return QuackConfig(KIND, tile_m, tile_n, cluster_m, cluster_n, pingpong, capability, dynamic, tile_k, warps)


# Per compute capability (major): (tiles that may write statistics, their candidates as a function of the
# statistics tile; candidates without statistics). quack's defaults first (gemm_config.default_config).
def _sm90(tile):
    return [_cfg(128, tile, 2, 1, True), _cfg(256, tile, 2, 1, False), _cfg(128, tile, 1, 2, True)]


_SM90_PLAIN = [_cfg(128, 192, 2, 1, True), _cfg(128, 128, 1, 2, True), _cfg(128, 192, 1, 2, True),
               _cfg(128, 128, 2, 1, True), _cfg(256, 128, 2, 1, False)]
_ARCH = {
    9: ((128, 160, 192, 208), _sm90, _SM90_PLAIN),
    10: ((128, 256), lambda t: [_cfg(256, t, 2, 1, False, 10, True)], [_cfg(256, 256, 2, 1, False, 10, True)]),
    12: ((128,), lambda t: [_cfg(128, t, 1, 1, True, 12, True)], [_cfg(128, 128, 1, 1, True, 12, True)]),
    8: ((128,), lambda t: [_cfg(128, t, 1, 1, False, 8, False, 32, 4)], [_cfg(128, 128, 1, 1, False, 8, False, 32, 4)]),
}


@functools.cache
def _import_problem() -> Optional[str]:
    try:
        import quack  # noqa: F401
        from quack.epilogue import frontend, ops  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or its runtime (the CUTLASS DSL) fails to load
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})".replace(": )", ")")
    return None


def version() -> Optional[str]:
    """The installed quack's version, None where it does not import."""
    if _import_problem() is not None:
        return None
    import quack

    return getattr(quack, "__version__", "unknown")


# ----------------------------------------------------------------------------------------------------------
# The epilogues (fusenorm's arithmetic on quack's epilogue surface; see the module docstring)
# ----------------------------------------------------------------------------------------------------------


def _apply(acc, s, t, wg, wb):
    return {"D": acc * s - t * wg + wb}


def _apply_stats(acc, s, t, wg, wb):
    y = acc * s - t * wg + wb
    return {"D": y, "sq": (y, y)}


def _apply_residual(acc, c, s, t, wg, wb):
    return {"D": acc * s - t * wg + wb + c}


def _apply_residual_stats(acc, c, s, t, wg, wb):
    y = acc * s - t * wg + wb + c
    return {"D": y, "sq": (y, y)}


# The lean forms of the commonest GEMMs load no vector they do not need: RMSNorm applied without a bias, and
# statistics written with or without a bias and no residual.
def _scale(acc, s):
    return {"D": acc * s}


def _stats(acc):
    return {"D": acc, "sq": (acc, acc)}


def _bias_stats(acc, wb):
    y = acc + wb
    return {"D": y, "sq": (y, y)}


# LayerNorm's statistics: each tile's mean first (a prepass over the accumulator, quack's grouped statistics
# with one group per tile, written out as the tile mean), then the squared deviations from it summed: the
# op's (tile mean, M2) partials, which keep the variance at any |mean| / std. The prepass repeats the
# epilogue's arithmetic: the statistics are of y itself.
def _ln_stats(acc, mu):
    d = acc - mu
    return {"D": acc, "m2": (d, d)}


def _ln_stats_pre(acc):
    return {"mu": acc}


def _bias_ln_stats(acc, mu, wb):
    y = acc + wb
    d = y - mu
    return {"D": y, "m2": (d, d)}


def _bias_ln_stats_pre(acc, wb):
    return {"mu": acc + wb}


def _apply_ln_stats(acc, mu, s, t, wg, wb):
    y = acc * s - t * wg + wb
    d = y - mu
    return {"D": y, "m2": (d, d)}


def _apply_ln_stats_pre(acc, s, t, wg, wb):
    return {"mu": acc * s - t * wg + wb}


# form -> (function, the vector operands it reads, the LayerNorm statistics' prepass or None)
_GENERAL = ("s", "t", "wg", "wb")
_FNS = {"general": (_apply, _GENERAL, None), "general_stats": (_apply_stats, _GENERAL, None),
        "general_residual": (_apply_residual, _GENERAL, None),
        "general_residual_stats": (_apply_residual_stats, _GENERAL, None),
        "scale": (_scale, ("s",), None), "stats": (_stats, (), None), "bias_stats": (_bias_stats, ("wb",), None),
        "ln_stats": (_ln_stats, (), _ln_stats_pre), "bias_ln_stats": (_bias_ln_stats, ("wb",), _bias_ln_stats_pre),
        "general_ln_stats": (_apply_ln_stats, _GENERAL, _apply_ln_stats_pre)}


def _form(a_norm: int, bias: bool, residual: bool, stats: int) -> str:
    """The epilogue for a GEMM applying ``a_norm`` and writing statistics for ``stats`` (0 none, 1 RMSNorm,
    2 LayerNorm)."""
    suffix = {0: "", 1: "_stats", 2: "_ln_stats"}[int(stats)]
    if not residual and a_norm == 1 and not bias and not stats:
        return "scale"
    if not residual and a_norm == 0 and stats:
        return ("bias_" if bias else "") + suffix[1:]
    return "general" + ("_residual" if residual else "") + suffix


@functools.cache
def _tile_mean():
    """quack's grouped prepass statistic finalized as a mean (one group per statistics tile), made once: the
    class needs the CUTLASS DSL, which only an installed quack brings."""
    import cutlass.cute as cute
    from cutlass import const_expr
    from quack.epilogue.ops import GroupedColStatsBase

    class TileMean(GroupedColStatsBase):
        @cute.jit
        def stat_value(self, total, group_cols):
            return total * const_expr(1.0 / group_cols)

    return TileMean("mu")


@functools.cache
def _epilogue(form: str):
    """The quack epilogue object for this form, made once (quack keys its kernels by the function's source)."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad

    fn, names, prepass = _FNS[form]
    ops = {n: (ColVecLoad(n) if n in ("s", "t") else RowVecLoad(n)) for n in names}
    if prepass is not None:
        mean = _tile_mean()
        return gemm_epilogue(ops={**ops, "mu": mean}, reduces={"m2": ColVecReduce("m2", scaled=True)},
                             prepass=prepass, prepass_outs=("mu",), extra_ops=(mean.out("mean"),))(fn)
    reduces = {"sq": ColVecReduce("sq", scaled=True)} if form.endswith("stats") else None
    return gemm_epilogue(ops=ops or None, reduces=reduces)(fn)


# The dispatch compiles candidates in threads (tuning/measure.compile_ahead); quack's compiles go one at a time.
_COMPILE_LOCK = threading.Lock()
_CONSTANTS: dict = memory.cache()  # (length, value, device) -> fp32 vector standing in for an absent part (never written)


def _constant(length: int, value: float, device) -> Tensor:
    key = (length, value, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.full((length,), value, dtype=torch.float32, device=device)
    return t


def _stride_problem(name: str, t: Tensor) -> Optional[str]:
    if t.dim() != 2 or 1 not in t.stride():
        return f"{name} has no unit-stride dim (strides {tuple(t.stride())})"
    other = t.stride(0) if t.stride(1) == 1 else t.stride(1)
    if other % 8:
        return f"{name}'s row pitch {other} is not a multiple of 8 elements"
    return None


class _Quack:
    name = "quack"

    def unavailable(self) -> Optional[str]:
        if not settings.quack:
            return "off (config.quack / FUSENORM_QUACK)"
        return _import_problem()

    def owns(self, config) -> bool:
        return getattr(config, "kind", None) == KIND

    def config_from(self, fields: list) -> QuackConfig:
        names = QuackConfig._fields
        if not len(names) - len(QuackConfig._field_defaults) <= len(fields) <= len(names) or fields[0] != KIND:
            raise ValueError(f"{fields!r} is not a quack configuration")
        for name, v in zip(names[1:], fields[1:]):
            ok = isinstance(v, bool) if name in ("pingpong", "dynamic") else (
                isinstance(v, int) and not isinstance(v, bool) and v >= (0 if name in ("tile_k", "warps") else 1))
            if not ok:
                raise ValueError(f"{fields!r} has {name} = {v!r}")
        return QuackConfig(*fields)

    def _arch(self, device) -> Optional[tuple]:
        return _ARCH.get(torch.cuda.get_device_capability(device)[0])

    def deferred_unsupported(self, case: DeferredCase) -> Optional[str]:
        why = self.unavailable()
        if why is not None:
            return why
        a, b = case.a, case.b
        if a.device.type != "cuda":
            return f"runs on CUDA only ({a.device.type})"
        arch = self._arch(a.device)
        if arch is None:
            return f"no quack GEMM for sm_{''.join(map(str, torch.cuda.get_device_capability(a.device)))}"
        if case.res_rows is not None:
            return "the backward's per-row residual terms are not expressed in its epilogues"
        if case.out_norm and case.out_tile not in arch[0]:
            return f"statistics tiles of {case.out_tile} columns: its tiles are {arch[0]} wide"
        if case.out_norm == 2:
            if torch.cuda.get_device_capability(a.device)[0] not in PREPASS_ARCHS:
                return "LayerNorm statistics: its accumulator prepass (the tile mean) is sm_90 and newer"
            if case.residual is not None:
                return "LayerNorm statistics of a sum with a residual: its accumulator prepass does not read C"
            if case.b.shape[1] % case.out_tile:
                return (f"LayerNorm statistics at N = {case.b.shape[1]}: its tile means need whole tiles of "
                        f"{case.out_tile} columns")
        if a.dtype not in HALF or b.dtype != a.dtype:
            return f"operands {a.dtype}/{b.dtype}: fp16 or bf16 only"
        k, n = b.shape
        if k % 8 or n % 8:
            return f"K = {k}, N = {n}: multiples of 8 only"
        for name, t in (("a", a), ("b", b), ("residual", case.residual)):
            why = t is not None and _stride_problem(name, t)
            if why:
                return why
        if case.residual is not None and case.residual.dtype != a.dtype:
            return f"residual in {case.residual.dtype}, operands in {a.dtype}"
        return None

    def deferred_candidates(self, case: DeferredCase) -> list:
        arch = self._arch(case.a.device)
        if arch is None:
            return []
        return list(arch[1](case.out_tile)) if case.out_norm else list(arch[2])

    def deferred_launch(self, args: tuple, config: QuackConfig, alloc: Callable, plan_out: Optional[list] = None):
        from ..kernels import deferred
        from ..kernels.merge import row_scales

        a, b, bias, residual, a_stats, norm_weight, norm_bias, a_eps, a_norm, a_tile, out_norm, out_tile, cache, \
            rows = args
        if rows is not None:
            raise Refused(f"{config.label()}: " + (self.deferred_unsupported(DeferredCase.of(args)) or "refused"))
        m, k, n, dev = a.shape[0], a.shape[1], b.shape[1], a.device
        dtype = a.dtype
        fold = deferred.fold_cuda(a_norm)
        merge: list = []  # the merge kernel, compiled for this signature on the first call
        has_bias = bias is not None or (a_norm != deferred.NONE and norm_bias is not None)  # the fold's bias'
        form = _form(a_norm, has_bias, residual is not None, out_norm)
        names = _FNS[form][1]
        try:
            epi = _epilogue(form)
            qcfg = config.to_quack()
        except Exception as e:  # noqa: BLE001 - quack's epilogue surface refused the form
            raise Refused(f"{config.label()}: {type(e).__name__}: {e}") from e

        def operands(b, bias, a_stats, norm_weight, norm_bias, stats):
            b_f, bias_f, colsum = deferred.cached_fold(b, bias, norm_weight, norm_bias, a_norm, cache, fold)
            if a_norm != deferred.NONE:
                s, t = row_scales(a_stats, k, a_tile, a_eps, a_norm, alloc, merge)
            else:
                s, t = _constant(m, 1.0, dev), None
            if (bias_f is not None) != has_bias:  # the form was chosen for the other case: never drop a bias
                raise RuntimeError(f"quack backend: form {form!r} chosen for bias={has_bias}, the fold gave "
                                   f"{'one' if bias_f is not None else 'none'}")
            wb = _constant(n, 0.0, dev) if bias_f is None else bias_f
            if wb.dtype != torch.float32:
                wb = wb.float()
            ops = {"s": s, "t": t if t is not None else _constant(m, 0.0, dev),
                   "wg": colsum if colsum is not None else _constant(n, 0.0, dev), "wb": wb}
            ops = {k: v for k, v in ops.items() if k in names}
            if out_norm == deferred.RMS:
                ops["sq"] = stats[0]
            elif out_norm == deferred.LN:  # the tile means, then the squared deviations from them
                ops.update(mu=out_tile, mean=stats[0], m2=stats[1])
            return b_f, ops

        shape = deferred.stats_shape(m, n, out_norm, out_tile)
        c = alloc((m, n), dtype, dev)
        stats = alloc(shape, torch.float32, dev)
        b_f, ops = operands(b, bias, a_stats, norm_weight, norm_bias, stats)
        try:
            with _COMPILE_LOCK:
                plan = epi.plan(a, b_f, residual, out={"D": c}, config=qcfg, **ops)
        except Exception as e:  # noqa: BLE001 - the configuration cannot be built for these operands
            raise Refused(f"{config.label()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        plan.run(a, b_f, residual, out={"D": c}, **ops)
        if plan_out is not None:
            def again(*call):  # the op's arguments, as ``args``: the scalars are the plan's
                a, b, bias, residual, a_stats, norm_weight, norm_bias = call[:7]
                c = alloc((m, n), dtype, dev)
                stats = alloc(shape, torch.float32, dev)
                b_f, ops = operands(b, bias, a_stats, norm_weight, norm_bias, stats)
                plan.run(a, b_f, residual, out={"D": c}, **ops)
                return c, stats

            plan_out.append(again)
        return c, stats


QUACK = _Quack()
