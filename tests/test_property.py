"""Property: randomly generated small models compiled with backend="fusenorm" equal eager, outputs and every
gradient (parameters and input).

Each model is a random stack of layers: linears (with or without bias), norms in every form fusenorm
canonicalizes (nn.LayerNorm with and without bias, F.layer_norm, torch.layer_norm, nn.RMSNorm, F.rms_norm,
torch.rms_norm, hand-written RMSNorms in the variants the LLaMA pattern accepts, and HF's T5 and Gemma
RMSNorms and the hand-written GPT-2/BERT LayerNorm), affine or not, activations,
residual adds on either side, reshapes between 2-D and 3-D (and a transpose), and fan-out (one tensor feeding
two linears, a norm's input also feeding a residual add). Post-norm, pre-norm and the regrouped backward each
find candidates in it, as do their near-misses.

Errors are measured against the model in float64 (same parameters and input): the compiled model may be off by
at most twice eager's own fp32 error plus the fp32 floor of tests/models.py. A model where nothing fused (every
norm went back as written) must equal plain Inductor's compile bit for bit, outputs and gradients. The example budget is fixed and
derandomized (the same models on every run): 200 models, drawn once and checked in chunks, one test each
(``PROPERTY_EXAMPLES`` sets another number for a local run); a last test checks that the examples did get fused
(every fusion pattern and every canonical norm pattern fired somewhere), so that it tests fusenorm and not only
Inductor.
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from .models import TOL, _err
from .test_norm_forms import GemmaNorm, ManualLN, T5Norm

MAX_EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", "200"))
WIDTHS = (13, 24, 40)
LEADS = {257: ((257,), (1, 257)), 105: ((105,), (5, 21))}  # rows: their 2-D and 3-D leading dims
NORM_FORMS = ("nn.LayerNorm", "hand", "nn.RMSNorm", "F.layer_norm", "F.rms_norm", "nn.LayerNorm-nobias",
              "torch.layer_norm", "torch.rms_norm", "hand",  # "hand": many variants, so drawn twice as often
              "t5", "gemma", "manual-ln", "manual-ln-var")  # the HF forms of test_norm_forms.py (always affine)
ACTIVATIONS = ("relu", "gelu", "silu", "tanh")


# ---- the layers ----------------------------------------------------------------------------------------------


def _affine(n: int, bias: bool):
    """Random affine parameters (never 1 and 0: a dropped weight or bias shows)."""
    w = nn.Parameter(1 + 0.1 * torch.randn(n))
    return w, (nn.Parameter(0.1 * torch.randn(n)) if bias else None)


class HandRMSNorm(nn.Module):
    """A hand-written RMSNorm in one of the variants of the LLaMA form: x^2 as pow/square/x*x, an optional
    fp32 upcast (.float() or .to(float32)), an optional cast back (.to(dtype) or .type_as), the weight on either
    side, eps added on either side."""

    def __init__(self, n: int, eps: float, affine: bool, square: str, upcast: str, cast_back: str, weight_left: bool,
                 eps_left: bool):
        super().__init__()
        self.weight = _affine(n, False)[0] if affine else None
        self.eps, self.square, self.upcast, self.cast_back = eps, square, upcast, cast_back
        self.weight_left, self.eps_left = weight_left, eps_left

    def forward(self, h):
        upcast = self.upcast if h.dtype != torch.float64 else "none"  # the float64 reference stays float64
        x = h.float() if upcast == "float" else h.to(torch.float32) if upcast == "to" else h
        sq = x.pow(2) if self.square == "pow" else torch.square(x) if self.square == "square" else x * x
        ms = sq.mean(-1, keepdim=True)
        y = x * torch.rsqrt(self.eps + ms if self.eps_left else ms + self.eps)
        y = y.to(h.dtype) if self.cast_back == "to" else y.type_as(h) if self.cast_back == "type_as" else y
        if self.weight is None:
            return y
        return self.weight * y if self.weight_left else y * self.weight


class Norm(nn.Module):
    def __init__(self, n: int, form: str, affine: bool, eps, hand: tuple = ()):
        super().__init__()
        self.form, self.n, self.eps = form, n, eps
        self.weight = self.bias = None
        if form.startswith("nn.LayerNorm"):
            self.impl = nn.LayerNorm(n, eps=eps, elementwise_affine=affine, bias=form == "nn.LayerNorm")
        elif form == "nn.RMSNorm":
            self.impl = nn.RMSNorm(n, eps=eps, elementwise_affine=affine)
        elif form == "hand":
            self.impl = HandRMSNorm(n, eps if eps is not None else 1e-6, affine, *hand)
        elif form == "t5":
            self.impl = T5Norm(n, eps)
        elif form == "gemma":
            self.impl = GemmaNorm(n, eps)
        elif form.startswith("manual-ln"):
            self.impl = ManualLN(n, eps, var="mean" if form == "manual-ln" else "biased")
        elif affine:
            self.weight, self.bias = _affine(n, "layer" in form)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("weight") else 0.0))

    def forward(self, h):
        eps = self.eps
        if self.form == "F.layer_norm":
            return F.layer_norm(h, (self.n,), self.weight, self.bias, eps)
        if self.form == "torch.layer_norm":
            return torch.layer_norm(h, [self.n], self.weight, self.bias, eps)
        if self.form == "F.rms_norm":
            return F.rms_norm(h, (self.n,), self.weight, eps)
        if self.form == "torch.rms_norm":
            return torch.rms_norm(h, [self.n], self.weight, eps)
        return self.impl(h)


def _act(h, name: str):
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}[name](h)


class Layer(nn.Module):
    """One drawn layer; ``spec`` is the tuple the strategy drew (printed with a failing example)."""

    def __init__(self, spec: tuple, d: int):
        super().__init__()
        self.spec, self.kind = spec, spec[0]
        k = self.kind
        if k in ("linear", "linear_residual", "post"):
            self.lin = nn.Linear(d, spec[1], bias=spec[2])
        if k == "post":  # linear -> [+ residual] -> norm
            self.norm = Norm(spec[1], *spec[4])
        elif k == "norm":
            self.norm = Norm(d, *spec[1:])
        elif k == "norm_residual":
            self.norm = Norm(d, *spec[1:])
        elif k == "fanout":  # two linears on one tensor, combined
            self.a, self.b = nn.Linear(d, spec[1]), nn.Linear(d, spec[1], bias=False)
        elif k == "norm_fanout":  # one norm feeding two linears (q/k-style), combined
            self.norm = Norm(d, *spec[2])
            self.a, self.b = nn.Linear(d, spec[1]), nn.Linear(d, spec[1])

    def forward(self, h):
        k, s = self.kind, self.spec
        if k == "linear":
            return self.lin(h)
        if k == "post":
            z = self.lin(h)
            z = z + h if s[3] == "right" else h + z if s[3] == "left" else z
            return self.norm(z)
        if k == "linear_residual":  # h feeds the linear and the add
            return self.lin(h) + h if s[3] == "right" else h + self.lin(h)
        if k == "norm":
            return self.norm(h)
        if k == "norm_residual":  # the norm's input has another user
            return h + self.norm(h)
        if k == "act":
            return _act(h, s[1])
        if k == "fanout":
            a, b = self.a(h), self.b(h)
            return a + b if s[2] == "add" else a * F.silu(b)
        if k == "norm_fanout":
            y = self.norm(h)
            return self.a(y) + self.b(y)
        if k == "to3d":  # h is contiguous in 2-D (a transposed 3-D h is copied by to2d's reshape)
            return h.view(*s[1], h.shape[-1])
        if k == "to2d":
            return h.reshape(-1, h.shape[-1])
        if k == "transpose":
            return h.transpose(0, 1)
        raise AssertionError(k)


class Generated(nn.Module):
    def __init__(self, d0: int, specs: list):
        super().__init__()
        layers, d = [], d0
        for spec in specs:
            layers.append(Layer(spec, d))
            if spec[0] in ("linear", "post", "fanout", "norm_fanout"):
                d = spec[1]
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


# ---- the strategy --------------------------------------------------------------------------------------------


@st.composite
def norm_args(draw):
    """(form, affine, eps, hand-written variant) for ``Norm``."""
    form = draw(st.sampled_from(NORM_FORMS))
    eps = draw(st.sampled_from([1e-5, 1e-6, 1e-3] + ([None] if form in ("nn.RMSNorm", "F.rms_norm") else [])))
    hand = ()
    if form == "hand":
        hand = (draw(st.sampled_from(["pow", "square", "mul"])), draw(st.sampled_from(["none", "float", "to"])),
                draw(st.sampled_from(["none", "to", "type_as"])), draw(st.booleans()), draw(st.booleans()))
    return form, draw(st.booleans()), eps, hand


@st.composite
def models(draw):
    """(rows, 2-D or 3-D input, input width, layer specs)."""
    rows = draw(st.sampled_from(sorted(LEADS)))
    lead2, lead3 = LEADS[rows]
    three_d = start_3d = draw(st.booleans())
    d = draw(st.sampled_from(WIDTHS))
    d0, specs, transposed = d, [], False
    for _ in range(draw(st.integers(2, 6))):
        # The fusion targets first (Hypothesis starts from the first choices) and more often than the rest.
        kind = draw(st.sampled_from(["post", "norm_fanout", "post", "linear", "norm", "act", "linear_residual",
                                     "norm_residual", "fanout", "reshape", "norm_fanout", "act"]))
        if kind == "post":
            d_out = draw(st.sampled_from(WIDTHS))
            residual = draw(st.sampled_from([None, "left", "right"])) if d_out == d else None
            specs.append(("post", d_out, draw(st.booleans()), residual, draw(norm_args())))
            d = d_out
        elif kind == "linear":
            d_out = draw(st.sampled_from(WIDTHS))
            specs.append(("linear", d_out, draw(st.booleans())))
            d = d_out
        elif kind == "linear_residual":
            specs.append(("linear_residual", d, draw(st.booleans()), draw(st.sampled_from(["left", "right"]))))
        elif kind in ("norm", "norm_residual"):
            specs.append((kind, *draw(norm_args())))
        elif kind == "act":
            specs.append(("act", draw(st.sampled_from(ACTIVATIONS))))
        elif kind == "fanout":
            d = draw(st.sampled_from(WIDTHS))
            specs.append(("fanout", d, draw(st.sampled_from(["add", "gate"]))))
        elif kind == "norm_fanout":
            d_out = draw(st.sampled_from(WIDTHS))
            specs.append(("norm_fanout", d_out, draw(norm_args())))
            d = d_out
        elif three_d and not transposed and draw(st.booleans()):
            specs.append(("transpose",))
            transposed = True
        else:
            specs.append(("to2d",) if three_d else ("to3d", lead3))
            three_d, transposed = not three_d, False
    return rows, (lead3 if start_3d else lead2), d0, specs


# ---- the property --------------------------------------------------------------------------------------------


def _fwd_bwd(model: nn.Module, x: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype))
    return [out.detach()] + [p.grad for p in model.parameters()] + [x.grad]


def check_matches_eager(d0: int, specs: list, lead: tuple) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Generated(d0, specs)
    x = torch.randn(*lead, d0)
    ref = _fwd_bwd(copy.deepcopy(model).double(), x.double())
    eager = _fwd_bwd(copy.deepcopy(model), x)
    compiled_model = copy.deepcopy(model)
    got = _fwd_bwd(torch.compile(compiled_model, backend="fusenorm", dynamic=False), x)
    names = ["output"] + [f"grad {n}" for n, _ in model.named_parameters()] + ["grad input"]
    for name, r, e, g in zip(names, ref, eager, got):
        assert g is not None and e is not None, f"{name}: no gradient"
        assert g.shape == e.shape and g.dtype == e.dtype, f"{name}: {g.dtype}{tuple(g.shape)} vs {e.dtype}"
        bound = 2 * _err(e, r) + TOL[torch.float32]
        err = _err(g, r)
        assert err <= bound, f"{name}: error {err:.3g} vs float64 exceeds {bound:.3g} (eager {_err(e, r):.3g})"
    return model, x, got


def check_untouched(model: nn.Module, x: torch.Tensor, got: list) -> None:
    """Nothing fused: fusenorm's compile is plain Inductor's, bit for bit (outputs and every gradient)."""
    torch._dynamo.reset()
    plain = _fwd_bwd(torch.compile(copy.deepcopy(model), backend="inductor", dynamic=False), x)
    for i, (p, g) in enumerate(zip(plain, got)):
        assert torch.equal(p, g), f"result {i} differs from plain Inductor's with nothing fused"


# The two models found by this test, checked first: a norm's output saved for the backward and returned through a
# view was overwritten by the backward (stale example values after the rewrite made AOTAutograd donate it;
# fx_utils.refresh_values).
FOUND = [
    (257, (257,), 24, [("to3d", (1, 257)), ("post", 24, True, None, ("nn.RMSNorm", False, 1e-5, ())), ("to2d",)]),
    (257, (257,), 24, [("to3d", (1, 257)), ("norm", "nn.LayerNorm", False, 1e-3, ()), ("to2d",)]),
]
CHUNKS = 10  # the models are checked in this many tests (the run shows their progress), then summed up


def drawn_models() -> list:
    """FOUND, then MAX_EXAMPLES models drawn by Hypothesis, derandomized (the same models on every run). They are
    drawn first and compiled after, so that the checks can run in chunks of one shared, varied draw (each
    Hypothesis run starts over from the simplest models)."""
    specs = list(FOUND)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(models())
    def draw(model_spec):
        specs.append(model_spec)

    draw()
    assert len(specs) == len(FOUND) + MAX_EXAMPLES, len(specs)
    return specs


@pytest.fixture(scope="module")
def specs():
    return drawn_models()


@pytest.fixture(autouse=True)
def _scalar_cpp_kernels():
    """Scalar C++ kernels for Inductor's code on the CPU (fusenorm's and plain Inductor's alike): they compile in
    about half the time of vectorized ones, and how Inductor vectorizes is not what this property is about."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.simdlen": 1}):
        yield


