"""Small models in every form users write a post-norm, and the compiled-vs-eager comparison the tests use."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

NORM_FORMS = ("nn.LayerNorm", "F.layer_norm", "nn.RMSNorm", "F.rms_norm", "torch.rms_norm", "llama")
RMS_FORMS = ("nn.RMSNorm", "F.rms_norm", "torch.rms_norm", "llama")


class LlamaRMSNorm(nn.Module):
    """The hand-written RMSNorm of HF LLaMA (fp32 upcast, cast back, then the weight)."""

    def __init__(self, n: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n)) if affine else None
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.weight * x.to(dtype) if self.weight is not None else x.to(dtype)


class Norm(nn.Module):
    """One norm over the last dim, written as ``form``; affine params drawn at random (never 1/0)."""

    def __init__(self, form: str, n: int, affine: bool = True, eps: Optional[float] = None, bias: bool = True):
        super().__init__()
        self.form, self.n = form, n
        self.eps = eps if eps is not None else (1e-6 if form == "llama" else 1e-5)
        rms = form in RMS_FORMS
        if form == "llama":
            self.impl = LlamaRMSNorm(n, self.eps, affine)
        elif form == "nn.LayerNorm":
            self.impl = nn.LayerNorm(n, eps=self.eps, elementwise_affine=affine, bias=bias)
        elif form == "nn.RMSNorm":
            self.impl = nn.RMSNorm(n, eps=eps, elementwise_affine=affine)  # eps None: the dtype's eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n)) if affine and form.startswith(("F.", "torch.")) else None
        self.bias = (nn.Parameter(0.1 * torch.randn(n)) if affine and bias and not rms
                     and form.startswith("F.") else None)
        with torch.no_grad():  # random affine parameters, so that a dropped weight or bias is caught
            for name, p in self.named_parameters():
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("weight") else 0.0))

    def forward(self, h):
        f = self.form
        if f == "F.layer_norm":
            return F.layer_norm(h, (self.n,), self.weight, self.bias, self.eps)
        if f == "F.rms_norm":
            return F.rms_norm(h, (self.n,), self.weight, self.eps)
        if f == "torch.rms_norm":
            return torch.rms_norm(h, (self.n,), self.weight, self.eps)
        return self.impl(h)


class LayerNormOfSum(nn.Module):
    """LayerNorm of a residual sum (pointwise code: its statistics an aten reduction Inductor compiles) read by
    two linears."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, h):
        n = self.norm(x + h)
        return self.a(n) * self.b(n)


class PostNormBlock(nn.Module):
    """``linear -> [+ residual] -> norm [-> linear]``, the post-norm shapes the fusion targets."""

    def __init__(self, k: int, n: int, form: str = "nn.LayerNorm", affine: bool = True, linear_bias: bool = True,
                 residual: Optional[str] = None, next_linear: bool = True, eps: Optional[float] = None,
                 out: int = 24):
        super().__init__()
        self.lin = nn.Linear(k, n, bias=linear_bias)
        self.norm = Norm(form, n, affine, eps)
        self.residual = residual
        self.out = nn.Linear(n, out) if next_linear else None

    def forward(self, x, r=None):
        h = self.lin(x)
        if self.residual == "right":
            h = h + r
        elif self.residual == "left":
            h = r + h
        y = self.norm(h)
        return self.out(y) if self.out is not None else y


class LinearNormStack(nn.Module):
    """``linear -> LN -> linear -> RMS -> linear``: each norm sits between two linears (post- and pre-norm
    both could take it)."""

    def __init__(self):
        super().__init__()
        self.l1, self.n1 = nn.Linear(24, 40), nn.LayerNorm(40)
        self.l2, self.n2 = nn.Linear(40, 32), nn.RMSNorm(32)
        self.l3 = nn.Linear(32, 8)

    def forward(self, x):
        return self.l3(self.n2(self.l2(self.n1(self.l1(x)))))


# ---- running and comparing ---------------------------------------------------------------------------

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""Floor of the allowed error, relative to the reference's largest magnitude. fp32: summation order only
(a few ulps times sqrt of the reduction length); fp16/bf16: a few units of the format's rounding (2^-11,
2^-8). The main bound is relative to Inductor's own error (see ``assert_matches_eager``)."""


