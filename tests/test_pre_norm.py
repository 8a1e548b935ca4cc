"""norm -> linear(s): Lazy Pre-Norm. Every norm form feeding one or several linears is rewritten (exact
counts by pattern name), near-misses are not (and the report says why), compiled results match eager
(outputs and all gradients), and the fused graph saves less for the backward than the unfused one."""

import copy

import pytest
import torch
import torch.nn as nn

import fusenorm_inductor
from fusenorm_inductor import config

from .models import (
    NORM_FORMS, LinearNormStack, Norm, assert_matches_eager, fusenorm_counts, fwd_bwd, saved_bytes,
)

FUSED = {"norm_linear_fwd": 1, "dgrad_norm_bwd": 1}


def skips(pattern):
    return [s.reason for s in fusenorm_inductor.last_report().skips if s.pattern == pattern]


class PreNormBlock(nn.Module):
    """``norm -> linear`` x fan_out (q/k/v: 3, gate/up: 2), the consumers' outputs summed."""

    def __init__(self, k: int, n: int, form: str = "nn.LayerNorm", affine: bool = True, fan_out: int = 1,
                 linear_bias: bool = True):
        super().__init__()
        self.norm = Norm(form, k, affine)
        self.lins = nn.ModuleList(nn.Linear(k, n + 8 * i, bias=linear_bias) for i in range(fan_out))

    def forward(self, x):
        y = self.norm(x)
        return sum(lin(y).sum(-1, keepdim=True) * (i + 1) for i, lin in enumerate(self.lins)) + x.sum(-1, True)


@pytest.mark.parametrize("form", NORM_FORMS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_every_form_fused_3d(form, affine, device):
    x = torch.randn(3, 7, 40)  # 21 rows, K = 40, N = 24: no power of two anywhere
    assert_matches_eager(lambda: PreNormBlock(40, 24, form, affine), (x,), torch.float32, device)
    assert fusenorm_counts() == FUSED


@pytest.mark.parametrize("fan_out", [2, 3], ids=["gate-up", "qkv"])
@pytest.mark.parametrize("form", ["nn.LayerNorm", "nn.RMSNorm"])
def test_fan_out_fused_once(form, fan_out, device):
    """One rewrite for the norm, one fused GEMM per consumer; the backward's data gradient sums all of them."""
    x = torch.randn(257, 40)
    assert_matches_eager(lambda: PreNormBlock(40, 24, form, fan_out=fan_out, linear_bias=False), (x,),
                         torch.float32, device)
    assert fusenorm_counts() == FUSED
    rw = [r for r in fusenorm_inductor.last_report().rewrites if r.pattern == "norm_linear_fwd"]
    assert len(rw) == 1 and f"x{fan_out}" in rw[0].kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["nn.LayerNorm", "llama"])
def test_half_precision(form, dtype, device):
    assert_matches_eager(lambda: PreNormBlock(32, 48, form, fan_out=2), (torch.randn(5, 13, 32),), dtype, device)
    assert fusenorm_counts() == FUSED


