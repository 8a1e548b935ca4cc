"""``norm_prospects``: a canonical norm that no fusion will take goes back to what the user wrote.

Pre-grad, last (after the attention patterns, which take their norms whole). The joint-graph fusions can
only use a norm that reached them as ``fusenorm::norm``, but a canonical norm they leave unfused would be
decomposed with fusenorm's reference (patterns/decompose.py), which is not the code Inductor writes for the
norm as traced: numerics differ in the last bits and the compile takes longer. So each canonical norm is
asked here, on the torch-level graph, whether a joint fusion would take it, with the decision those
patterns take (the same measured choice, for the shapes, dtypes and strides the joint graph will have):

- ``linear_norm_fwd``: the norm's input is a linear's output (through views, clones, an inactive dropout and
  one residual add), read by nothing else, and ``forward_choice`` fuses;
- ``norm_linear_fwd``: every user of its output is a linear reading it as its input, in its dtype, and
  ``prenorm_decision`` fuses;
- ``dgrad_norm_bwd``: in training, its output feeds a linear whose data-gradient GEMM ``backward_choice``
  fuses with the norm's backward.

A norm none would take is put back exactly as traced (its nodes, names and metadata, in place), so Inductor
compiles it as it would without fusenorm; the match report lists it under ``norm_prospects`` with the
reasons. What this check cannot see (the joint graph differs from what the torch-level graph suggests) is
still handled in the joint stage: a norm kept here that no fusion takes there is decomposed as before
(correct, not bitwise Inductor's).
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.node import map_arg

from fusenorm_inductor.fx_utils import flat_like, same_shape, val
from fusenorm_inductor.tuning.decide import backward_choice, forward_choice
from fusenorm_inductor.report import GraphReport

from .base import Pattern, Reject, bind_op_args, describe, getitem_users, is_op, require
from .canonical_norms import REVERT_KEY, Original
from .dgrad_norm_backward import DgradNormBwd
from .post_norm import LinearNormFwd
from .pre_norm import NormLinearFwd, prenorm_decision

NORM = torch.ops.fusenorm.norm.default
LINEARS = (torch._C._nn.linear, F.linear)
MATMULS = (torch.matmul, operator.matmul, torch.mm)
ADDS = (operator.add, torch.add)
VIEW_METHODS = ("view", "reshape", "contiguous", "clone")


def _is_method(n: Any, *names: str) -> bool:
    return isinstance(n, Node) and n.op == "call_method" and n.target in names


def _identity_input(n: Node) -> Optional[Node]:
    """The input of a value-preserving node (view, reshape, clone, contiguous, an inactive dropout), else None."""
    if _is_method(n, *VIEW_METHODS) or is_op(n, torch.reshape, torch.clone):
        return n.args[0] if n.args and isinstance(n.args[0], Node) else None
    if is_op(n, F.dropout, torch.dropout):
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
        if p == 0 or training is False:
            return n.args[0]
    return None


def _linear_parts(n: Node) -> Optional[tuple[Node, torch.Tensor, Optional[Node]]]:
    """(input, b as the joint graph's [K, N] GEMM operand, bias) of a linear or a matmul by a 2-D matrix."""
    if is_op(n, *LINEARS):
        inp = n.args[0]
        w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if not (isinstance(inp, Node) and isinstance(w, Node) and val(w).dim() == 2):
            return None
        out = val(n)
        # mm(a, permute(W)): W cast to the GEMM's dtype (autocast) and transposed.
        return inp, flat_like(val(w), *val(w).shape, dtype=out.dtype).t(), bias if isinstance(bias, Node) else None
    if is_op(n, *MATMULS) or _is_method(n, "matmul", "mm"):
        if len(n.args) == 2 and all(isinstance(a, Node) for a in n.args) and val(n.args[1]).dim() == 2:
            return n.args[0], val(n.args[1]), None
    return None


def _under(n: Node, chain: list[Node]) -> Node:
    """``n`` under value-preserving nodes; the ones passed are appended to chain."""
    while (inner := _identity_input(n)) is not None:
        chain.append(n)
        n = inner
    return n


class NormProspects(Pattern):
    """Not a fusion: reverts canonical norms no fusion would take (counted as a skip, not a rewrite)."""

    name = "norm_prospects"
    stage = "pre_grad"

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if is_op(n, NORM) and REVERT_KEY in n.meta]

    def apply(self, graph: fx.Graph, rep: GraphReport) -> int:
        moved: dict[Node, Node] = {}  # a reverted norm's output node -> the original node that replaced it
        for op in self.candidates(graph):
            orig: Original = op.meta.pop(REVERT_KEY)
            reasons = self.prospects(op, orig)
            if reasons and _revert(graph, op, orig, moved):
                rep.retract(orig.record)
                rep.skip(self.name, self.stage, orig.end.name,
                         "left as written, for Inductor: no fusion would take it ("
                         + "; ".join(f"{name}: {why}" for name, why in reasons) + ")")
                for name, why in reasons:  # each forward fusion's reason under its own name, as the joint stage does
                    if name != "dgrad_norm_bwd":
                        rep.skip(name, self.stage, orig.end.name, why)
        return 0

    def prospects(self, op: Node, orig: Original) -> list[tuple[str, str]]:
        """[] when a joint fusion would take the norm, else (pattern, why not) for each."""
        args = bind_op_args(op)
        training = bool(getattr(val(orig.end), "requires_grad", False))
        reasons = []
        checks = ((LinearNormFwd(), self.post_norm), (NormLinearFwd(), self.pre_norm), (DgradNormBwd(), self.dgrad))
        for pattern, check in checks:
            name = pattern.name
            if not pattern.enabled():
                reasons.append((name, f"pattern disabled by config ({pattern.switch})"))
                continue
            try:
                check(op, args, training)
                return []
            except Reject as r:
                reasons.append((name, str(r)))
        return reasons

    # ---- what each joint fusion needs, read on the torch-level graph ---------------------------------------
    def post_norm(self, op: Node, args: dict, training: bool) -> None:
        x = args["x"]
        chain: list[Node] = []
        cur, residual = _under(x, chain), None
        if is_op(cur, *ADDS) or _is_method(cur, "add"):
            require(len(cur.args) == 2 and not cur.kwargs and all(isinstance(a, Node) for a in cur.args),
                    "norm input is an add that is not a residual add")
            sides = [(s, o) for s, o in (cur.args, cur.args[::-1]) if _linear_parts(_under(s, []))]
            require(sides, "norm input is an add with no linear output on either side")
            chain.append(cur)
            side, residual = sides[0]
            require(same_shape(val(residual).shape, val(x).shape),
                    f"residual {tuple(val(residual).shape)} broadcasts to {tuple(val(x).shape)}")
            cur = _under(side, chain)
        parts = _linear_parts(cur)
        require(parts is not None, f"norm input is not a linear's output (comes from {describe(cur)})")
        for n in [cur] + chain:
            require(len(n.users) == 1, f"linear output {n.name} has another user: not fused")
        inp, b, bias = parts
        out = val(cur)
        k, n_ = val(inp).shape[-1], out.shape[-1]
        m = out.numel() // n_
        require(val(x).shape[-1] == n_, "norm is not over the linear's output dim")
        require(out.dtype in (torch.float32, torch.float16, torch.bfloat16) and out.dtype == b.dtype,
                f"GEMM dtype {out.dtype} not supported")
        affine = args["weight"] is not None or args["bias"] is not None
        choice = forward_choice(
            flat_like(out, m, k), b, flat_like(val(bias), n_, dtype=out.dtype) if bias is not None else None,
            flat_like(val(residual), m, n_) if residual is not None else None, val(args["weight"]),
            val(args["bias"]), args["eps"], args["is_rms"], args["out_dtype"] or val(x).dtype, affine and training)
        require(choice.fuse, choice.reason)

    def _consumers(self, op: Node, same_dtype: bool) -> list[tuple[Node, torch.Tensor, Optional[Node]]]:
        """The linears reading the norm's output as their input (else Reject); in its dtype if ``same_dtype``
        (autocast computes them in another: the joint graph casts between, which pre-norm cannot fuse)."""
        ys = getitem_users(op).get(0, [])
        require(ys, "norm output unused")
        found = []
        for y in ys:
            for u in y.users:
                parts = _linear_parts(u)
                require(parts is not None and parts[0] is y, f"norm output has a user that is not a linear ({describe(u)})")
                require(not same_dtype or val(u).dtype == val(y).dtype,
                        f"norm output has a user that is not a linear (a cast to {val(u).dtype} before {describe(u)})")
                found.append((u, parts[1], parts[2]))
        require(found, "norm output feeds no linear")
        return found

    def pre_norm(self, op: Node, args: dict, training: bool) -> None:
        xv = val(args["x"])
        require((args["out_dtype"] or xv.dtype) == xv.dtype, "norm changes dtype before the linear: not fused")
        consumers = self._consumers(op, True)
        k = xv.shape[-1]
        a2 = flat_like(xv, xv.numel() // k, k)
        n_wgrads = sum(1 for u, _, _ in consumers if training and _weight_requires_grad(u))
        _, why_not = prenorm_decision(a2, [(b, val(bias), u.name) for u, b, bias in consumers],
                                      val(args["weight"]), val(args["bias"]), args["eps"], args["is_rms"], n_wgrads)
        require(why_not is None, why_not)

    def dgrad(self, op: Node, args: dict, training: bool) -> None:
        require(training, "no backward (inference)")
        consumers = self._consumers(op, False)
        xv = val(args["x"])
        k = xv.shape[-1]
        m = xv.numel() // k
        extra = flat_like(xv, m, k) if len(consumers) > 1 else None
        last = None
        for u, b, _ in consumers:
            out = val(u)
            last = backward_choice(
                flat_like(out, m, out.shape[-1]), b.t(), extra, flat_like(xv, m, k), val(args["weight"]),
                None if args["is_rms"] else flat_like(xv, m, dtype=torch.float32), flat_like(xv, m, dtype=torch.float32),
                args["is_rms"], False, args["bias"] is not None, xv.dtype)
            if last.fuse:
                return
        raise Reject(last.reason)


def _weight_requires_grad(linear: Node) -> bool:
    w = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
    return bool(getattr(val(w), "requires_grad", False))


def _revert(graph: fx.Graph, op: Node, orig: Original, moved: dict[Node, Node]) -> bool:
    """Put the erased nodes back before ``op`` (same targets, arguments, names and metadata), give their last
    node the op's users, erase the op. An input that was the output of a norm reverted before is read from the
    node that replaced it (``moved``, which this adds to). False (nothing changed) when an input is gone."""
    if any(not (is_op(g, operator.getitem) and g.args[1] == 0) for g in op.users):
        return False
    copied = {rec[0] for rec in orig.nodes}
    env: dict[Node, Node] = {}

    def where(n: Node) -> Node:
        return env[n] if n in env else moved.get(n, n)

    for rec in orig.nodes:
        for a in rec[3] + tuple(rec[4].values()):
            for inp in _nodes_in(a):
                inp = where(inp)
                if inp not in copied and (inp.graph is not graph or getattr(inp, "_erased", False)):
                    return False
    with graph.inserting_before(op):
        for node, kind, target, a, kw, meta, name in orig.nodes:
            new = graph.create_node(kind, target, map_arg(a, where), map_arg(kw, where), name=name)
            new.meta = dict(meta)
            env[node] = new
    for g in list(op.users):
        g.replace_all_uses_with(env[orig.end])
        moved[g] = env[orig.end]
        graph.erase_node(g)
    graph.erase_node(op)
    return True


def _nodes_in(a: Any) -> list[Node]:
    found: list[Node] = []
    map_arg(a, lambda n: found.append(n))
    return found