def fwd_bwd(model: nn.Module, inputs: tuple, autocast: Optional[torch.dtype] = None):
    inputs = tuple(i.detach().clone().requires_grad_(i.is_floating_point()) if i is not None else None
                   for i in inputs)
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        out = model(*inputs)
    # A fixed random cotangent: exercises every output element and every gradient path.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    out.backward(g)
    grads = [p.grad for p in model.parameters()] + [i.grad for i in inputs if i is not None]
    return out.detach(), [x.detach() if x is not None else None for x in grads]


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude, or absolute below magnitude 1 (some
    gradients are sums that cancel to ~0 exactly, e.g. a bias feeding a norm over another dim)."""
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1.0)).item()


def assert_matches_eager(make_model: Callable[[], nn.Module], inputs: tuple, dtype: torch.dtype,
                         device: str, backend="fusenorm", autocast: Optional[torch.dtype] = None,
                         compile_fn: Optional[Callable] = None) -> None:
    """Compiled (``backend``) vs an fp32 eager reference, outputs and every gradient.

    The reference is the same model in fp32 from the same (``dtype``-rounded) parameters and inputs. The
    error allowed is twice what eager in ``dtype`` itself makes against that reference, plus the floor
    ``TOL[dtype]``: fusenorm must be no less accurate than running the model unfused.
    """
    torch.manual_seed(0)
    base = make_model().to(device=device, dtype=dtype if autocast is None else torch.float32)
    inputs = tuple(i.to(device=device, dtype=dtype if autocast is None else torch.float32)
                   if i is not None else None for i in inputs)
    ref_model = copy.deepcopy(base).float()
    ref = fwd_bwd(ref_model, tuple(i.float() if i is not None else None for i in inputs))
    eager = fwd_bwd(copy.deepcopy(base), inputs, autocast)
    test_model = copy.deepcopy(base)
    compiled = (compile_fn or (lambda m: torch.compile(m, backend=backend, dynamic=False)))(test_model)
    got = fwd_bwd(test_model if compiled is test_model else compiled, inputs, autocast)
    names = ["output"] + [f"grad {n}" for n, _ in base.named_parameters()] + [
        f"grad input{i}" for i, x in enumerate(inputs) if x is not None]
    floor = TOL[autocast or dtype]
    for name, r, e, g in zip(names, [ref[0]] + ref[1], [eager[0]] + eager[1], [got[0]] + got[1]):
        if r is None:
            assert g is None, f"{name}: reference has no gradient but compiled has one"
            continue
        assert g is not None, f"{name}: compiled model produced no gradient"
        assert g.dtype == e.dtype and g.shape == e.shape, (
            f"{name}: {g.dtype}{tuple(g.shape)} vs eager {e.dtype}{tuple(e.shape)}"
        )
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        bound = 2 * _err(e, r) + floor
        err = _err(g, r)
        assert err <= bound, f"{name}: error {err:.3g} vs fp32 reference exceeds {bound:.3g} (eager {_err(e, r):.3g})"


def fusenorm_counts() -> dict:
    return {k: v for k, v in counters["fusenorm"].items() if not k.startswith("canonical")}


def saved_bytes(make_model: Callable[[], nn.Module], inputs: tuple, backend: str, device: str) -> int:
    """Bytes the compiled forward saves for the backward (its outputs beyond the model's own; parameters
    and inputs are not new memory)."""
    import torch._inductor.config as inductor_config

    graphs = []
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = make_model().to(device)
    inputs = tuple(i.to(device) for i in inputs)
    with inductor_config.patch(post_grad_custom_post_pass=graphs.append):
        torch.compile(m, backend=backend)(*inputs).sum().backward()
    fwd = next(g for g in graphs if not any(n.name.startswith("tangents") for n in g.find_nodes(op="placeholder")))
    out = fwd.find_nodes(op="output")[0].args[0]
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.alias.default, torch.ops.aten.permute.default)

    def base(node):  # a view shares its base's memory: count each buffer once, inputs' not at all
        while node.op == "call_function" and node.target in views:
            node = node.args[0]
        return node

    saved = {base(o) for o in out[1:]}
    return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in saved if o.op != "placeholder")


# ---- the FlashNormAttention (PFFN) block: LayerNorm_{H*D} -> GDPA -> + ln_q -> RMSNorm_{H*D} -> + q -----------

GDPA_ACTIVATIONS = ("fast_gelu", "gelu", "silu", "relu", "raw")
"""Activation names of ``fusenorm::gdpa``; the dense block also writes ``gelu_tanh`` (F.gelu(approximate="tanh"),
the same function as fast_gelu, which the dense block otherwise writes out as the tanh expression)."""


def torch_activation(s: torch.Tensor, name: str) -> torch.Tensor:
    """The activation written in torch, as a model would: fast_gelu as the explicit tanh expression."""
    if name == "fast_gelu":
        return 0.5 * s * (1.0 + torch.tanh(0.7978845608028654 * (s + 0.044715 * torch.pow(s, 3.0))))
    if name == "gelu_tanh":
        return F.gelu(s, approximate="tanh")
    if name == "gelu":
        return F.gelu(s)
    if name == "silu":
        return F.silu(s)
    if name == "relu":
        return F.relu(s)
    if name == "softmax":  # a near-miss: not elementwise
        return torch.softmax(s, dim=-1)
    assert name == "raw", name
    return s


class FlashNormAttentionBlock(nn.Module):
    """``ln = LN_{H*D}(q)``; ``o = attention(ln, k, v) + ln``; ``out = RMS_{H*D}(o) + q``.

    ``form``: "gdpa" (q jagged [T, H, D], ``fusenorm::gdpa`` with the offsets of ``lengths``), "einsum" or
    "matmul" (q dense [B, L, H, D], the attention written in torch). ``mask``: for the dense forms, multiply o
    by a padding mask of ``lengths`` after the first residual ("bool" or "float"). Near-misses: ``per_head``
    (both norms over D only), ``residual1``/``residual2`` = "other" (an extra input r instead of ln_q / q),
    ``partial`` = "ln_gdpa" (LayerNorm -> GDPA only) or "gdpa_rms" (no LayerNorm: GDPA -> + q -> RMSNorm -> + q).
    """

    def __init__(self, h: int = 2, d: int = 16, form: str = "gdpa", activation: str = "fast_gelu",
                 scale: float = 0.5, affine: bool = True, ln_form: str = "nn.LayerNorm", rms_form: str = "nn.RMSNorm",
                 lengths=(0, 1, 37), mask: Optional[str] = None, per_head: bool = False,
                 residual1: str = "ln", residual2: str = "q", partial: Optional[str] = None):
        super().__init__()
        self.h, self.d, self.form, self.activation, self.scale = h, d, form, activation, scale
        self.mask, self.per_head, self.residual1, self.residual2, self.partial = (
            mask, per_head, residual1, residual2, partial)
        n = d if per_head else h * d
        self.ln = Norm(ln_form, n, affine)
        self.rms = Norm(rms_form, n, affine)
        lengths = torch.tensor(lengths, dtype=torch.int64)
        self.max_len = int(lengths.max()) if lengths.numel() else 0
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        self.register_buffer("offsets", offsets, persistent=False)
        self.register_buffer("lengths", lengths, persistent=False)
        # Unused (gradient None in every run): fwd_bwd reads the device from the parameters; plain norms have none.
        self.device_anchor = nn.Parameter(torch.zeros(()))

    def attention(self, ln, k, v):
        if self.form == "gdpa":
            from fusenorm_inductor.ops.gdpa import gdpa

            return gdpa(ln, k, v, self.offsets, self.max_len, self.activation, self.scale)
        if self.form == "einsum":
            s = torch.einsum("blhd,bshd->bhls", ln, k)
        else:
            s = ln.transpose(1, 2) @ k.permute(0, 2, 3, 1)  # [B, H, L, D] @ [B, H, D, S]
        p = torch_activation(s, self.activation) * self.scale
        if self.form == "einsum":
            return torch.einsum("bhls,bshd->blhd", p, v)
        return (p @ v.transpose(1, 2)).permute(0, 2, 1, 3)  # [B, H, L, D] -> [B, L, H, D]

    def forward(self, q, k, v, r=None):
        lead = q.shape[:-2]
        if self.per_head:
            ln = self.ln(q)
        else:
            ln = self.ln(q.reshape(*lead, self.h * self.d)).view(*lead, self.h, self.d)
        a = self.attention(q if self.partial == "gdpa_rms" else ln, k, v)
        if self.partial == "ln_gdpa":
            return a * 2.0
        o = a + (r if self.residual1 == "other" else q if self.partial == "gdpa_rms" else ln)
        if self.mask is not None:
            rows = torch.arange(q.shape[1], device=q.device)[None, :] < self.lengths[:, None]  # [B, L]
            o = o * (rows if self.mask == "bool" else rows.float() * 0.5)[..., None, None]
        if self.per_head:
            y = self.rms(o)
        else:
            y = self.rms(o.reshape(*lead, self.h * self.d)).view(*lead, self.h, self.d)
        return y + (r if self.residual2 == "other" else q)


def attention_inputs(form: str, h: int = 2, d: int = 16, lengths=(0, 1, 37), s: int = 24, residual: bool = False):
    """(q, k, v[, r]) for ``FlashNormAttentionBlock``: q jagged [T, H, D] for "gdpa", else [B, max(lengths), H, D]."""
    b = len(lengths)
    q = torch.randn(sum(lengths), h, d) if form == "gdpa" else torch.randn(b, max(lengths), h, d)
    k, v = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    return (q, k, v) + ((torch.randn_like(q),) if residual else ())
