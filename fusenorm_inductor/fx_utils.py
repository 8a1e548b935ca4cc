"""Small FX helpers the patterns share: node values, creating nodes with fake metadata (and refreshing it
after a rewrite), inlining a traced function, telling backward nodes from forward ones in a joint graph, and
rendering graphs as code."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx import Node
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

aten = torch.ops.aten


def val(x: Any) -> Any:
    """The example value of a node (joint/post-grad graphs: meta['val']; Dynamo graphs: 'example_value')."""
    if isinstance(x, Node):
        return x.meta.get("val", x.meta.get("example_value"))
    return x


def is_static(*tensors: Any) -> bool:
    """True when every size and stride of the given example values is a plain int (no symbolic shapes)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if not all(isinstance(s, int) for s in (*t.shape, *t.stride())):
                return False
    return True


def fake_mode_of(graph: fx.Graph, args: Sequence[Any] = ()):
    """The fake mode the graph's example values live in (the values', not the ambient tracing context's:
    pre-grad graphs carry Dynamo's fake tensors while compile_fx may have set up another mode)."""
    for x in [*tree_flatten(list(args))[0], *graph.nodes]:
        v = val(x)
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _meta_key(graph: fx.Graph) -> str:
    # Dynamo (pre-grad) graphs carry 'example_value'; AOT graphs carry 'val'.
    for n in graph.nodes:
        if "val" in n.meta:
            return "val"
        if "example_value" in n.meta:
            return "example_value"
    return "val"


