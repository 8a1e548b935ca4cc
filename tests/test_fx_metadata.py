"""Example values (meta['val']) after a rewrite (issue 16): fx_utils.refresh_values recomputes them with
Inductor's FakeTensorUpdater, and a node it cannot refresh fails the pass (the graph then falls back whole)
instead of handing a stale value to the partitioner."""

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import fusenorm_inductor
from fusenorm_inductor import config, fx_utils

from .models import PostNormBlock, assert_matches_eager, fusenorm_counts

aten = torch.ops.aten


def _model(x, w, b):
    y = torch.mm(x, w)
    z = y.view(-1)  # a view of y: after the rewrite it must alias the new tensor
    return z.sum(0), z, b.relu()  # b.relu(): a branch no rewrite touches


def _inputs():
    torch.manual_seed(0)
    return torch.randn(3, 4), torch.randn(4, 5), torch.randn(7)


def _traced(owned: bool) -> fx.Graph:
    gm = make_fx(_model, tracing_mode="fake")(*_inputs())
    if owned:
        return gm.graph
    bare = fx.Graph()  # a graph no GraphModule owns (values copied with the nodes)
    bare.output(bare.graph_copy(gm.graph, {}))
    return bare


def _node(graph: fx.Graph, target) -> fx.Node:
    return next(n for n in graph.nodes if n.target is target)


def _run(graph: fx.Graph, inputs) -> dict:
    """Each node's real output."""
    gm = fx.GraphModule(torch.nn.Module(), graph)
    outs = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            outs[n.name] = super().run_node(n)
            return outs[n.name]

    Recorder(gm).run(*inputs)
    return outs


def _rewrite_widen_to_double(graph: fx.Graph) -> fx.Node:
    """mm -> cat([mm, mm], 1).to(float64): every user of mm now gets twice the columns and another dtype."""
    mm = _node(graph, aten.mm.default)
    with graph.inserting_after(mm):
        cat = graph.call_function(aten.cat.default, ([mm, mm], 1))
    with graph.inserting_after(cat):
        wide = graph.call_function(aten._to_copy.default, (cat,), {"dtype": torch.float64})
    mm.replace_all_uses_with(wide, delete_user_cb=lambda u: u is not cat)
    return wide


@pytest.mark.parametrize("owned", [True, False], ids=["graph_module", "bare_graph"])
def test_refreshed_values_match_execution(owned):
    graph = _traced(owned)
    relu = _node(graph, aten.relu.default)
    untouched = {n: n.meta["val"] for n in graph.nodes if n.op == "placeholder" or n is relu}
    before = fx_utils.snapshot(graph)
    wide = _rewrite_widen_to_double(graph)
    graph.lint()
    assert fx_utils.refresh_values(graph, before) > 0

    real = _run(graph, _inputs())
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        v, r = n.meta["val"], real[n.name]
        assert isinstance(v, torch.Tensor) and isinstance(r, torch.Tensor), n.format_node()
        assert (tuple(v.shape), v.dtype, tuple(v.stride()), v.device) == (
            tuple(r.shape), r.dtype, tuple(r.stride()), r.device), n.format_node()
    view = _node(graph, aten.view.default)
    assert view.meta["val"].shape == (30,) and view.meta["val"].dtype == torch.float64
    assert _node(graph, aten.sum.dim_IntList).meta["val"].dtype == torch.float64
    # The view's value aliases the new tensor it views (AOTAutograd reads aliasing from these values).
    assert view.meta["val"].untyped_storage()._cdata == wide.meta["val"].untyped_storage()._cdata
    # Nodes the rewrite did not reach keep their values, the very objects.
    assert all(n.meta["val"] is v for n, v in untouched.items())


def test_no_rewrite_refreshes_nothing():
    graph = _traced(True)
    vals = {n: n.meta.get("val") for n in graph.nodes}
    before = fx_utils.snapshot(graph)
    assert fx_utils.refresh_values(graph, before) == 0
    assert all(n.meta.get("val") is v for n, v in vals.items())


