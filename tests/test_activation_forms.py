"""The dense FlashNormAttention form's activation, identified by structure (patterns/activation_forms.py).

Every chain fusenorm accepts must compute c * act(S) for every score, not only on a sampled range: generated
chains (random compositions of the elementwise ops users write, clamps and soft-caps included) are evaluated in
fp64 far outside any range a sampler would pick, and compared with what fusenorm would compute instead.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fusenorm_inductor.activations import act_reference
from fusenorm_inductor.patterns.activation_forms import identify_activation
from fusenorm_inductor.patterns.base import Reject


def _chain(fn):
    """(nodes, s, p) of ``fn``'s traced graph, as the pattern passes them."""
    graph = fx.symbolic_trace(fn).graph
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    s = next(n for n in graph.nodes if n.op == "placeholder")
    p = next(n for n in graph.nodes if n.op == "output").args[0]
    return nodes, s, p


def _scores() -> torch.Tensor:
    """Scores far past any sampled grid (the old check sampled [-40, 40]), plus the ordinary range."""
    wide = torch.cat([torch.linspace(-1e4, 1e4, 4001), torch.linspace(-60, 60, 2401)])
    return torch.cat([wide, torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 300]).double()


def _computes_the_same(fn, name: str, c: float) -> bool:
    x = _scores()
    with torch.no_grad():
        want = fn(x)
        got = c * act_reference(x, name)
    finite = torch.isfinite(want) & torch.isfinite(got)
    same_inf = (want == got) | finite  # an overflow must overflow the same way
    return bool(same_inf.all()) and torch.allclose(got[finite], want[finite], rtol=1e-9, atol=1e-12)


KNOWN = {
    "F.gelu * 0.5": (lambda s: F.gelu(s) * 0.5, ("gelu", 0.5)),
    "F.gelu tanh / sqrt(128)": (lambda s: F.gelu(s, approximate="tanh") / math.sqrt(128),
                                ("fast_gelu", 1 / math.sqrt(128))),
    "tanh GELU written out": (lambda s: 0.5 * s * (1.0 + torch.tanh(0.7978845608 * (s + 0.044715 * s * s * s))),
                              ("fast_gelu", 1.0)),
    "tanh GELU, pow and math": (lambda s: 0.5 * s * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                                   * (s + 0.044715 * torch.pow(s, 3.0)))),
                                ("fast_gelu", 1.0)),
    "erf GELU written out": (lambda s: s * 0.5 * (1 + torch.erf(s / math.sqrt(2.0))), ("gelu", 1.0)),
    "silu": (lambda s: s * torch.sigmoid(s) * 0.25, ("silu", 0.25)),
    "F.silu": (lambda s: F.silu(s), ("silu", 1.0)),
    "relu, scale before": (lambda s: torch.relu(s * 0.125), ("relu", 0.125)),
    "clamp_min": (lambda s: s.clamp_min(0.0) * 2, ("relu", 2.0)),
    "raw": (lambda s: s * 0.5, ("raw", 0.5)),
}

REJECTED = {
    "clamped GELU (the old check took it)": lambda s: F.gelu(torch.clamp(s, max=50.0)) * 0.5,
    "tanh soft-cap": lambda s: 30.0 * torch.tanh(s / 30.0),
    "soft-capped GELU": lambda s: F.gelu(30.0 * torch.tanh(s / 30.0)),
    "relu, negative scale before": lambda s: torch.relu(s * -0.125),
    "gelu of a scaled score": lambda s: F.gelu(2 * s),
    "exp": lambda s: torch.exp(s),
    "where": lambda s: torch.where(s > 0, s, 0.1 * s),
    "a bias": lambda s: F.gelu(s) + 1.0,
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_forms_are_recognized(name):
    fn, (act, c) = KNOWN[name]
    got_act, got_c = identify_activation(*_chain(fn))
    assert got_act == act and got_c == pytest.approx(c, rel=1e-12)
    assert _computes_the_same(fn, got_act, got_c)


@pytest.mark.parametrize("name", list(REJECTED))
def test_other_maps_are_rejected_with_a_reason(name):
    with pytest.raises(Reject, match="scores to P"):
        identify_activation(*_chain(REJECTED[name]))


# ---- generated chains ------------------------------------------------------------------------------------

_UNARY = [
    lambda x: torch.tanh(x), lambda x: torch.sigmoid(x), lambda x: torch.erf(x), lambda x: torch.relu(x),
    lambda x: F.gelu(x), lambda x: F.gelu(x, approximate="tanh"), lambda x: F.silu(x), lambda x: -x,
    lambda x: x * x, lambda x: torch.square(x), lambda x: x.clamp(min=-3.0), lambda x: x.clamp(max=50.0),
    lambda x: torch.clamp(x, -20.0, 20.0), lambda x: 30.0 * torch.tanh(x / 30.0), lambda x: torch.exp(x),
    lambda x: x.clamp_min(0.0), lambda x: x.sigmoid(), lambda x: x.tanh(), lambda x: torch.pow(x, 3.0),
]
_SCALES = [0.5, 0.125, 2.0, 1 / math.sqrt(128), 0.7978845608, -1.0, 3.0]


def _random_chain(rng: random.Random):
    """A random elementwise map of S: an activation (sometimes written out) with scales and shifts around it,
    or a random composition of 1-4 ops; each as the function a user would write."""
    steps = []
    if rng.random() < 0.4:  # the forms fusenorm should accept, perturbed now and then
        steps.append(rng.choice([lambda x: F.gelu(x), lambda x: F.gelu(x, approximate="tanh"), lambda x: F.silu(x),
                                 lambda x: torch.relu(x), lambda x: x * torch.sigmoid(x),
                                 lambda x: 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))]))
    else:
        steps += [rng.choice(_UNARY) for _ in range(rng.randint(1, 4))]
    for _ in range(rng.randint(0, 2)):
        c = rng.choice(_SCALES)
        where = rng.randint(0, len(steps))
        kind = rng.choice(["mul", "div", "add"])
        op = {"mul": lambda x, c=c: x * c, "div": lambda x, c=c: x / c, "add": lambda x, c=c: x + c}[kind]
        steps.insert(where, op)

    def fn(s):
        for step in steps:
            s = step(s)
        return s

    return fn


def test_generated_chains_accepted_only_where_equal():
    """500 generated chains: each one the check accepts computes c * act(S) at scores up to 1e4 (no sampled
    range); enough are accepted and enough rejected that both outcomes are exercised."""
    rng = random.Random(20261204)
    accepted = rejected = 0
    for i in range(500):
        fn = _random_chain(rng)
        try:
            act, c = identify_activation(*_chain(fn))
        except Reject:
            rejected += 1
            continue
        accepted += 1
        assert _computes_the_same(fn, act, c), f"chain {i} accepted as {c} * {act} but computes something else"
    assert accepted >= 100 and rejected >= 100, (accepted, rejected)
