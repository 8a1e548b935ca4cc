"""The fused ops as public ops: input validation, their autograd against plain torch, and that a fused
graph saves no more for the backward than the unfused one."""

import pytest
import torch

from fusenorm_inductor.ops import mm_norm, mm_norm_backward, mm_norm_backward_reference, norm
from fusenorm_inductor.ops.norm import norm_reference

from .models import PostNormBlock, saved_bytes


def _args(m=33, k=24, n=40, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return dict(a=r(m, k), b=r(n, k).t(), bias=r(n), residual=r(m, n), weight=1 + 0.1 * r(n),
                norm_bias=0.1 * r(n), eps=1e-5, is_rms=False)


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(a=torch.randn(3, 4, 24)), "'a' must be 2-D"),
        (dict(b=torch.randn(23, 40)), "inner dims differ"),
        (dict(bias=torch.randn(41)), "'bias' must have shape"),
        (dict(residual=torch.randn(33, 41)), "'residual' must have shape"),
        (dict(weight=torch.randn(40).int()), "'weight' must have dtype"),
        (dict(b=torch.randn(24, 40).half()), "'b' must have dtype"),
        (dict(eps=-1.0), "eps must be a non-negative"),
    ],
)
def test_mm_norm_validates_inputs(change, error):
    args = {**_args(), **change}
    with pytest.raises((ValueError, TypeError), match=error):
        mm_norm(**args)


def test_mm_norm_backward_validates_inputs():
    dy, b = torch.randn(8, 16), torch.randn(16, 24)
    src, rstd = torch.randn(8, 24), torch.rand(8) + 0.5
    with pytest.raises(ValueError, match="'src' must have shape"):
        mm_norm_backward(dy, b, None, src[:, :5], None, rstd, rstd, True, True, False, torch.float32)
    with pytest.raises(TypeError, match="'rstd' must have dtype"):
        mm_norm_backward(dy, b, None, src, None, rstd, rstd.double(), True, True, False, torch.float32)
    with pytest.raises(ValueError, match="'mean' must have shape"):
        mm_norm_backward(dy, b, None, src, None, rstd[:3], rstd, False, False, False, torch.float32)
    # hh given: the mean is not needed (and not saved by the fused forward)
    mm_norm_backward(dy, b, None, src, None, None, rstd, False, True, False, torch.float32)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_mm_norm_autograd_matches_torch(is_rms, affine, device):
    """The op's registered autograd against autograd through the plain-torch composition."""
    args = _args(device=device)
    if not affine:
        args.update(weight=None, norm_bias=None)
    if is_rms:
        args.update(is_rms=True, norm_bias=None)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items() if isinstance(v, torch.Tensor)}
    y, hh, mean, rstd = mm_norm(**{**args, **leaves}, save_normed=affine)
    g = torch.randn_like(y)
    y.backward(g)
    ref_leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    r = {**args, **ref_leaves}
    h = r["a"] @ r["b"] + r["bias"] + r["residual"]
    y_ref, mean_ref, rstd_ref = norm_reference(h, r["weight"], r["norm_bias"], 1e-5, is_rms)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref)
    if not is_rms:
        torch.testing.assert_close(mean, mean_ref)
    for k in leaves:
        torch.testing.assert_close(leaves[k].grad, ref_leaves[k].grad, atol=1e-4, rtol=1e-4, msg=k)


def test_mm_norm_affine_backward_needs_hh():
    args = _args()
    args["a"].requires_grad_()
    y = mm_norm(**args, save_normed=False)[0]
    with pytest.raises(RuntimeError, match="save_normed=True"):
        y.sum().backward()


@pytest.mark.parametrize("src_is_normed", [False, True], ids=["from-x", "from-hh"])
def test_mm_norm_backward_matches_autograd(src_is_normed):
    """norm_backward(dy @ b + extra) equals autograd of norm(x) where dn = dy @ b + extra."""
    torch.manual_seed(0)
    m, k, n = 21, 16, 40
    x = torch.randn(m, n, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n)).requires_grad_()
    bias = (0.1 * torch.randn(n)).requires_grad_()
    y, mean, rstd = norm_reference(x, w, bias, 1e-5, False)
    dy, b, extra = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    y.backward(dy @ b + extra)
    hh = (x.detach() - mean[:, None]) * rstd[:, None]
    dx, dw, db = mm_norm_backward(dy, b, extra, hh if src_is_normed else x.detach(), w.detach(), mean, rstd,
                                  False, src_is_normed, True, torch.float32)
    torch.testing.assert_close(dx, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, w.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db, bias.grad, atol=1e-5, rtol=1e-5)
    ref = mm_norm_backward_reference(dy, b, extra, x.detach(), w.detach(), mean, rstd, False, False, True,
                                     torch.float32)
    torch.testing.assert_close(dx, ref[0], atol=1e-5, rtol=1e-5)


def test_canonical_norm_matches_torch_norms(device):
    x = (torch.randn(5, 7, 40) * 3 + 100).to(device)  # |mean| >> std: two-pass variance needed
    w, b = torch.randn(40, device=device), torch.randn(40, device=device)
    y = norm(x, w, b, 1e-5, False)[0]
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (40,), w, b, 1e-5), atol=1e-4, rtol=1e-4)
    y = norm(x, w, None, 1e-6, True)[0]
    torch.testing.assert_close(y, torch.rms_norm(x, (40,), w, 1e-6), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="double backward"):
        xg = x.clone().requires_grad_()
        dx = torch.autograd.grad(norm(xg, w, b, 1e-5, False)[0].sum(), xg, create_graph=True)[0]
        dx.sum().backward()


def test_fused_saves_no_more_than_unfused(device):
    make = lambda: PostNormBlock(32, 64, "nn.LayerNorm", residual="right")  # noqa: E731
    inputs = (torch.randn(4, 33, 32), torch.randn(4, 33, 64))
    unfused, fused = saved_bytes(make, inputs, "inductor", device), saved_bytes(make, inputs, "fusenorm", device)
    assert fused <= unfused, (fused, unfused)