# What each chunk saw: rewrites by pattern, the models where something fused and those left untouched; or the
# chunk's failure.
_SEEN: dict = {}


def _check_chunk(specs: list, chunk: int) -> None:
    fired: Counter = Counter()
    fused_examples, untouched = [], []
    _SEEN[chunk] = "failed"
    for rows, lead, d0, layer_specs in specs[chunk * len(specs) // CHUNKS:(chunk + 1) * len(specs) // CHUNKS]:
        try:
            before = Counter(counters["fusenorm"])
            model, x, got = check_matches_eager(d0, layer_specs, lead)
            new = Counter(counters["fusenorm"]) - before
            fired.update(new)
            if any(not k.startswith("canonical") for k in new):
                fused_examples.append(layer_specs)
            elif not new:  # no norm kept canonical either (each went back as written)
                untouched.append(layer_specs)
                check_untouched(model, x, got)
        except Exception as e:
            raise AssertionError(f"model {(rows, lead, d0, layer_specs)}: {e}") from e
    _SEEN[chunk] = (fired, fused_examples, untouched)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_models_match_eager(specs, chunk):
    _check_chunk(specs, chunk)


def test_random_models_exercise_fusenorm(specs):
    """The examples exercised fusenorm: every fusion and every canonical form fired, in most models (the chunks
    not checked yet in this session are checked here)."""
    for chunk in range(CHUNKS):
        if chunk not in _SEEN:
            _check_chunk(specs, chunk)
    failed = [chunk for chunk, seen in _SEEN.items() if seen == "failed"]
    assert not failed, f"chunks {failed} failed (test_random_models_match_eager)"
    fired: Counter = Counter()
    fused_examples, untouched = [], []
    for f, fused, still in _SEEN.values():
        fired.update(f)
        fused_examples += fused
        untouched += still
    patterns = ["linear_norm_fwd", "norm_linear_fwd", "dgrad_norm_bwd", "canonical_layer_norm", "canonical_rms_norm",
                "canonical_llama_rms_norm"]
    if MAX_EXAMPLES >= 100:  # drawn less often
        patterns += ["canonical_t5_rms_norm", "canonical_gemma_rms_norm", "canonical_manual_layer_norm"]
    for pattern in patterns:
        assert fired[pattern] > 0, f"no generated model had {pattern} applied: {dict(fired)}"
    assert len(fused_examples) >= MAX_EXAMPLES // 2, f"only {len(fused_examples)} of {MAX_EXAMPLES} models fused"
    if MAX_EXAMPLES >= 100:
        assert untouched, "no generated model was left untouched (the bitwise check never ran)"
