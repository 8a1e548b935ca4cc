"""The pre-grad stage's verdict on a graph it left as traced is kept (fusenorm_inductor/pregrad_memo.py): a
second compile of the same graph replays the report instead of running the stage; a graph the stage changed,
another graph, or decisions not from the table run the stage every time.

The memo serves CUDA graphs in the default mode only; here the CPU graph is presented as a CUDA one (the
device the key is made for, and that device's name), while the stage itself runs on the CPU references."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn

import fusenorm_inductor as fi
from fusenorm_inductor import config, pregrad_memo
from fusenorm_inductor import patterns as patterns_pkg


class NoFusion(nn.Module):
    """A LayerNorm no fusion takes (no GEMM beside it): the stage puts it back as traced."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(40)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(x * 2.0))


class Fusable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(24, 40), nn.LayerNorm(40)

    def forward(self, x):
        return self.norm(self.lin(x))


@pytest.fixture
def as_cuda(monkeypatch, tmp_path):
    """Decisions from the table for a graph presented as on an H100; the memo file in a fresh directory."""
    monkeypatch.setattr(pregrad_memo, "_device", lambda graph: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    pregrad_memo.clear()
    runs = []
    real = patterns_pkg.run_stage

    def counting(stage, graph, rep):
        runs.append(stage)
        return real(stage, graph, rep)

    monkeypatch.setattr(patterns_pkg, "run_stage", counting)
    with config.patch({"tuning.measure": None, "tuning.cache_dir": str(tmp_path)}):
        yield runs
    pregrad_memo.clear()


def _compile(model, x):
    torch._dynamo.reset()
    fi.report.clear()
    out = torch.compile(model, backend="fusenorm", dynamic=False)(x)
    return out, fi.reports()


def test_a_graph_left_as_traced_is_not_analysed_again(as_cuda):
    torch.manual_seed(0)
    model, x = NoFusion(), torch.randn(3, 9, 40)
    ref = model(x)
    out1, reps1 = _compile(model, x)
    assert as_cuda.count("pre_grad") == 1
    skips1 = [(s.pattern, s.stage, s.node, s.reason) for r in reps1 for s in r.skips]
    assert any(p == "norm_prospects" for p, *_ in skips1), skips1  # the stage looked at the norm
    pregrad_memo.clear()  # a new process: the file answers
    out2, reps2 = _compile(model, x)
    assert as_cuda.count("pre_grad") == 1, "the kept verdict did not spare the stage"
    skips2 = [(s.pattern, s.stage, s.node, s.reason) for r in reps2 for s in r.skips]
    assert skips2 == skips1
    torch.testing.assert_close(out2, ref)
    torch.testing.assert_close(out1, ref)


def test_another_shape_is_another_graph(as_cuda):
    model = NoFusion()
    _compile(model, torch.randn(3, 9, 40))
    _compile(model, torch.randn(5, 40))
    assert as_cuda.count("pre_grad") == 2


def test_a_changed_graph_is_not_kept(as_cuda):
    torch.manual_seed(0)
    model, x = Fusable(), torch.randn(7, 24)
    _, reps = _compile(model, x)
    assert any(r.rewrites for r in reps), "nothing fused: a blind test"
    _compile(model, x)
    assert as_cuda.count("pre_grad") == 2


def test_measured_decisions_are_not_kept(as_cuda):
    model, x = NoFusion(), torch.randn(3, 9, 40)
    with config.patch({"tuning.measure": False}):
        _compile(model, x)
        _compile(model, x)
    assert as_cuda.count("pre_grad") == 2


def test_structure_names_no_object_address():
    def f(x, w):
        return torch.nn.functional.layer_norm(torch.sin(x), (40,), w)

    text = pregrad_memo.structure(torch.fx.symbolic_trace(f).graph)
    assert not re.search(r"0x[0-9a-f]{4,}", text) and "torch.nn.functional.layer_norm" in text, text


def test_a_malformed_file_entry_is_ignored(as_cuda, tmp_path):
    model, x = NoFusion(), torch.randn(3, 9, 40)
    _compile(model, x)
    path = pregrad_memo._file()
    data = json.loads(open(path).read())
    assert len(data) == 1
    data = {k: {"skips": [["only", "three", 3]]} for k in data}
    open(path, "w").write(json.dumps(data))
    pregrad_memo.clear()
    _compile(model, x)
    assert as_cuda.count("pre_grad") == 2


def test_a_changed_tuning_cache_is_another_key(as_cuda):
    """A measured entry in the tuning cache decides before the table: new content, the stage runs again."""
    from fusenorm_inductor.tuning import measure

    model, x = NoFusion(), torch.randn(3, 9, 40)
    _compile(model, x)
    path = measure._cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"an entry": {"t_fused_ms": 1.0}}))
    _compile(model, x)
    assert as_cuda.count("pre_grad") == 2
    _compile(model, x)
    assert as_cuda.count("pre_grad") == 2


def test_cuda_graphs_or_not_is_another_key(as_cuda):
    """Host time counts in a decision only without CUDA graphs: a verdict reached with it is not reused under
    mode="reduce-overhead"."""
    import torch._inductor.config as inductor_config

    gm = torch.fx.symbolic_trace(NoFusion())
    uuid = ("pre_grad", "sources", "config")
    with inductor_config.patch({"triton.cudagraphs": True}):
        with_graphs = pregrad_memo.key(gm.graph, uuid)
    with inductor_config.patch({"triton.cudagraphs": False}):
        without = pregrad_memo.key(gm.graph, uuid)
    assert with_graphs is not None and without not in (None, with_graphs)


def test_nothing_is_kept_where_ranks_agree_through_collectives(as_cuda, monkeypatch):
    from fusenorm_inductor.tuning import measure

    monkeypatch.setattr(measure, "_ranks", lambda: (1, 2))
    model, x = NoFusion(), torch.randn(3, 9, 40)
    _compile(model, x)
    _compile(model, x)
    assert as_cuda.count("pre_grad") == 2


def test_a_dynamic_graph_is_not_kept():
    """Symbolic sizes: the decisions are made at the traced example's sizes, which the structure does not show;
    the same graph with static sizes on one CUDA device is kept (fake CUDA tensors: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    dynamic = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(5, 40))
    symbolic = [n.meta["val"] for n in dynamic.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert symbolic and not any(pregrad_memo.static_sizes(t) for t in symbolic)
    assert pregrad_memo.static_sizes(torch.empty(5, 40))
    static = make_fx(lambda x: x * 2)(torch.randn(5, 40))
    with FakeTensorMode():
        for node in static.graph.nodes:
            if node.op != "output":
                node.meta["val"] = torch.empty(5, 40, device="cuda")
    assert pregrad_memo._device(static.graph) == torch.device("cuda", 0)
