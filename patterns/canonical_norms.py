"""Pre-grad patterns: every way users write a LayerNorm or RMSNorm becomes one ``fusenorm::norm`` call.

Runs on Dynamo's torch-level graph (``pre_grad_custom_pass``): ``nn.LayerNorm``/``F.layer_norm``/
``torch.layer_norm``, ``nn.RMSNorm``/``F.rms_norm``/``torch.rms_norm``, and the hand-written norms of HF
models: the LLaMA RMSNorm (``x.float()``, ``pow(2).mean(-1, keepdim=True)``, ``+ eps``, ``rsqrt``, ``*``,
optional cast back and ``weight *``), T5's (rsqrt times the uncast x), Gemma's (``* (1 + w)``, then the cast)
and the GPT-2/BERT/ViT LayerNorm (``(x - u) / sqrt(var + eps)``, ``weight *``, ``+ bias``). The output
dtype is read from the traced example value, so autocast's choices (LayerNorm kept in fp32 on CUDA) are
preserved exactly: the canonical op computes in fp32 and writes that dtype.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx import Node

from fusenorm_inductor import fx_utils
from fusenorm_inductor.fx_utils import val
from fusenorm_inductor.report import GraphReport

from .base import Pattern, require

NORM = torch.ops.fusenorm.norm.default
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _eps_default(dtype: torch.dtype) -> float:
    # torch.rms_norm(eps=None) uses the epsilon of the op-math type: fp32 for half types.
    return torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps


def _const_int(s: Any) -> Any:
    """A ``normalized_shape`` element as an int where it is one: Dynamo passes a module's int attribute as a
    graph input (a SymInt node) when a frame is recompiled with automatic dynamic shapes, e.g. the forward of
    a second FSDP2-wrapped block of another width; the norm's shape check specializes it to a constant (and
    Dynamo guards on that), so it is an int for this graph. Anything still symbolic is returned as is."""
    v = val(s) if isinstance(s, Node) else s
    if isinstance(v, torch.SymInt):
        v = v.node.maybe_as_int()
    return v if isinstance(v, int) else s


def _bind(node: Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


REVERT_KEY = "fusenorm_revert"  # meta of a canonical op: how to put back what it replaced (patterns/prospects.py)


@dataclass
class Original:
    """What a canonical op replaced, kept until the prospects step decides (patterns/prospects.py): the
    erased nodes as they were (node, op, target, args, kwargs, meta, name; in graph order), the one whose
    users the op took over, the report's record of the rewrite, and ``order``: every node from the first
    erased one to ``end`` as they stood (nodes the norm shares with the rest of the graph, such as Gemma's
    ``1 + weight``, sit between the norm's own: the order decides the order of the backward's kernels)."""

    nodes: list[tuple]
    end: Node
    record: Any
    order: list[Node]


def canonicalize(graph: fx.Graph, rep: GraphReport, pattern: str, end: Node, nodes: list[Node], x, weight, bias,
                 eps: float, is_rms: bool, detail: str) -> Node:
    """Insert the canonical op before ``end`` (the last node of the norm as written), give it end's users,
    erase ``nodes`` (the norm's nodes, end included) where nothing else reads them, and record the rewrite.
    The erased nodes are kept on the op (``REVERT_KEY``) so the prospects step can put them back exactly."""
    listed = list(graph.nodes)
    order = listed[min(listed.index(n) for n in nodes):listed.index(end) + 1]
    with graph.inserting_before(end):
        op = fx_utils.call(graph, NORM, x, weight, bias, float(eps), is_rms, val(end).dtype)
        y = fx_utils.call(graph, operator.getitem, op, 0)
    for node in (op, y):  # the model's names for the norm (the match report's module path and source line)
        node.meta.update({k: v for k, v in end.meta.items() if k in ("stack_trace", "nn_module_stack")})
    mine = set(nodes)
    before = [(n, n.op, n.target, n.args, dict(n.kwargs), dict(n.meta), n.name) for n in graph.nodes if n in mine]
    end.replace_all_uses_with(y)
    fx_utils.erase_if_unused(graph, nodes)
    xv = val(x)
    rep.rewrite(pattern, "pre_grad", [n.name for n in nodes], {"x": list(xv.shape)}, xv.dtype,
                "fusenorm::norm (canonical)", detail)
    op.meta[REVERT_KEY] = Original([r for r in before if getattr(r[0], "_erased", False)], end, rep.rewrites[-1],
                                   order)
    return y


class _NormCall(Pattern):
    """Shared guards and rewrite of the library-call forms."""

    stage = "pre_grad"
    switch = "canonicalize_norms"
    targets: tuple = ()
    is_rms = False

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if n.op == "call_function" and n.target in self.targets]

    def bind(self, node: Node) -> dict[str, Any]:
        raise NotImplementedError

    def match(self, node: Node) -> dict[str, Any]:
        a = self.bind(node)
        x, shape = a["input"], a["normalized_shape"]
        xv = val(x)
        require(isinstance(x, Node) and isinstance(xv, torch.Tensor), "input is not a traced tensor")
        require(fx_utils.static_width(xv), "dynamic shapes (a symbolic norm width): left to Inductor")
        require(xv.dtype in _SUPPORTED_DTYPES, f"dtype {xv.dtype} not supported (fp32/fp16/bf16 only)")
        shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
        shape = tuple(_const_int(s) for s in shape)
        require(all(isinstance(s, int) for s in shape), "dynamic shapes (symbolic normalized_shape): left to Inductor")
        require(len(shape) == 1, f"normalizes over {len(shape)} dims {shape}; only the last dim is supported")
        require(shape[0] == xv.shape[-1], f"normalized_shape {shape} is not the last dim of {tuple(xv.shape)}")
        for p in ("weight", "bias"):
            w = a.get(p)
            require(w is None or (isinstance(w, Node) and tuple(val(w).shape) == shape),
                    f"{p} is not a tensor of shape {shape}")
        eps = a["eps"]
        if eps is None:
            eps = _eps_default(xv.dtype)
        require(isinstance(eps, (int, float)), f"eps is not a constant ({eps})")
        return {"node": node, "x": x, "weight": a.get("weight"), "bias": a.get("bias"), "eps": eps}

    def rewrite(self, graph: fx.Graph, m: dict[str, Any], rep: GraphReport) -> None:
        node = m["node"]
        canonicalize(graph, rep, self.name, node, [node], m["x"], m["weight"], m["bias"], m["eps"], self.is_rms,
                     f"eps={m['eps']}")


class LayerNormCall(_NormCall):
    """``F.layer_norm`` / ``torch.layer_norm`` (what ``nn.LayerNorm`` traces to)."""

    name = "canonical_layer_norm"
    order = 10  # the canonical forms (10-15) first: the patterns after them match fusenorm::norm nodes
    targets = (F.layer_norm, torch.layer_norm)

    def bind(self, node: Node) -> dict[str, Any]:
        return _bind(node, ("input", "normalized_shape", "weight", "bias", "eps"),
                     {"weight": None, "bias": None, "eps": 1e-5})


class RMSNormCall(_NormCall):
    """``F.rms_norm`` / ``torch.rms_norm`` (what ``nn.RMSNorm`` traces to); eps=None is the dtype's eps."""

    name = "canonical_rms_norm"
    order = 11
    targets = tuple(t for t in (getattr(F, "rms_norm", None), torch.rms_norm) if t is not None)
    is_rms = True

    def bind(self, node: Node) -> dict[str, Any]:
        return _bind(node, ("input", "normalized_shape", "weight", "eps"), {"weight": None, "eps": None})


# ---- the hand-written LLaMA RMSNorm ----------------------------------------------------------------------


def _is(node: Any, method: str, *functions) -> bool:
    """``node`` calls ``method`` as a Tensor method or one of ``functions``."""
    if not isinstance(node, Node):
        return False
    return (node.op == "call_method" and node.target == method) or (
        node.op == "call_function" and node.target in functions
    )


def _operands(node: Node) -> tuple:
    return tuple(node.args)


def _float_cast_source(node: Any) -> Any:
    """If ``node`` is ``x.float()`` / ``x.to(torch.float32)``, return x; else None."""
    if _is(node, "float") and len(node.args) == 1:
        return node.args[0]
    if _is(node, "to"):
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        if dtype is torch.float32 and len(node.args) <= 2:
            return node.args[0]
    return None


# Ops whose result depends on their arguments alone, so two calls with equal arguments are one value.
_PURE_METHODS = {"float", "to", "type_as", "pow", "square", "mul", "add", "mean", "rsqrt"}
_PURE_FUNCTIONS = {torch.pow, operator.pow, torch.square, operator.mul, torch.mul, operator.add, torch.add,
                   torch.mean, torch.rsqrt}


def _strip_noop_cast(n: Any) -> Any:
    """``n`` without casts that change nothing (``x.float()`` of an fp32 x, ``.to(t.dtype)``, ``.type_as(t)``
    of the same dtype, repeated)."""
    while isinstance(n, Node) and (_float_cast_source(n) is not None or _is_cast(n)) and n.args \
            and isinstance(n.args[0], Node) and getattr(val(n.args[0]), "dtype", None) == getattr(val(n), "dtype", 0):
        n = n.args[0]
    return n


def _same(a: Any, b: Any, depth: int = 8) -> bool:
    """Whether ``a`` and ``b`` are the same value: the same node, or calls of the same pure op on the same
    values (a hand-written norm that writes ``x.float()`` twice, once for the variance and once for the
    product), seen through casts that change nothing."""
    a, b = _strip_noop_cast(a), _strip_noop_cast(b)
    if a is b:
        return True
    if not (isinstance(a, Node) and isinstance(b, Node)) or depth == 0:
        return False
    pure = (a.op == "call_method" and a.target in _PURE_METHODS) or \
        (a.op == "call_function" and a.target in _PURE_FUNCTIONS)
    return (pure and a.op == b.op and a.target == b.target and a.kwargs == b.kwargs and len(a.args) == len(b.args)
            and all(_same(x, y, depth - 1) if isinstance(x, Node) else x == y for x, y in zip(a.args, b.args)))


def _casts_dtype_only(node: Node) -> bool:
    """``t.to(dtype)`` with nothing else (no device, no copy flags)."""
    dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return isinstance(dtype, torch.dtype) and len(node.args) <= 2 and set(node.kwargs) <= {"dtype"}


def _is_const(v: Any, value: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) == value


def _is_cast(node: Any) -> bool:
    """``t.type_as(u)`` or ``t.to(dtype)`` (nothing else): a dtype cast the canonical op's ``out_dtype`` absorbs."""
    return isinstance(node, Node) and (_is(node, "type_as") or (_is(node, "to") and _casts_dtype_only(node)))


def _mul_other(mul: Node, operand: Node) -> Any:
    """The other operand of the binary ``mul`` that reads ``operand`` (or None)."""
    if not (_is(mul, "mul", operator.mul, torch.mul) and len(mul.args) == 2 and not mul.kwargs):
        return None
    a, b = mul.args
    return b if a is operand else a if b is operand else None


def _one_plus(w: Any) -> bool:
    """``1 + w`` / ``w + 1`` with w a tensor: Gemma's weight, stored as an offset from 1."""
    if not (_is(w, "add", operator.add, torch.add) and len(w.args) == 2 and not w.kwargs):
        return False
    a, b = w.args
    return (_is_const(a, 1.0) and isinstance(b, Node)) or (_is_const(b, 1.0) and isinstance(a, Node))


def _affine(end: Node, xv: torch.Tensor, what: str) -> tuple[Node, Any]:
    """An optional ``* weight`` after ``end`` (the normalized value): (new end, weight or None). A multiplier of
    lower rank than x that is not a [N] vector is not a per-feature weight: rejected (not left outside), since
    the norm it scales is not a form fusenorm knows."""
    nxt = fx_utils.single_user(end)
    other = _mul_other(nxt, end) if nxt is not None else None
    ov = val(other) if isinstance(other, Node) else None
    if not isinstance(ov, torch.Tensor):
        return end, None
    if tuple(ov.shape) == (xv.shape[-1],):
        return nxt, other
    require(not (1 <= ov.dim() < xv.dim()),
            f"{what} multiplied by a tensor of shape {tuple(ov.shape)}, not a weight of the last dim "
            f"({xv.shape[-1]},)")
    return end, None


def _rms_parts(rsqrt: Node) -> tuple[Any, Any, Any, Any]:
    """Structure only: (denominator, mean, square, base) of ``rsqrt(mean(base^2) [+ eps])``, None where absent."""
    denom = rsqrt.args[0] if rsqrt.args else None
    ms = denom
    if _is(denom, "add", operator.add, torch.add) and len(denom.args) == 2:
        ms = denom.args[0] if isinstance(denom.args[1], (int, float)) else denom.args[1]
    if not _is(ms, "mean", torch.mean) or not ms.args:
        return denom, None, None, None
    sq = ms.args[0]
    return denom, ms, sq, (_square_base(sq) if isinstance(sq, Node) else None)


def _square_base(sq: Node) -> Optional[Node]:
    if _is(sq, "pow", torch.pow, operator.pow) and len(sq.args) == 2 and sq.args[1] == 2:
        return sq.args[0]
    if _is(sq, "square", torch.square) and len(sq.args) == 1:
        return sq.args[0]
    if _is(sq, "mul", operator.mul, torch.mul) and len(sq.args) == 2 and _same(sq.args[0], sq.args[1]):
        return sq.args[0]
    return None


def _rms_form(rsqrt: Node) -> str:
    """Which named hand-written RMSNorm an ``rsqrt`` node starts, from its structure alone (the guards come in
    ``match``, so a near-miss is reported under the pattern of the form it resembles)."""
    _, _, _, x = _rms_parts(rsqrt)
    mul = fx_utils.single_user(rsqrt)
    other = _mul_other(mul, rsqrt) if mul is not None else None
    # T5 multiplies the uncast input itself (the node the upcast reads), not a second upcast of it.
    if x is not None and other is not None and other is not x and _float_cast_source(x) is other:
        return "t5"
    if mul is not None and other is not None:
        end = mul
        nxt = fx_utils.single_user(end)
        if _is_cast(nxt):
            end, nxt = nxt, fx_utils.single_user(nxt)
        w = _mul_other(nxt, end) if nxt is not None else None
        if _one_plus(w):
            return "gemma"
    return "llama"


class _HandRMSNorm(Pattern):
    """``x * rsqrt(mean(x^2, -1, keepdim) + eps)`` [cast] [``* weight``] [cast]: the shared matcher of the
    hand-written RMSNorms; each subclass takes the rsqrt nodes of its form (``_rms_form``)."""

    stage = "pre_grad"
    switch = "canonicalize_norms"
    form = ""

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if _is(n, "rsqrt", torch.rsqrt) and _rms_form(n) == self.form]

    def match(self, rsqrt: Node) -> dict[str, Any]:
        denom, ms, sq, x = _rms_parts(rsqrt)
        require(_is(denom, "add", operator.add, torch.add) and len(denom.args) == 2 and not denom.kwargs,
                "rsqrt of something other than mean(x^2) + eps")
        eps = denom.args[1] if isinstance(denom.args[1], (int, float)) else denom.args[0]
        require(isinstance(eps, (int, float)), "rsqrt(... + eps) with a non-constant eps")
        require(ms is not None, "rsqrt of something other than mean(x^2) + eps")
        dims = ms.args[1] if len(ms.args) > 1 else ms.kwargs.get("dim")
        keep = ms.args[2] if len(ms.args) > 2 else ms.kwargs.get("keepdim", False)
        require(x is not None, "mean of something other than x^2")
        xv = val(x)
        require(isinstance(xv, torch.Tensor) and fx_utils.static_width(xv),
                "dynamic shapes (a symbolic norm width): left to Inductor")
        last = xv.dim() - 1
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        require(keep and len(dims) == 1 and dims[0] in (-1, last), "mean is not over the last dim with keepdim")
        require(len(ms.users) == 1 and len(denom.users) == 1 and len(sq.users) == 1 and len(rsqrt.users) == 1,
                "intermediate results of the RMSNorm are used elsewhere")
        mul = next(iter(rsqrt.users))
        xin = _mul_other(mul, rsqrt)
        src = _float_cast_source(x)
        # T5 multiplies the uncast input (x, not x.float()): x.float() * r, exactly, by type promotion.
        require(xin is not None and (_same(xin, x) or (src is not None and _same(xin, src))),
                "rsqrt(...) is not multiplied by the normalized input")
        # The product's input as its own node (a second ``x.float()``): one value with x, replaced with it.
        dup = [xin] if isinstance(xin, Node) and xin is not x and xin is not src and len(xin.users) == 1 else []
        # Optional cast, optional `* weight`, optional cast: the canonical op computes hh * w in fp32 and
        # rounds once, to the dtype of the last node it replaces.
        end, nodes = mul, [sq, ms, denom, rsqrt, mul]
        if _is_cast(fx_utils.single_user(end)):
            end = fx_utils.single_user(end)
            nodes.append(end)
        end, weight = _affine(end, xv, "the RMSNorm is")
        if weight is not None:
            nodes.append(end)
            if _is_cast(fx_utils.single_user(end)):
                end = fx_utils.single_user(end)
                nodes.append(end)
        if self.form == "gemma":
            require(weight is not None and _one_plus(weight), "the weight is not 1 + w")
        source = src if src is not None and val(src).dtype in _SUPPORTED_DTYPES else x
        require(val(source).dtype in _SUPPORTED_DTYPES and (_same(xin, x) or _same(xin, source)),
                f"dtype {val(xin).dtype} not supported")
        nodes += [x] if source is not x else []  # the fp32 upcast: the canonical op reads `source` itself
        nodes += dup
        return {"x": source, "eps": float(eps), "weight": weight, "end": end, "nodes": nodes}

    def rewrite(self, graph: fx.Graph, m: dict[str, Any], rep: GraphReport) -> None:
        canonicalize(graph, rep, self.name, m["end"], m["nodes"], m["x"], m["weight"], None,
                     m["eps"], True, f"eps={m['eps']}, weight={'yes' if m['weight'] else 'no'}")


