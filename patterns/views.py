"""How a fusion sees the graph around a canonical norm, at the stage that asks.

The fusions match on the joint graph (ATen ops, forward and backward). At the pre-grad stage ``norm_prospects``
(prospects.py) asks each of them whether it would take a canonical norm, on Dynamo's torch-level graph, before
the joint graph exists. So a fusion writes its match once, against the questions of ``GraphView``, and is
given the view of the graph at hand: ``JOINT`` answers them on the joint graph; ``TorchView`` answers them on
the torch-level graph, about the joint graph that AOTAutograd will trace from it (a linear is the GEMM the
joint graph will compute, ``[M, K] @ [K, N]``, with its operands in the dtype autocast gives them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx import Node

from fusenorm_inductor import fx_utils
from fusenorm_inductor.fx_utils import flat_like, val

from .base import describe, getitem_users, is_op, require

aten = torch.ops.aten
NORM_BWD = torch.ops.fusenorm.norm_backward.default
GEMMS = (aten.mm.default, aten.addmm.default)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)
# Value-preserving nodes a walk looks through besides views: a clone is what an inactive dropout (p = 0, or
# eval mode) becomes (HF BERT's dropout between its output linear and the residual).
IDENTITIES = VIEWS + (aten.clone.default,)


@dataclass
class Gemm:
    """``out = a @ b (+ bias)``: ``node`` computes out; ``a``, ``b`` and ``bias`` are its operands' nodes
    (``bias`` None without one)."""

    node: Node
    a: Node
    b: Node
    bias: Any


class GraphView:
    """The questions a fusion's match asks of the graph."""

    def identity_input(self, n: Any) -> Optional[Node]:
        """The input of a value-preserving node (a view, a clone), else None."""
        raise NotImplementedError

    def is_add(self, n: Any) -> bool:
        """Whether ``n`` is an elementwise add (what a residual add is)."""
        raise NotImplementedError

    def gemm(self, n: Any) -> Optional[Gemm]:
        """``n`` as the output of a GEMM (a linear), else None."""
        raise NotImplementedError

    def gemm_values(self, g: Gemm) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The example values of the joint graph's GEMM operands: a ``[M, K]``, b ``[K, N]``, bias ``[N]`` or
        None. Rejects a GEMM that the fused kernels cannot take."""
        raise NotImplementedError

    def gemm_input(self, u: Node, y: Node, m: Any, k: Any) -> Optional[Node]:
        """The node through which ``u``, a user of ``y`` (``[..., K]``, M rows), gives y to GEMMs as their
        ``[M, K]`` operand a: a view of y to [M, K], or y itself where a GEMM reads it as it is; None where
        ``u`` does neither."""
        raise NotImplementedError

    def norm_backward(self, norm: Node) -> list[Node]:
        """The norm's backward nodes (those the graph holds)."""
        raise NotImplementedError

    def has_backward(self, norm: Node) -> bool:
        """Whether the norm has a backward (its gradient is needed)."""
        raise NotImplementedError

    def training(self, graph: fx.Graph) -> bool:
        """Whether the graph computes gradients."""
        raise NotImplementedError

    def implied_weight_grads(self, weights: list[Node]) -> int:
        """How many weight gradients of the linears with these weights (their b operands) the graph does not
        hold but the joint graph will."""
        raise NotImplementedError


def through_identities(view: GraphView, n: Any, chain: Optional[list] = None) -> Any:
    """The node under any value-preserving nodes of ``n``; the ones reached are appended to ``chain``."""
    while (inner := view.identity_input(n)) is not None:
        n = inner
        if chain is not None:
            chain.append(n)
    return n


# ---- the joint graph -----------------------------------------------------------------------------------------


def norm_backward_partners(norm: Node) -> list[Node]:
    """The ``fusenorm::norm_backward`` nodes of this norm: they read its saved mean/rstd outputs (in the
    joint graph's pre pass, through chains of ``aten.alias``)."""
    found: list[Node] = []
    todo = [g for i, gs in getitem_users(norm).items() if i in (1, 2) for g in gs]
    while todo:
        for u in todo.pop().users:
            if is_op(u, NORM_BWD) and u not in found:
                found.append(u)
            elif is_op(u, aten.alias.default):
                todo.append(u)
    return found


