"""Hand-written norms found in HF models (issue 16, "Recognition"): each form becomes one ``fusenorm::norm``
under its own pattern name, in fp32, bf16 and fp16, between two linears (where it then fuses; bare, it goes back
as written, since nothing would fuse with it); each
near-miss is left alone (no canonical rewrite, the report says why) and still matches eager."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fusenorm_inductor

from .models import assert_matches_eager, fusenorm_counts

N = 24
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def _weight(n, offset=1.0):
    return nn.Parameter(offset + 0.1 * torch.randn(n))


class T5Norm(nn.Module):
    """HF ``T5LayerNorm``: statistic in fp32, rsqrt multiplies the uncast input, cast to the weight's dtype."""

    def __init__(self, n=N, eps=1e-6, mean_dim=-1, wshape=None):
        super().__init__()
        self.weight = _weight(wshape or n)
        self.variance_epsilon, self.mean_dim = eps, mean_dim

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(self.mean_dim, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class LlamaNorm(nn.Module):
    """HF LLaMA/Mistral/Qwen RMSNorm; ``casts=False`` is the same norm with the casts gone (an fp32 model written
    without them). Near-miss knobs: ``mean_dim``, ``eps=None`` (no + eps), ``wshape``."""

    def __init__(self, n=N, eps=1e-6, casts=True, mean_dim=-1, wshape=None):
        super().__init__()
        self.weight = _weight(wshape or n)
        self.variance_epsilon, self.casts, self.mean_dim = eps, casts, mean_dim

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        if self.casts:
            hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(self.mean_dim, keepdim=True)
        if self.variance_epsilon is not None:
            variance = variance + self.variance_epsilon
        hidden_states = hidden_states * torch.rsqrt(variance)
        return self.weight * (hidden_states.to(input_dtype) if self.casts else hidden_states)


class DoubleCastNorm(nn.Module):
    """A LLaMA RMSNorm written with ``x.float()`` twice, once for the variance and once for the product (two
    nodes of one value): it used to be missed ("rsqrt(...) is not multiplied by the normalized input").
    ``noop_cast`` adds a cast that changes nothing (``.to(x.dtype)`` of x) before the product's upcast."""

    def __init__(self, n=N, eps=1e-6, noop_cast=False):
        super().__init__()
        self.weight = _weight(n)
        self.eps, self.noop_cast = eps, noop_cast

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        xin = x.to(x.dtype) if self.noop_cast else x
        return self.weight * (xin.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class GemmaNorm(nn.Module):
    """HF Gemma RMSNorm: the weight stored as an offset from 1, applied in fp32 before the cast back."""

    def __init__(self, n=N, eps=1e-6):
        super().__init__()
        self.weight = _weight(n, offset=0.0)
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class ManualLN(nn.Module):
    """The LayerNorm of older GPT-2/BERT/ViT code; ``var``: "mean" ((x - u).pow(2).mean), "biased"
    (var(unbiased=False)) or "unbiased" (a near-miss). Near-miss knobs: ``mean_dim``, ``wshape``."""

    def __init__(self, n=N, eps=1e-12, var="mean", mean_dim=-1, wshape=None):
        super().__init__()
        self.weight = _weight(wshape or n)
        self.bias = nn.Parameter(0.1 * torch.randn(n))
        self.eps, self.var, self.mean_dim = eps, var, mean_dim

    def forward(self, x):
        u = x.mean(self.mean_dim, keepdim=True)
        if self.var == "mean":
            s = (x - u).pow(2).mean(-1, keepdim=True)
        else:
            s = x.var(-1, keepdim=True, unbiased=self.var != "biased")
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight * x + self.bias


class BareAndWrapped(nn.Module):
    """The form twice in one graph (one compile per test): bare on an input, and ``linear -> norm -> linear``,
    where the canonical norm then fuses with its GEMMs. The bare one feeds a cat: nothing to fuse with."""

    def __init__(self, make):
        super().__init__()
        self.bare, self.lin, self.norm, self.out = make(), nn.Linear(16, N), make(), nn.Linear(N, 8)

    def forward(self, x, z):
        return torch.cat([self.bare(z), self.out(self.norm(self.lin(x)))], dim=-1)


FORMS = {
    "t5": (T5Norm, "canonical_t5_rms_norm"),
    "llama": (LlamaNorm, "canonical_llama_rms_norm"),
    "llama-no-casts": (lambda: LlamaNorm(casts=False), "canonical_llama_rms_norm"),
    "gemma": (GemmaNorm, "canonical_gemma_rms_norm"),
    "llama-double-cast": (DoubleCastNorm, "canonical_llama_rms_norm"),
    "llama-double-cast-noop": (lambda: DoubleCastNorm(noop_cast=True), "canonical_llama_rms_norm"),
    "manual-ln": (ManualLN, "canonical_manual_layer_norm"),
    "manual-ln-var": (lambda: ManualLN(var="biased"), "canonical_manual_layer_norm"),
}


def canonical_counts() -> dict:
    return {k: v for k, v in counters["fusenorm"].items() if k.startswith("canonical")}


def skips(pattern):
    return [s.reason for s in fusenorm_inductor.last_report().skips if s.pattern == pattern]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_form_canonicalized_and_fused(form, dtype):
    make, pattern = FORMS[form]
    assert_matches_eager(lambda: BareAndWrapped(make), (torch.randn(3, 5, 16), torch.randn(3, 5, N)), dtype, "cpu")
    # The bare norm is recognized too, but no fusion takes it: it goes back as written (norm_prospects).
    assert canonical_counts() == {pattern: 1}
    assert fusenorm_counts() == {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}
    assert len(skips("norm_prospects")) == 1 and "no fusion would take it" in skips("norm_prospects")[0]


NEAR_MISSES = {
    "rms-mean-dim0": (lambda: LlamaNorm(mean_dim=0), "canonical_llama_rms_norm", "not over the last dim"),
    "rms-mean-dim-2": (lambda: LlamaNorm(mean_dim=-2), "canonical_llama_rms_norm", "not over the last dim"),
    "rms-mean-two-dims": (lambda: LlamaNorm(mean_dim=(-2, -1)), "canonical_llama_rms_norm",
                          "not over the last dim"),
    "rms-no-eps": (lambda: LlamaNorm(eps=None), "canonical_llama_rms_norm", "mean(x^2) + eps"),
    "rms-weight-shape": (lambda: LlamaNorm(wshape=1), "canonical_llama_rms_norm", "not a weight of the last dim"),
    "t5-mean-dim-2": (lambda: T5Norm(mean_dim=-2), "canonical_t5_rms_norm", "not over the last dim"),
    "t5-weight-shape": (lambda: T5Norm(wshape=1), "canonical_t5_rms_norm", "not a weight of the last dim"),
    "ln-mean-dim0": (lambda: ManualLN(mean_dim=0), "canonical_manual_layer_norm", "not over the last dim"),
    "ln-mean-dim-2": (lambda: ManualLN(mean_dim=-2), "canonical_manual_layer_norm", "not over the last dim"),
    "ln-unbiased-var": (lambda: ManualLN(var="unbiased"), "canonical_manual_layer_norm", "unbiased variance"),
    "ln-weight-shape": (lambda: ManualLN(wshape=(5, 1)), "canonical_manual_layer_norm",
                        "not a weight of the last dim"),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_miss_not_canonicalized(case):
    make, pattern, reason = NEAR_MISSES[case]
    assert_matches_eager(make, (torch.randn(3, 5, N),), torch.float32, "cpu")
    assert canonical_counts() == {}
    assert any(reason in r for r in skips(pattern)), skips(pattern)