class LlamaRMSNorm(_HandRMSNorm):
    """HF LLaMA/Mistral/Qwen: ``w * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``;
    the casts optional (fp32 models: no-op ``.to(float32)`` or none at all), the weight optional (a [N] vector;
    before or after the cast back). x^2 may be ``pow(2)``, ``square`` or ``x * x``."""

    name = "canonical_llama_rms_norm"
    order = 12
    form = "llama"


class T5RMSNorm(_HandRMSNorm):
    """HF T5 (``T5LayerNorm``): the statistic from ``x.to(float32)`` but rsqrt multiplies the uncast x
    (``x * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)``, fp32 by type promotion), then the optional
    cast to the weight's dtype and ``weight *``."""

    name = "canonical_t5_rms_norm"
    order = 13
    form = "t5"


class GemmaRMSNorm(_HandRMSNorm):
    """HF Gemma: ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1.0 + w.float())).type_as(x)``. The canonical
    op gets the fp32 ``1 + w`` node (computed in the graph) as its weight: it computes ``hh * weight`` in fp32 and
    rounds once to x's dtype, which is exactly Gemma's arithmetic; the gradient reaches w through the add."""

    name = "canonical_gemma_rms_norm"
    order = 14
    form = "gemma"


# ---- the hand-written LayerNorm ---------------------------------------------------------------------------


