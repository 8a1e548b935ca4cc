"""linear -> [+ residual] -> norm: every written form is rewritten (exact counts by pattern name), every
near-miss is not (and the report says why), and compiled results match eager, outputs and all gradients."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusenorm_inductor
from fusenorm_inductor import config

from .models import NORM_FORMS, LinearNormStack, PostNormBlock, assert_matches_eager, fusenorm_counts
from .test_contract import assert_step_matches

FUSED_BOTH = {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}


def skips(pattern):
    rep = fusenorm_inductor.last_report()
    return [s.reason for s in rep.skips if s.pattern == pattern]


@pytest.mark.parametrize("form", NORM_FORMS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_every_form_fused_3d(form, affine, device):
    x = torch.randn(3, 7, 40)  # 21 rows, K = N = 40: no power of two anywhere
    assert_matches_eager(lambda: PostNormBlock(40, 40, form, affine), (x,), torch.float32, device)
    assert fusenorm_counts() == FUSED_BOTH


@pytest.mark.parametrize(
    "form,linear_bias,residual,eps",
    [
        ("nn.LayerNorm", False, None, 1e-3),
        ("nn.LayerNorm", True, "right", 1e-5),
        ("F.layer_norm", True, "left", 0.1),
        ("nn.RMSNorm", False, "right", None),
        ("torch.rms_norm", True, "left", 1e-2),
        ("llama", False, "left", 1e-5),
    ],
)
def test_bias_residual_eps_2d(form, linear_bias, residual, eps, device):
    x, r = torch.randn(257, 24), torch.randn(257, 40)
    make = lambda: PostNormBlock(24, 40, form, True, linear_bias, residual, eps=eps)  # noqa: E731
    assert_matches_eager(make, (x, r if residual else None), torch.float32, device)
    assert fusenorm_counts() == FUSED_BOTH


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["nn.LayerNorm", "llama"])
def test_half_precision(form, dtype, device):
    x, r = torch.randn(5, 13, 32), torch.randn(5, 13, 48)
    assert_matches_eager(lambda: PostNormBlock(32, 48, form, residual="right"), (x, r), dtype, device)
    assert fusenorm_counts() == FUSED_BOTH


@pytest.mark.parametrize("form", ["nn.LayerNorm", "nn.RMSNorm", "llama"])
def test_autocast(form, device):
    x = torch.randn(4, 9, 32)
    assert_matches_eager(lambda: PostNormBlock(32, 40, form), (x,), torch.float32, device,
                         autocast=torch.bfloat16)
    assert fusenorm_counts() == FUSED_BOTH


def test_norm_output_not_feeding_a_linear(device):
    """Forward fused; the backward stays on the unfused path (and says why)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = PostNormBlock(32, 40, next_linear=False)

        def forward(self, x):
            return torch.tanh(self.block(x))

    assert_matches_eager(M, (torch.randn(33, 32),), torch.float32, device)
    assert fusenorm_counts() == {"linear_norm_fwd": 1}
    assert any("does not come from a linear" in r for r in skips("dgrad_norm_bwd"))


def test_inference_no_grad(device):
    torch.manual_seed(0)
    m = PostNormBlock(32, 40, "nn.LayerNorm", residual="right").to(device)
    x, r = torch.randn(19, 32, device=device), torch.randn(19, 40, device=device)
    with torch.no_grad():
        ref = m(x, r)
        got = torch.compile(m, backend="fusenorm")(x, r)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert fusenorm_counts() == {"linear_norm_fwd": 1}


# ---- near-misses: left alone, still correct, and reported ------------------------------------------------


class TwoDimNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 24)

    def forward(self, x):
        return F.layer_norm(self.lin(x), (5, 24))


class ExtraUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = PostNormBlock(16, 24)

    def forward(self, x):
        h = self.block.lin(x)
        return self.block.out(self.block.norm(h)).sum(-1) + h.sum(-1)


class NormOverOtherDim(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.lin(x).transpose(1, 2))


class BroadcastResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 24)
        self.r = nn.Parameter(torch.randn(24))
        self.norm = nn.LayerNorm(24)

    def forward(self, x):
        return self.norm(self.lin(x) + self.r)


@pytest.mark.parametrize(
    "model,pattern,reason",
    [
        (TwoDimNorm, "canonical_layer_norm", "normalizes over 2 dims"),
        (ExtraUser, "linear_norm_fwd", "has another user"),
        (NormOverOtherDim, "linear_norm_fwd", "not a linear's output"),
        (BroadcastResidual, "linear_norm_fwd", "broadcasts"),
    ],
    ids=["norm-over-two-dims", "linear-output-other-user", "norm-not-over-linear-dim", "broadcast-residual"],
)
def test_near_miss_not_fused(model, pattern, reason, device):
    assert_matches_eager(model, (torch.randn(3, 5, 16),), torch.float32, device)
    assert "linear_norm_fwd" not in fusenorm_counts()
    assert any(reason in r for r in skips(pattern)), skips(pattern)


