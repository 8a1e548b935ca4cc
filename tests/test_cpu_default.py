"""On the CPU, by default, fusenorm compiles a graph exactly as plain Inductor does (its fused ops have only
reference implementations there, slower than Inductor's code); the match report says what would be rewritten on
a GPU. ``config.cpu_reference`` (set for the rest of the tests by conftest.py) runs the rewrites and their
references instead."""

from __future__ import annotations

import difflib

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fusenorm_inductor as fi
from fusenorm_inductor import config
from fusenorm_inductor.passes import CPU_NOTE

from .models import PostNormBlock
from .test_untouched_code import _code_lines, _compiled

MODELS = {
    "post_norm": lambda: PostNormBlock(24, 40),
    "mlp": lambda: nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 40), nn.RMSNorm(40),
                                 nn.Linear(40, 8)),
}


def _inputs(name):
    return torch.randn(3, 9, 24)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_cpu_graph_is_inductors_by_default(name, train):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = _inputs(name)
    with config.patch(cpu_reference=True):  # the same model does fuse where the references are allowed
        _compiled(model, "fusenorm", x, train)
        assert fi.reports() and any(r.rewrites for r in fi.reports()), "the model fuses nothing: a blind test"
    fi.report.clear()
    counters.clear()
    with config.patch(cpu_reference=False):
        ours, ours_code = _compiled(model, "fusenorm", x, train)
        reps = fi.reports()
    plain, plain_code = _compiled(model, "inductor", x, train)
    assert len(ours_code) == len(plain_code)
    for i, (got, want) in enumerate(zip(ours_code, plain_code)):
        got, want = _code_lines(got), _code_lines(want)
        diff = "\n".join(list(difflib.unified_diff(want, got, "inductor", "fusenorm", lineterm="", n=1))[:40])
        assert got == want, f"graph {i}'s code differs from plain Inductor's:\n{diff}"
    for i, (g, p) in enumerate(zip(ours, plain)):
        assert torch.equal(g, p), f"result {i} differs from plain Inductor's"
    assert not [k for k, v in counters["fusenorm"].items() if v], dict(counters["fusenorm"])
    assert reps and all(not r.rewrites for r in reps)
    first = reps[0]
    assert CPU_NOTE in first.notes and first.on_gpu, first.to_markdown()
    assert "## Would be rewritten on a GPU" in first.to_markdown()


def test_cpu_reference_on_runs_the_rewrites():
    torch.manual_seed(0)
    model = MODELS["post_norm"]()
    x = _inputs("post_norm")
    with config.patch(cpu_reference=True):
        out = torch.compile(model, backend="fusenorm")(x)
        rep = fi.last_report()
    assert rep.rewrites and not rep.on_gpu and CPU_NOTE not in rep.notes
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
