"""GDPA's activations (fusenorm_inductor/activations.py and kernels/triton/activations.py): the torch references against autograd in fp64,
and the Triton versions (the interpreter on CPU, compiled on CUDA) against the references."""

import pytest
import torch

from fusenorm_inductor.activations import (
    ACTIVATIONS, act_grad_reference, act_reference, activation_code,
)

ALL = pytest.mark.parametrize("name", ACTIVATIONS)


def _points(device="cpu"):
    """Both signs, large magnitudes where tanh/erf saturate, and exact zeros (relu's kink)."""
    x = torch.cat([torch.randn(1000) * 3, torch.linspace(-12, 12, 25), torch.zeros(3)])
    return x.double().to(device)


@ALL
def test_reference_gradient_matches_autograd(name):
    x = _points().requires_grad_()
    act_reference(x, name).sum().backward()
    torch.testing.assert_close(act_grad_reference(x.detach(), name), x.grad, rtol=1e-12, atol=1e-12)


def test_reference_values():
    """fast_gelu is torch's tanh-form gelu; gelu torch's erf form; silu and relu torch's."""
    x = _points()
    F = torch.nn.functional
    torch.testing.assert_close(act_reference(x, "fast_gelu"), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(act_reference(x, "gelu"), F.gelu(x))
    torch.testing.assert_close(act_reference(x, "silu"), F.silu(x))
    torch.testing.assert_close(act_reference(x, "relu"), F.relu(x))
    assert act_reference(x, "raw") is x


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="unknown activation 'softmax'.*fast_gelu"):
        activation_code("softmax", "fusenorm::gdpa")
    assert [activation_code(n) for n in ACTIVATIONS] == list(range(len(ACTIVATIONS)))


triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fusenorm_inductor.kernels.triton.activations import act_bwd, act_fwd  # noqa: E402


@triton.jit
def _act_kernel(x_ptr, y_ptr, g_ptr, n, BLOCK: tl.constexpr, ACT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, act_fwd(x, ACT), mask=mask)
    tl.store(g_ptr + offs, act_bwd(x, ACT), mask=mask)


@ALL
def test_triton_matches_reference(name):
    """act_fwd / act_bwd in fp32 against the fp64 references: a few fp32 ulps of the larger of value and 1
    (tanh through exp loses a little near saturation)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    xf = _points(device).float()
    y, g = torch.full_like(xf, float("nan")), torch.full_like(xf, float("nan"))
    n = xf.numel()
    _act_kernel[(triton.cdiv(n, 256),)](xf, y, g, n, BLOCK=256, ACT=activation_code(name))
    x64 = xf.double()  # the fp32 inputs, exactly
    tol = 64 * 2.0**-24
    for got, ref in ((y, act_reference(x64, name)), (g, act_grad_reference(x64, name))):
        err = (got.double() - ref).abs()
        assert bool((err <= tol * ref.abs().clamp_min(1.0)).all()), (name, err.max().item())