def test_op_that_cannot_run_fails_the_refresh():
    graph = _traced(True)
    before = fx_utils.snapshot(graph)
    mm = _node(graph, aten.mm.default)
    x = mm.args[0]
    mm.args = (x, x)  # [3, 4] @ [3, 4]: the op raises on the values
    graph.lint()
    with pytest.raises(fx_utils.StaleValueError, match="recomputing the example values"):
        fx_utils.refresh_values(graph, before)


def test_input_without_value_fails_the_refresh():
    graph = _traced(True)
    before = fx_utils.snapshot(graph)
    mm = _node(graph, aten.mm.default)
    x = mm.args[0]
    with graph.inserting_before(mm):
        x2 = graph.call_function(aten.clone.default, (x,))
    x.meta.pop("val")  # torch 2.11's updater skips a node whose input has no value; later ones run it on None
    mm.replace_input_with(x, x2)
    graph.lint()
    with pytest.raises(fx_utils.StaleValueError):
        fx_utils.refresh_values(graph, before)


def _lowered(t):
    return t * 2


_lowered._inductor_lowering_function = True  # the updater does not run such targets (2.11: nor non-OpOverloads)


def test_node_the_updater_skips_fails_the_refresh():
    graph = _traced(True)
    before = fx_utils.snapshot(graph)
    mm = _node(graph, aten.mm.default)
    with graph.inserting_after(mm):
        graph.call_function(_lowered, (mm,))  # no user: nothing downstream would trip over its missing value
    graph.lint()
    with pytest.raises(fx_utils.StaleValueError, match="no example value could be computed"):
        fx_utils.refresh_values(graph, before)


def _first_placeholder_2d(graph: fx.Graph) -> fx.Node:
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] != v.shape[1]:
            return n
    raise AssertionError("no 2-D non-square input")


def _break_refresh_after_rewrite(monkeypatch):
    """LinearNormFwd's rewrite, then a node whose value cannot be computed (mm of a non-square input
    with itself): the rewrite and lint succeed, the refresh fails."""
    from fusenorm_inductor.patterns import post_norm

    rewrite = post_norm.LinearNormFwd.rewrite

    def broken(self, graph, m, rep):
        rewrite(self, graph, m, rep)
        a = _first_placeholder_2d(graph)
        with graph.inserting_after(a):
            graph.call_function(aten.mm.default, (a, a))

    monkeypatch.setattr(post_norm.LinearNormFwd, "rewrite", broken)


def test_refresh_failure_falls_back_whole_through_the_plugin(monkeypatch):
    _break_refresh_after_rewrite(monkeypatch)
    x = torch.randn(9, 24)
    with config.patch(fallback_on_error=True), pytest.warns(UserWarning, match="recomputing the example values"):
        assert_matches_eager(lambda: PostNormBlock(24, 40), (x,), torch.float32, "cpu")
    assert fusenorm_counts() == {}  # the restored graph holds no rewrite
    rep = fusenorm_inductor.last_report()
    assert rep.errors and "StaleValueError" in rep.errors[0]
    assert not [r for r in rep.rewrites if r.stage == "joint"]


def test_refresh_failure_raises_without_fallback(monkeypatch):
    _break_refresh_after_rewrite(monkeypatch)
    x = torch.randn(9, 24)
    with config.patch(fallback_on_error=False), pytest.raises(Exception, match="recomputing the example values"):
        assert_matches_eager(lambda: PostNormBlock(24, 40), (x,), torch.float32, "cpu")


def test_updater_constructor_matches_installed_torch():
    """torch 2.11 builds FakeTensorUpdater from the fx.Graph, later versions from its GraphModule."""
    import inspect

    from torch._inductor.fx_utils import FakeTensorUpdater

    graph = _traced(True)
    updater = fx_utils._fake_tensor_updater(graph)
    first = list(inspect.signature(FakeTensorUpdater.__init__).parameters)[1]
    held = getattr(updater, "graph", None) if first == "graph" else getattr(updater, "gm").graph
    assert held is graph
    assert not any(fx_utils.snapshot(graph).touched(n) for n in graph.nodes)
