"""Compiled graphs call the fused ops straight into their launchers (fusenorm_inductor/graph_calls.py): the
generated code names ``extern_kernels.fusenorm_<op>`` instead of ``torch.ops.fusenorm.<op>``, the results match
eager, and a graph whose lowering cannot take the direct call keeps the op."""

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import fusenorm_inductor  # noqa: F401
from fusenorm_inductor import graph_calls

from .models import PostNormBlock, fusenorm_counts
from .test_pre_norm import PreNormBlock


def _compiled_code(model, x):
    compiled = torch.compile(model, backend="fusenorm", dynamic=False)
    out, code = run_and_get_code(lambda: compiled(x).float().sum().backward())
    return "\n".join(code)


def _calls(code: str) -> set:
    ops = set()
    for name in graph_calls._OPS:
        if f"extern_kernels.{graph_calls.call_name(name)}(" in code:
            ops.add(name)
        assert f"torch.ops.fusenorm.{name}.default(" not in code, f"{name} still called through the dispatcher"
    return ops


@pytest.mark.parametrize("model,ops", [
    (lambda: PostNormBlock(40, 48, "nn.LayerNorm", residual=None), {"mm_norm", "mm_norm_backward"}),
    (lambda: PreNormBlock(40, 24, "nn.RMSNorm"), {"norm_mm", "mm_normed", "mm_norm_backward"}),
], ids=["post-norm", "pre-norm"])
def test_generated_code_calls_the_launchers(model, ops, device):
    torch.manual_seed(0)
    m = model().to(device)
    x = torch.randn(257, 40, device=device, requires_grad=True)
    ref = m(x)
    ref.float().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    code = _compiled_code(m, x)
    assert sum(fusenorm_counts().values()) >= 2
    assert _calls(code) == ops
    got = [x.grad] + [p.grad for p in m.parameters()]
    for g, r in zip(got, grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_direct_call_matches_the_op(device):
    torch.manual_seed(0)
    a, b = torch.randn(33, 40, device=device), torch.randn(40, 24, device=device)
    w, nb = torch.randn(24, device=device), torch.randn(24, device=device)
    from torch._inductor.select_algorithm import extern_kernels

    graph_calls.install()
    direct = getattr(extern_kernels, graph_calls.call_name("mm_norm"))
    args = (a, b, None, None, w, nb, 1e-5, False, torch.float32, True)
    for got, want in zip(direct(*args), torch.ops.fusenorm.mm_norm.default(*args)):
        torch.testing.assert_close(got, want)


def test_cpp_wrapper_keeps_the_op(monkeypatch):
    """Where the generated code is not Python, the lowering leaves the kernel name alone."""
    monkeypatch.setattr(graph_calls, "_python_wrapper", lambda: False)
    code = _compiled_code(PostNormBlock(40, 48, "nn.LayerNorm").to("cpu"), torch.randn(21, 40, requires_grad=True))
    assert "torch.ops.fusenorm.mm_norm.default(" in code
    assert f"extern_kernels.{graph_calls.call_name('mm_norm')}(" not in code


def test_install_is_idempotent():
    from torch._inductor import lowering

    graph_calls.install()
    op = torch.ops.fusenorm.mm_norm.default
    first = lowering.lowerings[op]
    graph_calls._installed.clear()
    graph_calls.install()
    assert lowering.lowerings[op] is first  # not wrapped twice
    assert getattr(first, "_is_fallback_handler", False)


class _OnCuda:
    is_cuda = True


def _stub_cuda_kernel(*args):
    return "ran"


def test_profiler_names_the_direct_cuda_call(monkeypatch):
    """Tests and users find fused ops in a profile by name; the direct CUDA call keeps that name."""
    monkeypatch.setitem(graph_calls._OPS, "mm_norm", _stub_cuda_kernel)
    call = graph_calls._direct("mm_norm")
    assert call(_OnCuda()) == "ran"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert call(_OnCuda()) == "ran"
    assert "fusenorm::mm_norm" in {e.name for e in prof.events()}


def test_active_only_where_graphs_call_directly():
    """The decision counts the direct call's host cost only where graphs make it: the Python wrapper, after
    install succeeded."""
    import torch._inductor.config as inductor_config

    graph_calls.install()
    assert graph_calls.active()
    with inductor_config.patch({"cpp_wrapper": True}):
        assert not graph_calls.active()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decision_counts_the_cheaper_direct_call(monkeypatch):
    """The host cost the decision adds around a fused launch: the direct graph call's (wrapper, plan lookup,
    output checks) is below the dispatcher's round trip, and both are measured (not zero)."""
    from fusenorm_inductor.tuning import measure

    graph_calls.install()
    direct = measure._call_overhead_us()
    monkeypatch.setattr(graph_calls, "active", lambda: False)
    dispatched = measure._call_overhead_us()
    assert 0 < direct < dispatched, (direct, dispatched)
