"""The pre-norm ops ``fusenorm::norm_mm`` and ``fusenorm::mm_normed``: values and gradients against the
composite they replace (norm, then linear), in fp32 with fresh random inputs and odd sizes, and their
input validation."""

import pytest
import torch
import torch.nn.functional as F

from fusenorm_inductor.ops import mm_normed, norm_mm

EPS = 1e-5


def _composite(a, w_lin, bias, weight, norm_bias, is_rms):
    k = a.shape[-1]
    y = F.rms_norm(a, (k,), weight, EPS) if is_rms else F.layer_norm(a, (k,), weight, norm_bias, EPS)
    return F.linear(y, w_lin, bias)


def _inputs(m, k, n, affine, is_rms, device, bias=True):
    g = torch.Generator().manual_seed(m * 31 + k)
    r = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()  # noqa: E731
    weight = (1 + 0.3 * torch.randn(k, generator=g)).to(device).requires_grad_() if affine else None
    norm_bias = r(k) if affine and not is_rms else None
    return r(m, k), r(n, k), r(n) if bias else None, weight, norm_bias


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("mkn", [(257, 40, 24), (3, 72, 130)], ids=["257x40x24", "3x72x130"])
def test_values_and_gradients_match_composite(mkn, affine, is_rms, device):
    m, k, n = mkn
    a, w_lin, bias, weight, norm_bias = _inputs(m, k, n, affine, is_rms, device)
    leaves = [t for t in (a, w_lin, bias, weight, norm_bias) if t is not None]
    c, mean, rstd = norm_mm(a, w_lin.t(), bias, weight, norm_bias, EPS, is_rms)
    ref = _composite(a, w_lin, bias, weight, norm_bias, is_rms)
    torch.testing.assert_close(c, ref, atol=1e-4, rtol=1e-4)
    xf = a.detach().double()
    torch.testing.assert_close(rstd.double(), torch.rsqrt((xf.pow(2).mean(1) if is_rms else xf.var(1, False)) + EPS),
                               atol=1e-5, rtol=1e-5)
    assert mean.numel() == (0 if is_rms else m)
    dc = torch.randn(c.shape, generator=torch.Generator().manual_seed(7)).to(device)
    got = torch.autograd.grad(c, leaves, dc)
    want = torch.autograd.grad(ref, leaves, dc)
    for name, gg, ww in zip(["a", "w_lin", "bias", "weight", "norm_bias"], got, want):
        torch.testing.assert_close(gg, ww, atol=2e-4, rtol=2e-4, msg=lambda s, n=name: f"grad {n}: {s}")


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_mm_normed_rebuilds_the_normalized_input(is_rms, device):
    m, k, p = 65, 40, 24
    a, _, _, weight, norm_bias = _inputs(m, k, 1, True, is_rms, device)
    a, weight = a.detach(), weight.detach()
    norm_bias = norm_bias.detach() if norm_bias is not None else None
    y = (F.rms_norm(a, (k,), weight, EPS) if is_rms else F.layer_norm(a, (k,), weight, norm_bias, EPS))
    x = torch.randn(p, m, device=device)
    mean = None if is_rms else a.mean(1)
    rstd = torch.rsqrt((a.pow(2).mean(1) if is_rms else a.var(1, unbiased=False)) + EPS)
    out = mm_normed(x, a, mean, rstd, weight, norm_bias, is_rms)
    torch.testing.assert_close(out, x @ y, atol=1e-4, rtol=1e-4)


def test_validation():
    a, w = torch.randn(8, 16), torch.randn(16, 12)
    with pytest.raises(ValueError, match="inner dims"):
        norm_mm(a, torch.randn(15, 12), None, None, None, EPS, False)
    with pytest.raises(TypeError, match="'b' must have dtype"):
        norm_mm(a, w.half(), None, None, None, EPS, False)
    with pytest.raises(ValueError, match="'weight' must have shape"):
        norm_mm(a, w, None, torch.ones(12), None, EPS, False)
    with pytest.raises(ValueError, match="at least one column"):
        norm_mm(torch.randn(8, 0), torch.randn(0, 12), None, None, None, EPS, False)
    with pytest.raises(ValueError, match="eps"):
        norm_mm(a, w, None, None, None, -1.0, False)
    with pytest.raises(ValueError, match="'a' must be 2-D"):
        norm_mm(torch.randn(2, 8, 16), w, None, None, None, EPS, False)
    with pytest.raises(ValueError, match=r"x must be \[P, M\]"):
        mm_normed(torch.randn(4, 7), a, torch.zeros(8), torch.ones(8), None, None, False)
    with pytest.raises(ValueError, match="'mean' is required"):
        mm_normed(torch.randn(4, 8), a, None, torch.ones(8), None, None, False)