class DropoutResidual(nn.Module):
    """BERT's output block: linear -> dropout -> + residual -> LayerNorm -> (next linear)."""

    def __init__(self, p: float):
        super().__init__()
        self.lin, self.drop, self.norm, self.out = nn.Linear(16, 24), nn.Dropout(p), nn.LayerNorm(24), nn.Linear(24, 8)

    def forward(self, x, r):
        return self.out(self.norm(self.drop(self.lin(x)) + r))


@pytest.mark.parametrize("p,train", [(0.0, True), (0.3, False)], ids=["p0-train", "p0.3-eval"])
def test_inactive_dropout_between_linear_and_residual(p, train, device):
    """An inactive dropout (p = 0, or eval mode) traces to a clone between the linear and the residual add:
    the match looks through it."""
    make = lambda: DropoutResidual(p).train(train)  # noqa: E731
    assert_matches_eager(make, (torch.randn(3, 7, 16), torch.randn(3, 7, 24)), torch.float32, device)
    assert fusenorm_counts() == FUSED_BOTH


def test_active_dropout_reported(device):
    """A training-mode dropout (a random mask) between the linear and the add stops the match, with a reason
    that says so."""
    torch.manual_seed(0)
    m = DropoutResidual(0.5).to(device)
    x, r = torch.randn(3, 7, 16, device=device), torch.randn(3, 7, 24, device=device)
    torch.compile(m, backend="fusenorm", dynamic=False)(x, r).sum().backward()
    assert "linear_norm_fwd" not in fusenorm_counts()
    assert any("no linear output on either side" in s and "dropout" in s for s in skips("linear_norm_fwd")), \
        skips("linear_norm_fwd")


def test_dynamic_rows_stay_fused(device):
    """dynamic=True (3-D input, symbolic batch and sequence): fused once, correct at every size, gradients too."""
    m = PostNormBlock(16, 24, residual="right").to(device)
    compiled = torch.compile(copy.deepcopy(m), backend="fusenorm", dynamic=True)
    for lead in ((3, 17), (5, 33)):
        x, r = torch.randn(*lead, 16, device=device), torch.randn(*lead, 24, device=device)
        assert_step_matches(m, compiled, (x, r))
    assert fusenorm_counts() == {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}


def test_dynamic_norm_width_left_to_inductor(device):
    """A symbolic norm width (no linear fixes it) is left to Inductor, with the reason."""
    compiled = torch.compile(torch.nn.functional.layer_norm, backend="fusenorm", dynamic=True)
    for n in (16, 40):
        x = torch.randn(7, n, device=device)
        torch.testing.assert_close(compiled(x, (n,)), torch.nn.functional.layer_norm(x, (n,)))
    assert fusenorm_counts() == {}
    assert any("symbolic norm width" in r for r in skips("canonical_layer_norm")), skips("canonical_layer_norm")


def test_pattern_switches(device):
    x = torch.randn(21, 32)
    off = {"patterns.linear_norm_fwd": False, "patterns.norm_linear_fwd": False, "patterns.deferred_norm": False}
    with config.patch(off):
        assert_matches_eager(lambda: PostNormBlock(32, 40), (x,), torch.float32, device)
    # The backward regrouping does not need the forward fusion: it reads x with the saved statistics.
    assert fusenorm_counts() == {"dgrad_norm_bwd": 1}
    assert any("disabled by config" in r for r in skips("linear_norm_fwd"))
    assert any("disabled by config" in r for r in skips("norm_linear_fwd"))
    torch._dynamo.reset()
    # The norm between the two linears that post-norm leaves is offered to the next linear (pre-norm, with
    # deferral off; tests/test_deferred_norm.py has it on).
    with config.patch({"patterns.linear_norm_fwd": False, "patterns.deferred_norm": False}):
        assert_matches_eager(lambda: PostNormBlock(32, 40), (x,), torch.float32, device)
    assert fusenorm_counts() == {"dgrad_norm_bwd": 2, "norm_linear_fwd": 1}
    torch._dynamo.reset()
    with config.patch(canonicalize_norms=False):
        assert_matches_eager(lambda: PostNormBlock(32, 40), (x,), torch.float32, device)
    assert fusenorm_counts() == {"dgrad_norm_bwd": 2, "norm_linear_fwd": 1}  # counts accumulate; nothing new


def test_stack_each_norm_fused_once(device):
    """linear -> LN -> linear -> RMS -> linear: two forward fusions, two regrouped backwards."""

    assert_matches_eager(LinearNormStack, (torch.randn(2, 11, 24),), torch.float32, device)
    assert fusenorm_counts() == {"linear_norm_fwd": 2, "dgrad_norm_bwd": 2}
