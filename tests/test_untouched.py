"""Untouched means untouched (issue 16): where no fusion takes a norm, fusenorm's compile is plain Inductor's.

Every norm form is recognized at the pre-grad stage, but one that no fusion would take goes back as written
(patterns/prospects.py), so the graph Inductor compiles is the one it would compile without fusenorm: outputs
and gradients equal plain Inductor's bit for bit, no fusenorm op is left, and the report says why each norm was
left alone.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fusenorm_inductor
from fusenorm_inductor import config

from .models import Norm, PostNormBlock
from .test_contract import fusenorm_ops_run
from .test_norm_forms import GemmaNorm, ManualLN, T5Norm

FORMS = {
    "nn.LayerNorm": lambda: Norm("nn.LayerNorm", 24),
    "nn.RMSNorm": lambda: Norm("nn.RMSNorm", 24),
    "F.layer_norm-no-affine": lambda: Norm("F.layer_norm", 24, affine=False),
    "llama": lambda: Norm("llama", 24),
    "t5": lambda: T5Norm(24),
    "gemma": lambda: GemmaNorm(24),
    "manual-ln": lambda: ManualLN(24),
}


class Unfusable(nn.Module):
    """Norms with no GEMM partner: between elementwise ops, one feeding a linear through a scale (pre-norm needs
    the linear to read the norm's output itself), one after a linear whose output is also returned."""

    def __init__(self, make):
        super().__init__()
        self.a, self.b, self.c = make(), make(), make()
        self.lin1, self.lin2 = nn.Linear(24, 24), nn.Linear(24, 24)

    def forward(self, x):
        h = self.a(torch.tanh(x))
        g = self.lin1(self.b(h) * 2.0)
        z = self.lin2(g)
        return torch.sigmoid(self.c(z)) + z


def _step(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype))
    return [out.detach()] + [p.grad for p in model.parameters()] + [x.grad]


def assert_bitwise_inductor(make, x, **patch):
    torch.manual_seed(0)
    model = make()
    with config.patch(patch):
        got = _step(torch.compile(copy.deepcopy(model), backend="fusenorm", dynamic=False), x)
        ran = fusenorm_ops_run(lambda: _step(torch.compile(copy.deepcopy(model), backend="fusenorm", dynamic=False),
                                             x))
    rep = fusenorm_inductor.last_report()
    torch._dynamo.reset()
    plain = _step(torch.compile(copy.deepcopy(model), backend="inductor", dynamic=False), x)
    for i, (p, g) in enumerate(zip(plain, got)):
        assert p.dtype == g.dtype and torch.equal(p, g), f"result {i} differs from plain Inductor's"
    assert ran == set(), ran
    return rep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_unfusable_norms_compile_as_plain_inductor(form, dtype):
    make = FORMS[form]
    rep = assert_bitwise_inductor(lambda: Unfusable(make).to(dtype), torch.randn(5, 7, 24, dtype=dtype))
    assert not [k for k in counters["fusenorm"] if counters["fusenorm"][k]], dict(counters["fusenorm"])
    left = [s for s in rep.skips if s.pattern == "norm_prospects"]
    assert len(left) == 3 and all("no fusion would take it" in s.reason for s in left), left
    # Each forward fusion's reason is in the report under its own name, as for a norm the joint stage declines.
    post = [s.reason for s in rep.skips if s.pattern == "linear_norm_fwd"]
    assert any("has another user" in r for r in post) and any("not a linear's output" in r for r in post), post


def test_disabled_patterns_compile_as_plain_inductor():
    """With every fusion switched off, a block that would fuse is compiled as plain Inductor compiles it."""
    off = {"patterns.linear_norm_fwd": False, "patterns.norm_linear_fwd": False, "patterns.dgrad_norm_bwd": False,
           "patterns.deferred_norm": False}
    rep = assert_bitwise_inductor(lambda: PostNormBlock(16, 24), torch.randn(5, 7, 16), **off)
    assert any("disabled by config" in s.reason for s in rep.skips if s.pattern == "norm_prospects")


def test_inference_without_partner_is_untouched():
    """Under no_grad a norm feeding only an elementwise op goes back as written (no backward to fuse either)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.LayerNorm(24), nn.Tanh())
    x = torch.randn(33, 16)
    with torch.no_grad():
        got = torch.compile(copy.deepcopy(model), backend="fusenorm", dynamic=False)(x)
        torch._dynamo.reset()
        plain = torch.compile(copy.deepcopy(model), backend="inductor", dynamic=False)(x)
    assert torch.equal(got, plain)
    assert dict(counters["fusenorm"]) == {}
