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


def static_width(*tensors: Any) -> bool:
    """True when the last dim of every given example value is a plain int: what the fusions need static
    (the norm's width, a GEMM's K and N); the leading dims (M) may be symbolic (dynamic shapes)."""
    return all(not isinstance(t, torch.Tensor) or (t.dim() > 0 and as_int(t.shape[-1]) is not None) for t in tensors)


def as_int(s: Any) -> Optional[int]:
    """A size as an int: plain, or symbolic but fixed by the shape environment (Dynamo traces every dim of a
    ``dynamic=True`` input symbolic, then a linear's weight pins its last dim); None when it is free."""
    if isinstance(s, torch.SymInt):
        return s.node.maybe_as_int()
    return s if isinstance(s, int) else None


def hint(s: Any) -> Any:
    """A symbolic size's value in the example that was traced (its size hint); plain ints pass through."""
    if as_int(s) is not None:
        return as_int(s)
    if isinstance(s, torch.SymInt):
        node = s.node
        h = getattr(node, "hint", None)
        return int(h) if h is not None else int(node.shape_env.size_hint(node.expr))
    return s


def shape_args(graph: fx.Graph, shape: Sequence[Any]) -> list:
    """``shape`` as the size argument of a view inserted at the insertion point: ints stay, each symbolic size
    becomes a graph value that computes it (a SymInt input of that expression, or ``sym_size`` of an input
    tensor with it at some dim); with one size left that no input gives, -1 stands in for it. Raises
    ValueError when that is not enough (more than one such size)."""
    out: list = []
    missing = 0
    sources = None
    for d in shape:
        if as_int(d) is not None:
            out.append(as_int(d))
            continue
        if sources is None:
            sources = _size_sources(graph)
        src = sources.get(d.node.expr)
        if src is None:
            missing += 1
            out.append(-1)
        elif isinstance(src, Node):
            out.append(src)
        else:
            node, dim = src
            out.append(call(graph, aten.sym_size.int, node, dim))
    if missing > 1:
        raise ValueError(f"cannot express the symbolic shape {list(shape)} from the graph's inputs")
    return out


def _size_sources(graph: fx.Graph) -> dict:
    """symbolic expression -> a SymInt placeholder, or (tensor placeholder, dim), for the graph's inputs."""
    found: dict = {}
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        v = val(n)
        if isinstance(v, torch.SymInt):
            found.setdefault(v.node.expr, n)
        elif isinstance(v, torch.Tensor):
            for i, d in enumerate(v.shape):
                if isinstance(d, torch.SymInt):
                    found.setdefault(d.node.expr, (n, i))
    return found


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


class ValueSnapshot:
    """The state of a graph before a rewrite, from which ``refresh_values`` finds the nodes the rewrite
    created or rewired: Inductor's ``FakeTensorUpdater`` (its node hashes: target, args and kwargs, which FX
    replaces on any change), made when the snapshot is taken, and each node's (target, args, kwargs)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.nodes = {n: (n.target, n.args, n.kwargs) for n in graph.nodes}
        self.updater = _fake_tensor_updater(graph)

    def touched(self, node: Node) -> bool:
        """Whether the rewrite created this node or changed what it computes from what."""
        u = self.updater
        if hasattr(u, "hash_node") and hasattr(u, "processed_hashes"):
            return u.hash_node(node) not in u.processed_hashes
        old = self.nodes.get(node)
        return old is None or old[0] is not node.target or old[1] is not node.args or old[2] is not node.kwargs


class _GraphHolder(torch.nn.Module):
    """A module that only holds ``graph``: what FakeTensorUpdater reads of a GraphModule, for a graph that
    has none (built by hand, in tests)."""

    def __init__(self, graph: fx.Graph) -> None:
        super().__init__()
        self.graph = graph


def _fake_tensor_updater(graph: fx.Graph):
    """Inductor's FakeTensorUpdater for the graph. torch 2.11 takes the fx.Graph, later versions the
    GraphModule that owns it (to update subgraphs too): the parameter's name tells which."""
    import inspect

    from torch._inductor.fx_utils import FakeTensorUpdater

    # torch 2.11's updater reads torch._inductor.fx_passes.reinplace as an attribute: make sure it is loaded
    # (compile_fx loads it through post_grad; a graph refreshed outside a compile may come first).
    import torch._inductor.fx_passes.reinplace  # noqa: F401

    params = list(inspect.signature(FakeTensorUpdater.__init__).parameters)[1:]
    if params and params[0] == "graph":
        return FakeTensorUpdater(graph)
    gm = graph.owning_module
    if gm is None or getattr(gm, "graph", None) is not graph:
        gm = _GraphHolder(graph)
    return FakeTensorUpdater(gm)


def snapshot(graph: fx.Graph) -> ValueSnapshot:
    """Take before a rewrite what ``refresh_values`` needs after it (see ValueSnapshot)."""
    return ValueSnapshot(graph)