def call(graph: fx.Graph, target: Callable, *args: Any, **kwargs: Any) -> Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with its fake value in meta."""
    node = graph.call_function(target, tuple(args), kwargs)
    fake_mode = fake_mode_of(graph, (args, kwargs))
    if fake_mode is not None:
        with fake_mode:
            node.meta[_meta_key(graph)] = target(*tree_map(val, args), **tree_map(val, kwargs))
    return node


def snapshot(graph: fx.Graph) -> dict[Node, tuple]:
    """What each node computes from what (its target, args and kwargs objects, which FX replaces on any
    change): ``refresh_values`` finds from it the nodes a rewrite touched."""
    return {n: (n.target, n.args, n.kwargs) for n in graph.nodes}


def refresh_values(graph: fx.Graph, before: dict[Node, tuple]) -> int:
    """Recompute the example values of the nodes a rewrite created or rewired, and of everything downstream.

    A rewrite gives the users of a replaced node a new input, but their values were computed from the old
    one; in particular a view of the old output does not share storage with the new one. AOTAutograd reads
    aliasing from these values: a tensor saved for the backward that (per the values) no user output aliases
    is donated to the backward, which may then overwrite it in place, and so overwrite the user's output that
    really is a view of it (seen with a norm decomposed back to aten ops whose output is returned through a
    reshape: the backward wrote over the returned tensor). Returns the number of nodes updated."""
    from torch._dispatch.python import enable_python_dispatcher

    mode = fake_mode_of(graph)
    if mode is None:
        return 0
    key = _meta_key(graph)
    dirty: set[Node] = set()
    for n in graph.nodes:
        old = before.get(n)
        touched = old is None or old[0] is not n.target or old[1] is not n.args or old[2] is not n.kwargs
        if n.op != "call_function" or not (touched or any(a in dirty for a in n.all_input_nodes)):
            continue
        if "unbacked_bindings" in n.meta:  # running it again would mint new unbacked symbols: keep its value
            continue
        try:
            with mode, enable_python_dispatcher():
                new = n.target(*tree_map(val, n.args), **tree_map(val, n.kwargs))
        except Exception:  # an op that cannot run on the stored values (none known): keep its value
            continue
        n.meta[key] = new
        dirty.add(n)
    return len(dirty)


def getitems(graph: fx.Graph, node: Node, count: int) -> list[Node]:
    return [call(graph, operator.getitem, node, i) for i in range(count)]


def reshape(graph: fx.Graph, node: Node, shape: Sequence[int]) -> Node:
    """A view when the layout allows one (no copy), else a reshape."""
    v = val(node)
    if tuple(v.shape) == tuple(shape):
        return node
    target = aten.view.default if v.is_contiguous() else aten.reshape.default
    return call(graph, target, node, list(shape))


def inline(graph: fx.Graph, fn: Callable, args: Sequence[Any]) -> Any:
    """Trace ``fn(*args)`` into aten ops (Inductor's decompositions) and insert them at the insertion point.

    ``args`` may mix nodes and constants; returns the traced output with nodes in place of tensors.
    """
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = tree_flatten(list(args))
    node_pos = [i for i, a in enumerate(flat) if isinstance(a, Node)]

    def traced(*tensors):
        full = list(flat)
        for i, t in zip(node_pos, tensors):
            full[i] = t
        return fn(*tree_unflatten(full, spec))

    fake_mode = fake_mode_of(graph, args)
    with fake_mode:
        sub = make_fx(traced, select_decomp_table(), tracing_mode="real")(
            *[val(flat[i]) for i in node_pos]
        )
    env: dict[Node, Any] = {}
    placeholders = iter(flat[i] for i in node_pos)
    out = None
    key = _meta_key(graph)
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "output":
            out = tree_map(lambda x: env[x] if isinstance(x, Node) else x, n.args[0])
        elif n.op == "call_function":
            new = graph.call_function(
                n.target,
                tree_map(lambda x: env[x] if isinstance(x, Node) else x, n.args),
                tree_map(lambda x: env[x] if isinstance(x, Node) else x, n.kwargs),
            )
            if "val" in n.meta:
                new.meta[key] = n.meta["val"]
            env[n] = new
        else:  # get_attr: the references create no constants; refuse rather than inline wrongly.
            raise RuntimeError(f"fusenorm: cannot inline a '{n.op}' node from {fn}")
    return out


def erase_if_unused(graph: fx.Graph, nodes: Iterable[Node]) -> None:
    """Erase the given nodes (and then their now-dead inputs among them) once nothing uses them."""
    pending = list(nodes)
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if n.graph is graph and not n.users:
                graph.erase_node(n)
                pending.remove(n)
                changed = True


def tangent_dependent(graph: fx.Graph) -> set[Node]:
    """Nodes of a joint graph that depend on a tangent: the backward part (empty at inference)."""
    seen: set[Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" and (n.name.startswith("tangents") or "tangents" in str(n.target)):
            seen.add(n)
        elif n.op != "placeholder" and any(a in seen for a in n.all_input_nodes):
            seen.add(n)
    return seen


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder the nodes so that each follows its inputs, keeping the existing order wherever it already
    does (a rewrite may give early nodes an input that it inserted later)."""
    order: list[Node] = []
    done: set[Node] = set()
    for root in graph.nodes:
        if root in done:
            continue
        stack = [(root, iter(root.all_input_nodes))]
        active = {root}
        while stack:
            node, inputs = stack[-1]
            nxt = next((i for i in inputs if i not in done), None)
            if nxt is None:
                stack.pop()
                active.discard(node)
                done.add(node)
                order.append(node)
            elif nxt in active:
                raise RuntimeError(f"graph has a cycle through {nxt.name}")
            else:
                active.add(nxt)
                stack.append((nxt, iter(nxt.all_input_nodes)))
    for prev, node in zip(order, order[1:]):
        if prev.next is not node:
            prev.append(node)


def users_outside(node: Node, allowed: Iterable[Node]) -> list[Node]:
    allowed = set(allowed)
    return [u for u in node.users if u not in allowed]


def single_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def render(graph: fx.Graph, nodes: Optional[set[Node]] = None) -> str:
    """Readable Python for the graph, or for a subset of its nodes (inputs from outside become arguments)."""
    if nodes is None:
        return graph.python_code("self").src
    sub = fx.Graph()
    env: dict[Node, Node] = {}
    body = [n for n in graph.nodes if n in nodes and n.op not in ("placeholder", "output")]
    for n in body:  # inputs from outside the subset first: placeholders must precede the body
        for inp in n.all_input_nodes:
            if inp not in env and (inp not in nodes or inp.op == "placeholder"):
                env[inp] = sub.placeholder(inp.name)
    outputs = []
    for n in body:
        env[n] = sub.node_copy(n, lambda x: env[x])
        if any(u not in nodes or u.op == "output" for u in n.users):
            outputs.append(env[n])
    sub.output(tuple(outputs))
    return sub.python_code("self").src


def flat_like(t: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous tensor of ``shape`` with t's dtype and device that holds no memory: what the rewrite's
    reshape gives the fused op, for the kernel tuner, which reads shapes, strides, dtype and device (it
    measures on CUDA only: a meta tensor here would make every dispatch "not measured"). t is a node's
    example value, a FakeTensor, whose fake mode makes the new one; anything else gives a meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return t.new_empty(shape)
    return torch.empty(shape, dtype=t.dtype, device="meta")