def _last_dim_keep(node: Node, xv: torch.Tensor, dim_pos: int = 1, keep_pos: int = 2) -> bool:
    """A reduction ``node`` over the last dim of xv only, with keepdim."""
    dims = node.args[dim_pos] if len(node.args) > dim_pos else node.kwargs.get("dim")
    keep = node.args[keep_pos] if len(node.args) > keep_pos else node.kwargs.get("keepdim", False)
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return keep is True and len(dims) == 1 and dims[0] in (-1, xv.dim() - 1)


class ManualLayerNorm(Pattern):
    """The LayerNorm of older GPT-2/BERT/ViT code: ``u = x.mean(-1, keepdim=True)``, ``s = (x - u).pow(2).mean(-1,
    keepdim=True)`` (or ``x.var(-1, keepdim=True, unbiased=False)`` / ``correction=0``), ``(x - u) / sqrt(s + eps)``,
    then optional ``weight *`` and ``+ bias`` ([N] vectors). ``x - u`` may be one node or written twice."""

    name = "canonical_manual_layer_norm"
    stage = "pre_grad"
    order = 15
    switch = "canonicalize_norms"

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if _is(n, "sqrt", torch.sqrt) and len(n.users) == 1
                and _is(next(iter(n.users)), "div", operator.truediv, torch.div)]

    @staticmethod
    def _centered(d: Any) -> tuple[Any, Any]:
        """(x, u) of ``d = x - u`` with ``u = x.mean(...)``, else (None, None)."""
        if not (_is(d, "sub", operator.sub, torch.sub) and len(d.args) == 2 and not d.kwargs):
            return None, None
        x, u = d.args
        if not (_is(u, "mean", torch.mean) and u.args and u.args[0] is x):
            return None, None
        return x, u

    def match(self, sqrt: Node) -> dict[str, Any]:
        div = next(iter(sqrt.users))
        require(len(div.args) == 2 and div.args[1] is sqrt and not div.kwargs, "sqrt(...) is not a divisor")
        d = div.args[0]
        x, u = self._centered(d)
        require(x is not None, "the numerator is not x - x.mean(...)")
        xv = val(x)
        require(isinstance(xv, torch.Tensor) and fx_utils.static_width(xv),
                "dynamic shapes (a symbolic norm width): left to Inductor")
        require(xv.dtype in _SUPPORTED_DTYPES, f"dtype {xv.dtype} not supported (fp32/fp16/bf16 only)")
        require(_last_dim_keep(u, xv), "mean is not over the last dim with keepdim")
        denom = sqrt.args[0]
        require(_is(denom, "add", operator.add, torch.add) and len(denom.args) == 2 and not denom.kwargs,
                "sqrt of something other than var + eps")
        v, eps = denom.args if isinstance(denom.args[1], (int, float)) else denom.args[::-1]
        require(isinstance(eps, (int, float)) and not isinstance(eps, bool), "sqrt(... + eps) with a non-constant eps")
        inner = [denom]
        if _is(v, "var", torch.var):
            require(v.args and v.args[0] is x, "variance of something other than x")
            require(_last_dim_keep(v, xv, keep_pos=3), "variance is not over the last dim with keepdim")
            unbiased = v.args[2] if len(v.args) > 2 else v.kwargs.get("unbiased", None)
            correction = v.kwargs.get("correction", None)
            biased = unbiased is False or (unbiased is None and correction is not None and correction == 0)
            require(biased, "unbiased variance (LayerNorm divides by N: unbiased=False or correction=0)")
            inner.append(v)
        else:
            require(_is(v, "mean", torch.mean) and v.args, "sqrt of something other than var + eps")
            sq = v.args[0]
            d2 = _square_base(sq) if isinstance(sq, Node) else None
            require(d2 is not None and self._centered(d2) == (x, u), "variance is not mean((x - u)^2)")
            require(_last_dim_keep(v, xv), "variance mean is not over the last dim with keepdim")
            inner += [v, sq] + ([d2] if d2 is not d else [])
        inner += [sqrt, d, u]
        end, nodes = div, [div]
        end, weight = _affine(end, xv, "the LayerNorm is")
        nodes += [end] if weight is not None else []
        bias = None
        nxt = fx_utils.single_user(end)
        if _is(nxt, "add", operator.add, torch.add) and len(nxt.args) == 2 and not nxt.kwargs:
            other = nxt.args[1] if nxt.args[0] is end else nxt.args[0]
            ov = val(other) if isinstance(other, Node) else None
            if isinstance(ov, torch.Tensor) and tuple(ov.shape) == (xv.shape[-1],):
                bias, end = other, nxt
                nodes.append(end)
        # The intermediates go with the norm: each is read only inside it.
        mine = set(inner) | {div}
        for n in inner:
            require(not fx_utils.users_outside(n, mine), "intermediate results of the LayerNorm are used elsewhere")
        return {"x": x, "eps": float(eps), "weight": weight, "bias": bias, "end": end,
                "nodes": nodes + inner}

    def rewrite(self, graph: fx.Graph, m: dict[str, Any], rep: GraphReport) -> None:
        canonicalize(graph, rep, self.name, m["end"], m["nodes"], m["x"], m["weight"], m["bias"], m["eps"], False,
                     f"eps={m['eps']}, weight={'yes' if m['weight'] else 'no'}, bias={'yes' if m['bias'] else 'no'}")