class JointView(GraphView):
    """The joint graph: a linear is ``mm(a, b)`` or ``addmm(bias, a, b)``."""

    def identity_input(self, n: Any) -> Optional[Node]:
        return n.args[0] if is_op(n, *IDENTITIES) else None

    def is_add(self, n: Any) -> bool:
        return is_op(n, aten.add.Tensor)

    def gemm(self, n: Any) -> Optional[Gemm]:
        if is_op(n, aten.mm.default):
            return Gemm(n, n.args[0], n.args[1], None)
        if is_op(n, aten.addmm.default):
            return Gemm(n, n.args[1], n.args[2], n.args[0])
        return None

    def gemm_values(self, g: Gemm) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``mm(a, b)``, or ``addmm(bias, a, b)`` with a 1-D bias and beta = alpha = 1."""
        if g.node.target is aten.addmm.default:
            require(g.node.kwargs.get("beta", 1) == 1 and g.node.kwargs.get("alpha", 1) == 1,
                    "addmm with beta/alpha != 1")
            require(isinstance(g.bias, Node) and val(g.bias).dim() == 1, "addmm bias is not a 1-D vector")
        return val(g.a), val(g.b), val(g.bias)

    def gemm_input(self, u: Node, y: Node, m: Any, k: Any) -> Optional[Node]:
        if is_op(u, *VIEWS) and fx_utils.same_shape(val(u).shape, (m, k)):
            return u
        if val(y).dim() == 2 and is_op(u, *GEMMS):
            return y
        return None

    def norm_backward(self, norm: Node) -> list[Node]:
        return norm_backward_partners(norm)

    def has_backward(self, norm: Node) -> bool:
        return bool(norm_backward_partners(norm))

    def training(self, graph: fx.Graph) -> bool:
        return bool(fx_utils.tangent_dependent(graph))

    def implied_weight_grads(self, weights: list[Node]) -> int:
        return 0  # the joint graph holds its weight gradients: the match finds them


JOINT = JointView()


# ---- Dynamo's torch-level graph ------------------------------------------------------------------------------


LINEARS = (torch._C._nn.linear, F.linear)
MATMULS = (torch.matmul, operator.matmul, torch.mm)
VIEW_METHODS = ("view", "reshape", "contiguous", "clone")


def _is_method(n: Any, *names: str) -> bool:
    return isinstance(n, Node) and n.op == "call_method" and n.target in names


class TorchView(GraphView):
    """The torch-level graph, before autograd: a linear is ``F.linear`` or a matmul by a 2-D matrix, which the
    joint graph computes as ``mm``/``addmm`` of its input as ``[M, K]``. ``training``: whether the norm's
    output requires grad (the joint graph then holds its backward and the linears' weight gradients)."""

    def __init__(self, training: bool) -> None:
        self.is_training = training

    def identity_input(self, n: Any) -> Optional[Node]:
        """A view, reshape, clone, contiguous, or an inactive dropout (which the joint graph holds as a clone)."""
        if _is_method(n, *VIEW_METHODS) or is_op(n, torch.reshape, torch.clone):
            return n.args[0] if n.args and isinstance(n.args[0], Node) else None
        if is_op(n, F.dropout, torch.dropout):
            p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
            training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
            if p == 0 or training is False:
                return n.args[0]
        return None

    def is_add(self, n: Any) -> bool:
        return is_op(n, operator.add, torch.add) or _is_method(n, "add")

    def gemm(self, n: Any) -> Optional[Gemm]:
        if is_op(n, *LINEARS):
            inp = n.args[0]
            w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
            bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            if isinstance(inp, Node) and isinstance(w, Node) and val(w).dim() == 2:
                return Gemm(n, inp, w, bias if isinstance(bias, Node) else None)
        elif is_op(n, *MATMULS) or _is_method(n, "matmul", "mm"):
            if len(n.args) == 2 and all(isinstance(a, Node) for a in n.args) and val(n.args[1]).dim() == 2:
                return Gemm(n, n.args[0], n.args[1], None)
        elif is_op(n, torch.addmm) and len(n.args) == 3 and not n.kwargs:
            # HF GPT-2's Conv1D: addmm(bias, x.view(-1, K), W) with W [K, N], as the joint graph has it
            bias, a, w = n.args
            if all(isinstance(t, Node) for t in n.args) and val(w).dim() == 2 and val(bias).dim() == 1:
                return Gemm(n, a, w, bias)
        return None

    def gemm_values(self, g: Gemm) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """a: the input as ``[M, K]`` in the output's dtype. A linear's b is ``permute(W)`` in the joint graph,
        W cast to the GEMM's dtype (autocast) and transposed; its bias is cast likewise."""
        out = val(g.node)
        n_ = out.shape[-1]
        a = flat_like(out, out.numel() // n_, val(g.a).shape[-1])
        if is_op(g.node, torch.addmm):
            return a, val(g.b), val(g.bias)
        if not is_op(g.node, *LINEARS):
            return a, val(g.b), None
        w = val(g.b)
        b = flat_like(w, *w.shape, dtype=out.dtype).t()
        return a, b, flat_like(val(g.bias), n_, dtype=out.dtype) if g.bias is not None else None

    def gemm_input(self, u: Node, y: Node, m: Any, k: Any) -> Optional[Node]:
        """A linear reading y as its input, or a view of y to [M, K] that only GEMMs read as their input (the
        ``x.view(-1, K)`` before a Conv1D's addmm); one computed in another dtype (autocast) reads a cast of y in
        the joint graph, which is a user that is not a linear."""
        if self.identity_input(u) is y and u.users and fx_utils.same_shape(val(u).shape, (m, k)):
            if all((g := self.gemm(w)) is not None and g.a is u and g.b is not u for w in u.users):
                return u
        g = self.gemm(u)
        if g is None or g.a is not y:
            return None
        require(val(u).dtype == val(y).dtype,
                f"norm output has a user that is not a linear (a cast to {val(u).dtype} before {describe(u)})")
        return y

    def norm_backward(self, norm: Node) -> list[Node]:
        return []  # traced later, by AOTAutograd

    def has_backward(self, norm: Node) -> bool:
        return self.is_training

    def training(self, graph: fx.Graph) -> bool:
        return self.is_training

    def implied_weight_grads(self, weights: list[Node]) -> int:
        """In training, one per weight that requires grad."""
        return sum(1 for w in weights if self.is_training and bool(getattr(val(w), "requires_grad", False)))
