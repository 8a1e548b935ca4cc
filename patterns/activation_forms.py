"""Which GDPA activation an elementwise chain of torch ops computes, read from its structure.

The dense FlashNormAttention form (attention_block.py) must know the map from the scores S to P. It used to
evaluate the chain on a grid of scores and compare: equality on samples is not equality of functions
(``F.gelu(torch.clamp(s, max=50.0)) * 0.5`` equals ``0.5 * gelu(s)`` on every sample up to 40 and differs
beyond 50). Here the chain becomes a sympy expression in S (each op by its definition: ``torch.sigmoid(x)`` is
``1 / (1 + exp(-x))``, ``F.gelu(x)`` is ``x/2 (1 + erf(x/sqrt 2))``, ``clamp`` is ``Min``/``Max``, ...), its
float constants are read exactly or as the closed forms they approximate to 1e-9 (``0.7978845608`` is sqrt(2/pi)), and
it is accepted only where ``expression / (act(S))`` simplifies to a number c for one activation of
``fusenorm_inductor.activations``: P = c * act(S) for every S. Anything else (a clamp, a tanh soft-cap,
``where``, an op not listed here, a tensor constant) is rejected with the reason.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import sympy
import torch
import torch.nn.functional as F
from torch.fx import Node

from .base import Reject

S = sympy.Symbol("s", real=True)


def _sigmoid(x):
    return 1 / (1 + sympy.exp(-x))


def _gelu(x, approximate: str = "none"):
    if approximate == "tanh":
        return x / 2 * (1 + sympy.tanh(sympy.sqrt(2 / sympy.pi) * (x + sympy.Rational(44715, 1000000) * x**3)))
    if approximate != "none":
        raise Reject(f"gelu(approximate={approximate!r}) is not a GDPA activation")
    return x / 2 * (1 + sympy.erf(x / sympy.sqrt(2)))


def _relu(x):
    return sympy.Max(x, 0)


# What each activation name of fusenorm_inductor.activations computes (its torch reference, written in sympy).
TARGETS = {
    "fast_gelu": _gelu(S, "tanh"),
    "gelu": _gelu(S),
    "silu": S * _sigmoid(S),
    "relu": _relu(S),
    "raw": S,
}


def _clamp(x, lo=None, hi=None):
    if lo is not None:
        x = sympy.Max(x, lo)
    if hi is not None:
        x = sympy.Min(x, hi)
    return x


def _add(a, b, alpha=1):
    return a + alpha * b


def _sub(a, b, alpha=1):
    return a - alpha * b


def _div(a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise Reject(f"a division with rounding_mode={rounding_mode!r} is not a GDPA activation")
    return a / b


# torch functions and tensor methods -> their sympy definition (positional args, then the kwargs they take).
_FUNCTIONS: dict[Any, Callable] = {
    operator.add: _add, torch.add: _add, operator.sub: _sub, torch.sub: _sub,
    operator.mul: operator.mul, torch.mul: operator.mul, operator.truediv: _div, torch.div: _div,
    operator.neg: operator.neg, torch.neg: operator.neg, operator.pow: operator.pow, torch.pow: operator.pow,
    torch.tanh: sympy.tanh, F.tanh: sympy.tanh, torch.erf: sympy.erf, torch.exp: sympy.exp,
    torch.sigmoid: _sigmoid, F.sigmoid: _sigmoid, torch.relu: _relu, F.relu: _relu,
    torch.clamp: _clamp, torch.clamp_min: lambda x, lo: sympy.Max(x, lo), torch.square: lambda x: x**2,
    F.gelu: _gelu, torch._C._nn.gelu: _gelu, F.silu: lambda x, inplace=False: x * _sigmoid(x),
}
_METHODS: dict[str, Callable] = {
    "add": _add, "__add__": _add, "__radd__": lambda a, b: b + a, "sub": _sub, "__sub__": _sub,
    "__rsub__": lambda a, b: b - a, "mul": operator.mul, "__mul__": operator.mul, "__rmul__": operator.mul,
    "div": _div, "__truediv__": _div, "__rtruediv__": lambda a, b: b / a, "neg": operator.neg,
    "__neg__": operator.neg, "pow": operator.pow, "__pow__": operator.pow, "tanh": sympy.tanh, "erf": sympy.erf,
    "exp": sympy.exp, "sigmoid": _sigmoid, "relu": _relu, "clamp": _clamp,
    "clamp_min": lambda x, lo: sympy.Max(x, lo), "square": lambda x: x**2,
}
# Keyword names as torch spells them -> the sympy helpers' parameter names.
_KWARGS = {"min": "lo", "max": "hi", "alpha": "alpha", "approximate": "approximate", "rounding_mode": "rounding_mode",
           "exponent": None, "other": None, "inplace": "inplace"}


# Closed forms the activations' constants are written as (math.sqrt(2 / math.pi), 0.7978845608, 0.044715, their
# product folded into one literal, 1 / math.sqrt(2), ...).
_KNOWN = [sympy.sqrt(2 / sympy.pi), sympy.Rational(44715, 1000000), sympy.sqrt(2 / sympy.pi) * sympy.Rational(44715, 1000000),
          1 / sympy.sqrt(2), sympy.sqrt(2), 1 / sympy.sqrt(2 * sympy.pi), sympy.pi, sympy.E]


def _constant(v: Any) -> sympy.Expr:
    """A Python number as sympy reads it: one of ``_KNOWN`` where within 1e-9 relative of it (the same constant
    written with fewer digits, or computed), else its exact value (a float is a binary fraction)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Reject(f"the map from the scores to P uses {type(v).__name__} {v!r}, not a number")
    if isinstance(v, int):
        return sympy.Integer(v)
    if v != v or v in (float("inf"), float("-inf")):
        raise Reject(f"the map from the scores to P uses the constant {v!r}")
    for k in _KNOWN:
        for signed in (k, -k):
            if abs(v - float(signed)) <= 1e-9 * abs(v):
                return signed
    return sympy.Rational(v)


