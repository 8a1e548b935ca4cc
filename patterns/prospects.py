"""``norm_prospects``: a canonical norm that no fusion will take goes back to what the user wrote.

Pre-grad, last (after the attention patterns, which take their norms whole). The joint-graph fusions can
only use a norm that reached them as ``fusenorm::norm``, but a canonical norm they leave unfused would be
decomposed with fusenorm's reference (patterns/decompose.py), which is not the code Inductor writes for the
norm as traced: numerics differ in the last bits and the compile takes longer. So each joint-graph fusion that
takes canonical norms (one that defines ``Pattern.prospect``) is asked here, on the torch-level graph, whether
it would take the norm: its own match and decision, read through ``views.TorchView`` (the shapes, dtypes and
strides the joint graph will have).

A norm none would take is put back exactly as traced (its nodes, names and metadata, in place), so Inductor
compiles it as it would without fusenorm; the match report lists it under ``norm_prospects`` with the
reasons. What this check cannot see (the joint graph differs from what the torch-level graph suggests) is
still handled in the joint stage: a norm kept here that no fusion takes there is decomposed as before
(correct, not bitwise Inductor's).
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx import Node
from torch.fx.node import map_arg

from fusenorm_inductor.fx_utils import val
from fusenorm_inductor.report import GraphReport, node_place, place_text

from .base import Pattern, Reject, is_op, stage_patterns
from .canonical_norms import REVERT_KEY, Original
from .views import TorchView

NORM = torch.ops.fusenorm.norm.default
PROSPECT_KEY = "fusenorm_prospect"  # node meta: the joint-graph fusion that would take this canonical norm


class NormProspects(Pattern):
    """Not a fusion: reverts canonical norms no fusion would take (counted as a skip, not a rewrite)."""

    name = "norm_prospects"
    stage = "pre_grad"
    order = 90  # last: after every pattern that takes canonical norms at this stage
    counted = False

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if is_op(n, NORM) and REVERT_KEY in n.meta]

    def apply(self, graph: fx.Graph, rep: GraphReport) -> int:
        moved: dict[Node, Node] = {}  # a reverted norm's output node -> the original node that replaced it
        # The fusions matched at the norm itself: their reasons go in the report under their own names too, as
        # the joint stage reports them (the backward fusion's candidate is the norm's backward, not the norm).
        at_norm = {p.name for p in self.fusions if p.anchor is NORM}
        for op in self.candidates(graph):
            orig: Original = op.meta.pop(REVERT_KEY)
            reasons = self.prospects(op, orig)
            if reasons and _revert(graph, op, orig, moved):
                rep.retract(orig.record)
                rep.skip(self.name, self.stage, orig.end.name,
                         "left as written, for Inductor: no fusion would take it ("
                         + "; ".join(f"{name}: {why}" for name, why in reasons) + ")")
                for name, why in reasons:
                    if name in at_norm:
                        rep.skip(name, self.stage, orig.end.name, why)
        return 0

    @property
    def fusions(self) -> tuple[Pattern, ...]:
        """The joint-graph fusions that take canonical norms, in their order."""
        return tuple(p for p in stage_patterns("joint") if p.prospect is not None)

    def prospects(self, op: Node, orig: Original) -> list[tuple[str, str]]:
        """[] when a joint fusion would take the norm, else (pattern, why not) for each."""
        view = TorchView(training=bool(getattr(val(orig.end), "requires_grad", False)))
        reasons = []
        for pattern in self.fusions:
            if not pattern.enabled():
                reasons.append((pattern.name, f"pattern disabled by config ({pattern.switch})"))
                continue
            try:
                pattern.prospect(op, view)
                # for the report of a graph left to Inductor (passes.py): the fusion, and the norm as traced
                op.meta[PROSPECT_KEY] = (pattern.name, orig.end.name, place_text([node_place(orig.end.meta)]))
                return []
            except Reject as r:
                reasons.append((pattern.name, str(r)))
        return reasons


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
    _restore_order(graph, [env.get(n, n) for n in orig.order])
    return True


def _restore_order(graph: fx.Graph, order: list[Node]) -> None:
    """Move ``order`` (the put-back nodes and the graph's own nodes that stood between them, as traced) into one
    run at the place of its earliest node, so the graph's order is the traced one again (AOT autograd derives
    the backward's order, and so Inductor's kernels and buffers, from it). Left as it is where a node is gone or
    the run would put a node before one of its inputs or after one of its users (a pass rewired it since)."""
    if any(n.graph is not graph or getattr(n, "_erased", False) for n in order) or len(set(order)) != len(order):
        return
    listed = list(graph.nodes)
    pos = {n: i for i, n in enumerate(listed)}
    run = set(order)
    start = min(pos[n] for n in order)
    final = [n for n in listed[:start] if n not in run] + order + [n for n in listed[start:] if n not in run]
    at = {n: i for i, n in enumerate(final)}
    for n in order:
        if any(at[i] > at[n] for i in n.all_input_nodes) or any(at[u] < at[n] for u in n.users):
            return
    prev = listed[start].prev
    for n in order:
        prev.append(n)
        prev = n


def _nodes_in(a: Any) -> list[Node]:
    found: list[Node] = []
    map_arg(a, lambda n: found.append(n))
    return found
