"""Where nothing fuses, Inductor's generated code under fusenorm is the code it generates without fusenorm.

Models whose norms no fusion takes are compiled twice in one process, under ``backend="fusenorm"`` and
``backend="inductor"``, forward and backward, on the CPU and (where present) on CUDA; the output code of each
graph must be the same text once comments are set aside (they name FX nodes and compile ids, which differ
between two compiles of one model), and the results equal bit for bit.
"""

from __future__ import annotations

import copy
import difflib

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from .test_norm_forms import GemmaNorm
from .test_untouched import FORMS, Unfusable

# bf16 on the CPU too: its casts around the norm are where a put-back norm's order showed.
DEVICES = ["cpu-float32", "cpu-bfloat16",
           pytest.param("cuda-bfloat16", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _code_lines(code: str) -> list[str]:
    """The output code without comment lines (``# Topologically Sorted Source Nodes: [layer_norm_3, ...]``,
    ``# AOT ID``, kernel paths): what runs."""
    return [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _compiled(model: nn.Module, backend: str, x: torch.Tensor, train: bool):
    """(results, output code of every graph) of one step of ``model`` compiled afresh with ``backend``."""
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=backend, dynamic=False)

    def step():
        if not train:
            with torch.no_grad():
                return [compiled(x)]
        xi = x.detach().clone().requires_grad_()
        out = compiled(xi)
        out.backward(torch.ones_like(out))
        return [out.detach(), xi.grad, *(p.grad for p in compiled.parameters())]

    results, codes = run_and_get_code(step)
    return results, codes


MODELS = {
    "layer_norm": lambda: Unfusable(FORMS["nn.LayerNorm"]),
    "llama_rms": lambda: Unfusable(FORMS["llama"]),
    "gemma": lambda: Unfusable(lambda: GemmaNorm(24)),
    "inference": lambda: nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.LayerNorm(40), nn.Tanh()),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_nothing_fused_means_inductors_code(name, device, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    train = name != "inference"
    device, dtype = device.split("-")
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    model = MODELS[name]().to(device=device, dtype=dtype)
    x = torch.randn(5, 7, 24, device=device, dtype=dtype)
    ours, ours_code = _compiled(model, "fusenorm", x, train)
    assert not [k for k, v in counters["fusenorm"].items() if v and not k.startswith("canonical")], \
        dict(counters["fusenorm"])
    plain, plain_code = _compiled(model, "inductor", x, train)
    assert len(ours_code) == len(plain_code) == (2 if train else 1)
    for i, (got, want) in enumerate(zip(ours_code, plain_code)):
        got, want = _code_lines(got), _code_lines(want)
        diff = "\n".join(list(difflib.unified_diff(want, got, "inductor", "fusenorm", lineterm="", n=1))[:40])
        assert got == want, f"graph {i}'s code differs from plain Inductor's:\n{diff}"
    for i, (g, p) in enumerate(zip(ours, plain)):
        assert g.dtype == p.dtype and torch.equal(g, p), f"result {i} differs from plain Inductor's"


def test_the_comparison_sees_a_change():
    """The code comparison is not blind: two models that differ in one op give different code lines."""
    x = torch.randn(5, 24)
    _, a = _compiled(nn.Sequential(nn.Linear(24, 24), nn.Tanh()), "inductor", x, False)
    _, b = _compiled(nn.Sequential(nn.Linear(24, 24), nn.Sigmoid()), "inductor", x, False)
    assert _code_lines(a[0]) != _code_lines(b[0])
