"""Canonical norms that found no GEMM partner go back to aten ops, so Inductor fuses them as it always did.

Runs last in the joint stage. Each remaining ``fusenorm::norm`` / ``fusenorm::norm_backward`` is replaced
by its plain-torch reference traced with Inductor's decompositions (the same function that is the ops' CPU
implementation and the tests' oracle).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import fx_utils
from fusenorm_inductor.ops.norm import decomposition
from fusenorm_inductor.report import GraphReport

from .base import Pattern, bind_op_args, getitem_users, is_op

CANONICAL = (torch.ops.fusenorm.norm.default, torch.ops.fusenorm.norm_backward.default)


def decompose_node(graph: fx.Graph, node: Node) -> None:
    with graph.inserting_before(node):
        outs = fx_utils.inline(graph, decomposition(node.target), list(bind_op_args(node).values()))
    for idx, gs in getitem_users(node).items():
        for g in gs:
            g.replace_all_uses_with(outs[idx])
            graph.erase_node(g)
    graph.erase_node(node)


class DecomposeUnfused(Pattern):
    """Not a fusion: the fallback for canonical ops left in the graph (not counted, not reported)."""

    name = "decompose_unfused"
    stage = "joint"
    order = 90  # last: the canonical ops that no fusion took
    counted = False

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if is_op(n, *CANONICAL)]

    def apply(self, graph: fx.Graph, rep: GraphReport) -> int:
        nodes = list(self.candidates(graph))
        for node in nodes:
            decompose_node(graph, node)
        return len(nodes)


def decompose_all(graph: fx.Graph) -> int:
    return DecomposeUnfused().apply(graph, None)
