"""Pre-grad patterns: every way users write a LayerNorm or RMSNorm becomes one ``fusenorm::norm`` call.

Runs on Dynamo's torch-level graph (``pre_grad_custom_pass``): ``nn.LayerNorm``/``F.layer_norm``/
``torch.layer_norm``, ``nn.RMSNorm``/``F.rms_norm``/``torch.rms_norm``, and the hand-written LLaMA RMSNorm
(``x.float()``, ``pow(2).mean(-1, keepdim=True)``, ``+ eps``, ``rsqrt``, ``*``, optional cast back and
``weight *``). The output dtype is read from the traced example value, so autocast's choices (LayerNorm
kept in fp32 on CUDA) are preserved exactly: the canonical op computes in fp32 and writes that dtype.
"""

from __future__ import annotations

import operator
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


def _insert_norm(graph: fx.Graph, anchor: Node, x, weight, bias, eps: float, is_rms: bool) -> Node:
    """Insert the canonical op before ``anchor`` and return the node of its output y."""
    out_dtype = val(anchor).dtype
    with graph.inserting_before(anchor):
        op = fx_utils.call(graph, NORM, x, weight, bias, float(eps), is_rms, out_dtype)
        y = fx_utils.call(graph, operator.getitem, op, 0)
    y.meta.update({k: v for k, v in anchor.meta.items() if k in ("stack_trace", "nn_module_stack")})
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
        require(fx_utils.is_static(xv), "dynamic shapes: left to Inductor")
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
        y = _insert_norm(graph, node, m["x"], m["weight"], m["bias"], m["eps"], self.is_rms)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        xv = val(m["x"])
        rep.rewrite(self.name, self.stage, [node.name], {"x": list(xv.shape)}, xv.dtype,
                    "fusenorm::norm (canonical)", f"eps={m['eps']}")


class LayerNormCall(_NormCall):
    """``F.layer_norm`` / ``torch.layer_norm`` (what ``nn.LayerNorm`` traces to)."""

    name = "canonical_layer_norm"
    targets = (F.layer_norm, torch.layer_norm)

    def bind(self, node: Node) -> dict[str, Any]:
        return _bind(node, ("input", "normalized_shape", "weight", "bias", "eps"),
                     {"weight": None, "bias": None, "eps": 1e-5})


class RMSNormCall(_NormCall):
    """``F.rms_norm`` / ``torch.rms_norm`` (what ``nn.RMSNorm`` traces to); eps=None is the dtype's eps."""

    name = "canonical_rms_norm"
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


def _casts_dtype_only(node: Node) -> bool:
    """``t.to(dtype)`` with nothing else (no device, no copy flags)."""
    dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return isinstance(dtype, torch.dtype) and len(node.args) <= 2 and set(node.kwargs) <= {"dtype"}


class LlamaRMSNorm(Pattern):
    """``x * rsqrt(mean(x^2, -1, keepdim) + eps)`` [``.to(dtype)``] [``* weight``], x often ``h.float()``."""

    name = "canonical_llama_rms_norm"
    stage = "pre_grad"
    switch = "canonicalize_norms"

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if _is(n, "rsqrt", torch.rsqrt)]

    def match(self, rsqrt: Node) -> dict[str, Any]:
        denom = rsqrt.args[0]
        require(_is(denom, "add", operator.add, torch.add) and len(denom.args) == 2 and not denom.kwargs,
                "rsqrt of something other than mean(x^2) + eps")
        ms, eps = (denom.args if isinstance(denom.args[1], (int, float)) else denom.args[::-1])
        require(isinstance(eps, (int, float)), "rsqrt(... + eps) with a non-constant eps")
        require(_is(ms, "mean", torch.mean), "rsqrt of something other than mean(x^2) + eps")
        dims = ms.args[1] if len(ms.args) > 1 else ms.kwargs.get("dim")
        keep = ms.args[2] if len(ms.args) > 2 else ms.kwargs.get("keepdim", False)
        sq = ms.args[0]
        x = self._square_base(sq)
        require(x is not None, "mean of something other than x^2")
        xv = val(x)
        require(fx_utils.is_static(xv), "dynamic shapes: left to Inductor")
        last = xv.dim() - 1
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        require(keep and len(dims) == 1 and dims[0] in (-1, last), "mean is not over the last dim with keepdim")
        require(len(ms.users) == 1 and len(denom.users) == 1 and len(sq.users) == 1 and len(rsqrt.users) == 1,
                "intermediate results of the RMSNorm are used elsewhere")
        mul = next(iter(rsqrt.users))
        require(_is(mul, "mul", operator.mul, torch.mul) and set(mul.args) == {x, rsqrt},
                "rsqrt(...) is not multiplied by the normalized input")
        # Optional cast back, then optional `weight *`.
        end, cast, weight = mul, None, None
        nxt = fx_utils.single_user(end)
        if nxt is not None and (_is(nxt, "type_as") or (_is(nxt, "to") and _casts_dtype_only(nxt))):
            cast, end = nxt, nxt
            nxt = fx_utils.single_user(end)
        if nxt is not None and _is(nxt, "mul", operator.mul, torch.mul) and len(nxt.args) == 2:
            other = nxt.args[0] if nxt.args[1] is end else nxt.args[1]
            ov = val(other)
            if isinstance(other, Node) and isinstance(ov, torch.Tensor) and tuple(ov.shape) == (xv.shape[-1],):
                weight, end = other, nxt
        src = _float_cast_source(x)
        source = src if src is not None and val(src).dtype in _SUPPORTED_DTYPES else x
        require(val(source).dtype in _SUPPORTED_DTYPES, f"dtype {val(source).dtype} not supported")
        nodes = [sq, ms, denom, rsqrt, mul]
        nodes += [cast] if cast is not None else []
        nodes += [end] if weight is not None else []
        nodes += [x] if source is not x else []  # the fp32 upcast: the canonical op reads `source` itself
        return {"x": source, "eps": float(eps), "weight": weight, "end": end, "nodes": nodes}

    @staticmethod
    def _square_base(sq: Node) -> Optional[Node]:
        if _is(sq, "pow", torch.pow, operator.pow) and len(sq.args) == 2 and sq.args[1] == 2:
            return sq.args[0]
        if _is(sq, "square", torch.square) and len(sq.args) == 1:
            return sq.args[0]
        if _is(sq, "mul", operator.mul, torch.mul) and len(sq.args) == 2 and sq.args[0] is sq.args[1]:
            return sq.args[0]
        return None

    def rewrite(self, graph: fx.Graph, m: dict[str, Any], rep: GraphReport) -> None:
        end = m["end"]
        y = _insert_norm(graph, end, m["x"], m["weight"], None, m["eps"], True)
        end.replace_all_uses_with(y)
        fx_utils.erase_if_unused(graph, reversed(m["nodes"]))
        xv = val(m["x"])
        rep.rewrite(self.name, self.stage, [n.name for n in m["nodes"]], {"x": list(xv.shape)}, xv.dtype,
                    "fusenorm::norm (canonical)", f"eps={m['eps']}, weight={'yes' if m['weight'] else 'no'}")


PRE_GRAD_PATTERNS = (LayerNormCall(), RMSNormCall(), LlamaRMSNorm())
