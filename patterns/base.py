"""What every pattern shares: a name (the counter, config switch and report name), a stage, the candidate
nodes it looks at, and guards that reject a candidate with a reason the match report shows."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import config
from fusenorm_inductor.report import GraphReport


class Reject(Exception):
    """A candidate that the pattern does not rewrite; the message is the reason in the match report."""


def require(cond: Any, reason: str) -> None:
    if not cond:
        raise Reject(reason)


class Pattern:
    name: str = ""
    stage: str = ""  # "pre_grad" or "joint"
    switch: Optional[str] = None  # config attribute that turns the pattern on/off (None: always on)

    def enabled(self) -> bool:
        if self.switch is None:
            return True
        obj: Any = config
        for part in self.switch.split("."):
            obj = getattr(obj, part)
        return bool(obj)

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        raise NotImplementedError

    def match(self, node: Node) -> Any:
        """Return what ``rewrite`` needs, or raise Reject(reason)."""
        raise NotImplementedError

    def rewrite(self, graph: fx.Graph, m: Any, rep: GraphReport) -> None:
        raise NotImplementedError

    def apply(self, graph: fx.Graph, rep: GraphReport) -> int:
        count = 0
        for node in list(self.candidates(graph)):
            if node.graph is not graph:  # erased by an earlier rewrite
                continue
            if not self.enabled():
                rep.skip(self.name, self.stage, node, f"pattern disabled by config ({self.switch})")
                continue
            try:
                m = self.match(node)
            except Reject as r:
                rep.skip(self.name, self.stage, node, str(r))
                continue
            self.rewrite(graph, m, rep)
            count += 1
        return count


# ---- argument helpers ------------------------------------------------------------------------------------


def bind_op_args(node: Node) -> dict[str, Any]:
    """Arguments of an OpOverload call by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def describe(node: Any) -> str:
    """A node as the match report names it: its kind and target ("call_function mm", "placeholder x")."""
    if isinstance(node, Node):
        return f"{node.op} {getattr(node.target, '__name__', node.target)}"
    return repr(node)


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def getitem_users(node: Node) -> dict[int, list[Node]]:
    """For a multi-output op: output index -> the getitem nodes reading it."""
    import operator

    out: dict[int, list[Node]] = {}
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem:
            out.setdefault(u.args[1], []).append(u)
    return out