def _term(a: Any, env: dict[Node, sympy.Expr]) -> Any:
    if isinstance(a, Node):
        if a not in env:
            raise Reject(f"the map from the scores to P reads {a.op} {a.name}, which is neither the scores nor "
                         f"computed from them")
        return env[a]
    if isinstance(a, str) or a is None:
        return a
    return _constant(a)


def _node_expr(n: Node, env: dict[Node, sympy.Expr]) -> sympy.Expr:
    if n.op == "call_function":
        fn = _FUNCTIONS.get(n.target)
    elif n.op == "call_method":
        fn = _METHODS.get(n.target)
    else:
        fn = None
    name = getattr(n.target, "__name__", n.target)
    if fn is None:
        raise Reject(f"the map from the scores to P uses {n.op} {name}, which is not one of the elementwise ops "
                     f"a GDPA activation is recognized from")
    args = [_term(a, env) for a in n.args]
    kwargs = {}
    for k, v in n.kwargs.items():
        if k not in _KWARGS:
            raise Reject(f"the map from the scores to P calls {name} with {k}=, which is not recognized")
        if k == "inplace" or (k == "approximate" and v == "none"):
            continue
        if k in ("exponent", "other"):
            args.append(_term(v, env))
        else:
            kwargs[_KWARGS[k]] = _term(v, env)
    try:
        return sympy.sympify(fn(*args, **kwargs))
    except Reject:
        raise
    except (TypeError, ValueError) as e:
        raise Reject(f"the map from the scores to P calls {name} in a form not recognized ({e})") from None


def _pull_scale_out_of_relu(e: sympy.Expr) -> sympy.Expr:
    """Max(k*x, 0) = k * Max(x, 0) for a number k > 0 (a positive scale before relu is one after it)."""
    def is_scaled_relu(m) -> bool:
        if not (isinstance(m, sympy.Max) and len(m.args) == 2 and sympy.S.Zero in m.args):
            return False
        inner = next(a for a in m.args if a != 0)
        k, _ = inner.as_coeff_Mul()
        return k.is_number and k.is_positive and k != 1

    def pull(m):
        inner = next(a for a in m.args if a != 0)
        k, rest = inner.as_coeff_Mul()
        return k * sympy.Max(rest, 0)

    return e.replace(is_scaled_relu, pull)


def chain_expression(nodes: list[Node], s: Node, p: Node) -> sympy.Expr:
    """P as a sympy expression of the scores (the symbol ``S``): ``nodes`` in graph order, from s to p."""
    env: dict[Node, sympy.Expr] = {s: S}
    for n in nodes:
        env[n] = _node_expr(n, env)
    if p not in env:
        raise Reject("P is not computed from the scores by the elementwise chain")
    return env[p]


def _functions(e: sympy.Expr) -> set:
    """The kinds of function in e (tanh, erf, exp, Max, Min, ...): two expressions with different kinds can
    be equal only in degenerate cases, which simplify would have to rule out slowly; they count as different."""
    return {type(f) for f in e.atoms(sympy.Function, sympy.Max, sympy.Min)}


# Scores at which a candidate's ratio is evaluated before simplify is asked to prove it constant: a ratio that
# differs between two of them proves the map is not c * act(S) (a counterexample is proof; agreeing samples are
# not, so a ratio that agrees still has to simplify to a number).
_WITNESSES = (-7.3, -2.1, -0.37, 0.61, 1.9, 4.4, 13.0, 61.0)


def _differ_somewhere(expr: sympy.Expr, target: sympy.Expr) -> bool:
    ratios = []
    for v in _WITNESSES:
        num, den = (complex(e.subs(S, v).evalf(30)) for e in (expr, target))
        if den == 0 or num == 0:
            if (den == 0) != (num == 0):
                return True
            continue
        r = num / den
        if r.imag != 0 or not math.isfinite(r.real):
            return True
        ratios.append(r.real)
    return any(abs(r - ratios[0]) > 1e-9 * max(abs(ratios[0]), 1e-300) for r in ratios[1:])


def identify(expr: sympy.Expr) -> tuple[str, float]:
    """(activation name, c) with expr == c * act(S) for every S, or Reject."""
    expr = _pull_scale_out_of_relu(sympy.expand(expr, deep=True))
    if S not in expr.free_symbols:
        raise Reject("P does not depend on the scores")
    kinds = _functions(expr)
    for name, target in TARGETS.items():
        target = sympy.expand(target, deep=True)
        if _functions(target) != kinds:
            continue
        if _differ_somewhere(expr, target):
            continue
        ratio = sympy.simplify(expr / target)
        if ratio.is_number and ratio.is_real and ratio != 0:
            c = float(ratio)
            if c == c and abs(c) != float("inf"):
                return name, c
    raise Reject(f"the elementwise map from the scores to P, {sympy.sstr(expr)[:160]}, is none of the activations "
                 f"{', '.join(TARGETS)} times a constant for every score (a clamp, a soft-cap or a where changes "
                 f"it somewhere)")


def identify_activation(nodes: list[Node], s: Node, p: Node) -> tuple[str, float]:
    """Name and scale of the elementwise map S -> P built by ``nodes`` (in graph order)."""
    return identify(chain_expression(nodes, s, p))