def test_inference_no_grad(device):
    torch.manual_seed(0)
    m = PreNormBlock(32, 40, "nn.RMSNorm", fan_out=3).to(device)
    x = torch.randn(19, 32, device=device)
    with torch.no_grad():
        ref = m(x)
        got = torch.compile(m, backend="fusenorm")(x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert fusenorm_counts() == {"norm_linear_fwd": 1}


def test_saves_less_than_unfused(device):
    """The normalized tensor is not saved: x and the statistics are (the norm's backward needs them)."""
    make = lambda: PreNormBlock(64, 48, "nn.LayerNorm", fan_out=2)  # noqa: E731
    inputs = (torch.randn(4, 33, 64),)
    unfused, fused = saved_bytes(make, inputs, "inductor", device), saved_bytes(make, inputs, "fusenorm", device)
    y_bytes = 4 * 33 * 64 * 4
    assert fused <= unfused - y_bytes, (fused, unfused)


def test_large_mean_layernorm(device):
    """|mean| >> std (rows of 1000 + N(0, 1)): compiled is as accurate as eager fp32 against an fp64 reference
    (both are bounded by the rounding of x itself, ulp(1000) = 6e-5 of a unit-std row)."""
    torch.manual_seed(0)
    base = PreNormBlock(40, 24, "nn.LayerNorm", fan_out=2).to(device)
    with torch.no_grad():
        base.norm.impl.weight.uniform_(0.5, 1.5)
        base.norm.impl.bias.normal_()
    x = (1000.0 + torch.randn(65, 40)).to(device)
    ref = fwd_bwd(copy.deepcopy(base).double(), (x.double(),))
    eager = fwd_bwd(copy.deepcopy(base), (x,))
    m = copy.deepcopy(base)
    got = fwd_bwd(torch.compile(m, backend="fusenorm", dynamic=False), (x,))
    for r, e, g in zip([ref[0]] + ref[1], [eager[0]] + eager[1], [got[0]] + got[1]):
        scale = r.abs().max().item()
        err_e, err_g = ((e.double() - r).abs().max().item(), (g.double() - r).abs().max().item())
        assert err_g <= 2 * err_e + 2e-4 * scale, (err_g, err_e, scale)
    assert fusenorm_counts() == FUSED


def test_stack_each_norm_fused_once():
    """linear -> LN -> linear -> RMS -> linear, post-norm and deferral off: each norm goes to the linear after
    it (tests/test_deferred_norm.py has the stack with deferral on). On the CPU, where every pattern takes its
    match unmeasured: the order in which the patterns claim a norm, not what a GPU's timings decide (on CUDA
    fp32 operands are not the Gluon kernels', and the decisions are measured)."""
    device = "cpu"

    with config.patch({"patterns.linear_norm_fwd": False, "patterns.deferred_norm": False}):
        assert_matches_eager(LinearNormStack, (torch.randn(2, 11, 24),), torch.float32, device)
    assert fusenorm_counts() == {"norm_linear_fwd": 2, "dgrad_norm_bwd": 2}
    details = [r.detail for r in fusenorm_inductor.last_report().rewrites if r.pattern == "norm_linear_fwd"]
    assert len(details) == 2 and all("post-norm left it: pattern disabled" in d for d in details), details
    torch._dynamo.reset()
    # Post-norm off, deferral on: the producer linears write the statistics, the next linears apply them, and
    # the norms' backward is deferred too (no norm backward is left for the regrouped backward).
    with config.patch({"patterns.linear_norm_fwd": False}):
        assert_matches_eager(LinearNormStack, (torch.randn(2, 11, 24),), torch.float32, device)
    assert fusenorm_counts() == {"norm_linear_fwd": 2, "deferred_norm": 2, "dgrad_norm_bwd": 2}  # they accumulate
    torch._dynamo.reset()
    # Post-norm on (the default): it takes both norms first; pre-norm sees none of them.
    assert_matches_eager(LinearNormStack, (torch.randn(2, 11, 24),), torch.float32, device)
    assert fusenorm_counts() == {"norm_linear_fwd": 2, "deferred_norm": 2, "dgrad_norm_bwd": 4, "linear_norm_fwd": 2}
    details = [r.detail for r in fusenorm_inductor.last_report().rewrites if r.pattern == "linear_norm_fwd"]
    assert len(details) == 2 and all("taken here before pre-norm" in d for d in details), details


# ---- near-misses: left alone, still correct, and reported ------------------------------------------------


class OutputAlsoReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        y = self.norm(x)
        return self.lin(y).sum(-1) + y.sum(-1)


class ScaledBeforeLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(self.norm(x) * 2.0)


class NormOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(16)

    def forward(self, x):
        return torch.tanh(self.norm(x))


@pytest.mark.parametrize(
    "model,reason",
    [
        (OutputAlsoReturned, "not a linear"),
        (ScaledBeforeLinear, "not a linear"),
        (NormOnly, "not a linear"),
    ],
    ids=["norm-output-other-user", "scaled-before-linear", "no-linear"],
)
def test_near_miss_not_fused(model, reason, device):
    assert_matches_eager(model, (torch.randn(3, 5, 16),), torch.float32, device)
    assert "norm_linear_fwd" not in fusenorm_counts()
    assert any(reason in r for r in skips("norm_linear_fwd")), skips("norm_linear_fwd")


def test_autocast(device):
    """Under autocast the norm runs in fp32 and its output is cast for the bf16 linear: left to Inductor
    (the cast is a user that is not a linear), and correct."""
    x = torch.randn(4, 9, 32)
    assert_matches_eager(lambda: PreNormBlock(32, 40, "nn.LayerNorm"), (x,), torch.float32, device,
                         autocast=torch.bfloat16)
    assert "norm_linear_fwd" not in fusenorm_counts()
    assert skips("norm_linear_fwd"), "the report must say why the norm was not fused"


def test_dynamic_rows_stay_fused(device):
    m = PreNormBlock(16, 24).to(device)
    compiled = torch.compile(m, backend="fusenorm", dynamic=True)
    for rows in (17, 33):
        x = torch.randn(rows, 16, device=device)
        torch.testing.assert_close(compiled(x), m(x), atol=1e-4, rtol=1e-4)
    assert fusenorm_counts().get("norm_linear_fwd") == 1, fusenorm_counts()


def test_flat_like_keeps_the_device():
    """The tuner sees the [M, K] operand the rewrite builds: it must carry the example value's device (a
    meta tensor made every CUDA dispatch report "not measured on CPU" and fuse unmeasured)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusenorm_inductor.fx_utils import flat_like

    with FakeTensorMode():
        t = torch.empty(4, 6, 8, device="cuda", dtype=torch.bfloat16)  # fake: no GPU needed
    f = flat_like(t, 24, 8)
    assert (f.device.type, tuple(f.shape), f.stride(), f.dtype) == ("cuda", (24, 8), (8, 1), torch.bfloat16)