class StaleValueError(RuntimeError):
    """A node's example value could not be recomputed after a rewrite: the pass must fail (the graph falls
    back whole) rather than hand a stale value to the partitioner."""


def refresh_values(graph: fx.Graph, before: ValueSnapshot) -> int:
    """Recompute the example values (meta['val']) of the nodes a rewrite created or rewired, and of
    everything downstream, with Inductor's FakeTensorUpdater (the machinery its own post-grad passes use:
    it runs each op on its inputs' fake tensors in the graph's fake mode and rebinds unbacked symbols).

    A rewrite gives the users of a replaced node a new input, but their values were computed from the old
    one; in particular a view of the old output does not share storage with the new one. AOTAutograd reads
    aliasing from these values: a tensor saved for the backward that (per the values) no user output aliases
    is donated to the backward, which may then overwrite it in place, and so overwrite the user's output that
    really is a view of it (seen with a norm decomposed back to aten ops whose output is returned through a
    reshape: the backward wrote over the returned tensor).

    The values to recompute are dropped first, so the updater must produce each of them anew: one it skips
    (an input without a value, a target it does not run) or one whose op raises raises StaleValueError
    here, and the pass fails instead of going on with stale metadata. Returns the number of nodes refreshed.
    Only graphs whose values are meta['val'] (AOT graphs; Dynamo's example_value graphs are traced again)."""
    from torch._inductor.virtualized import V

    mode = fake_mode_of(graph)
    if mode is None:  # no example values at all: nothing can be stale
        return 0
    if _meta_key(graph) != "val":
        raise StaleValueError("fusenorm: refresh_values needs a graph whose example values are meta['val']")
    roots = [n for n in graph.nodes if n.op == "call_function" and before.touched(n)]
    stale: dict[Node, None] = {}
    pending = list(roots)
    while pending:
        n = pending.pop()
        if n in stale or n.op != "call_function":
            continue
        stale[n] = None
        pending.extend(n.users)
    if not stale:
        return 0
    for n in stale:
        n.meta.pop("val", None)
    try:
        with V.set_fake_mode(mode):
            before.updater.incremental_update()
    except Exception as e:
        raise StaleValueError(
            f"fusenorm: recomputing the example values after the rewrite failed ({type(e).__name__}: {e})"
        ) from e
    missing = [n for n in graph.nodes if n in stale and "val" not in n.meta]
    if missing:
        names = ", ".join(n.format_node() for n in missing[:3])
        raise StaleValueError(
            f"fusenorm: no example value could be computed for {len(missing)} node(s) after the rewrite: {names}"
        )
    return len(stale)


def getitems(graph: fx.Graph, node: Node, count: int) -> list[Node]:
    return [call(graph, operator.getitem, node, i) for i in range(count)]


def reshape(graph: fx.Graph, node: Node, shape: Sequence[Any]) -> Node:
    """A view when the layout allows one (no copy), else a reshape. Symbolic sizes become graph values
    (``shape_args``)."""
    v = val(node)
    if same_shape(v.shape, shape):
        return node
    target = aten.view.default if v.is_contiguous() else aten.reshape.default
    return call(graph, target, node, shape_args(graph, shape))


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Shapes equal, symbolic sizes compared as expressions (no guard is added: a pass must not specialize)."""
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _same_size(a: Any, b: Any) -> bool:
    a, b = (x if as_int(x) is None else as_int(x) for x in (a, b))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


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


def dynamic_note(m: Any, measured: bool) -> str:
    """For the match report, where the rows are symbolic: what was decided for which M. ``measured``: whether
    the decision timed anything (on the CPU, or with tuning off, nothing was)."""
    if not isinstance(m, torch.SymInt):
        return ""
    if not measured:
        return f"; dynamic M = {m}: one decision for every M, not measured"
    from .tuning.measure import row_bucket

    h = hint(m)
    top = row_bucket(h)
    return (f"; dynamic M = {m}: decided as measured at M = {h}; launches with M in [{top // 2 + 1}, {top}] run the "
            f"configuration measured there, other M the kernels' first configuration (a launch never measures)")


def hinted(t: Any) -> Any:
    """An example value with symbolic sizes as a contiguous one at their hints (what a decision measures);
    anything static (or not a tensor) as is."""
    if not isinstance(t, torch.Tensor) or is_static(t):
        return t
    return flat_like(t, *t.shape)


def flat_like(t: torch.Tensor, *shape: Any, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A contiguous tensor of ``shape`` (symbolic sizes at their hints) with t's dtype (or ``dtype``) and
    device that holds no memory: what the
    rewrite's reshape gives the fused op, for the kernel tuner, which reads shapes, strides, dtype and device
    (it measures on CUDA only: a meta tensor here would make every dispatch "not measured"). t is a node's
    example value, a FakeTensor, whose fake mode makes the new one; anything else gives a meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    dtype = dtype or t.dtype
    shape = tuple(hint(d) for d in shape)  # a symbolic M: the traced example's (the decision's representative)
    if isinstance(t, FakeTensor):
        with torch.no_grad():
            return t.new_empty(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device="meta")
