"""What every pattern shares: a name (the counter, config switch and report name), a stage and its place in
it, the candidate nodes it looks at, and guards that reject a candidate with a reason the match report shows."""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Optional

import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import config
from fusenorm_inductor.report import GraphReport


class Reject(Exception):
    """A candidate that the pattern does not rewrite; the message is the reason in the match report."""


def require(cond: Any, reason: str) -> None:
    if not cond:
        raise Reject(reason)


STAGE_NAMES = ("pre_grad", "joint")


class Pattern:
    name: str = ""
    stage: str = ""  # one of STAGE_NAMES
    # Where the pattern runs in its stage (ascending). A class that declares it runs as a pattern; one that does
    # not (a base shared by patterns) does not. patterns/__init__.py lists the resulting order.
    order: Optional[float] = None
    switch: Optional[str] = None  # config attribute that turns the pattern on/off (None: always on)
    counted: bool = True  # False: a step that rewrites nothing under its own name (not in PATTERN_NAMES)
    anchor: Any = None  # the op whose nodes are the candidates (None: ``candidates`` says)
    # A joint-graph fusion that takes canonical norms defines ``prospect(norm, view)``: at the pre-grad stage,
    # return when it would take ``norm`` (a ``fusenorm::norm`` node), raise Reject(reason) when not; ``view``
    # (patterns/views.py) is the graph as the fusion's match reads it. norm_prospects asks each such fusion.
    prospect: Optional[Callable[..., None]] = None

    def enabled(self) -> bool:
        if self.switch is None:
            return True
        obj: Any = config
        for part in self.switch.split("."):
            obj = getattr(obj, part)
        return bool(obj)

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        if self.anchor is None:
            raise NotImplementedError
        return [n for n in graph.nodes if is_op(n, self.anchor)]

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
            before, since = _measuring_s(), (len(rep.rewrites), len(rep.skips))
            try:
                m = self.match(node)
            except Reject as r:
                rep.skip(self.name, self.stage, node, str(r))
                rep.charge(_measuring_s() - before, since)
                continue
            self.rewrite(graph, m, rep)
            rep.charge(_measuring_s() - before, since)
            count += 1
        return count


def _measuring_s() -> float:
    """Seconds this process has spent measuring (tuning/measure.py): a match's share is the difference."""
    from fusenorm_inductor.tuning import measure

    return sum(measure.spent_seconds().values())


def stage_patterns(stage: str) -> tuple[Pattern, ...]:
    """One instance of every pattern class of this package whose stage is ``stage``, in their order. The
    package's __init__ imports each of its modules first, so every class is defined by then (a class replaced
    by a reload of its module is not its module's any more: skipped)."""
    package = __name__.rpartition(".")[0] + "."
    found, todo = [], list(Pattern.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if (vars(cls).get("order") is None or not cls.__module__.startswith(package)
                or getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is not cls):
            continue
        if cls.stage not in STAGE_NAMES:
            raise ValueError(f"pattern {cls.name}: unknown stage {cls.stage!r}")
        if cls.stage == stage:
            found.append(cls)
    found.sort(key=lambda cls: cls.order)
    for a, b in zip(found, found[1:]):
        if a.order == b.order:
            raise ValueError(f"patterns {a.name} and {b.name} have the same order ({a.order}) in stage {stage}")
    return tuple(cls() for cls in found)


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
