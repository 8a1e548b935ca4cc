"""``attention_block`` / ``attention_block_dense``: the FlashNormAttention (PFFN) block becomes one
``fusenorm::flash_norm_attention`` call (docs/algorithms.md section 5)::

    ln_q = LayerNorm_{H*D}(q)            # over all heads of a token; affine optional
    o    = act(ln_q K^T) * scale @ V + ln_q
    out  = RMSNorm_{H*D}(o) [* g] + q

Stage: **pre-grad** (Dynamo's torch-level graph), right after the canonical-norm patterns. The block is
rewritten before autograd, so its backward is the fused op's registered autograd: nothing in the backward
has to be found or rewired (on the joint graph the GDPA's and both norms' backward nodes would have to be
matched and replaced consistently, for no gain: the fused op saves what its backward needs). The norms are
already canonical ``fusenorm::norm`` nodes here (``canonical_norms.py`` runs first), so every LayerNorm /
RMSNorm form users write (nn.LayerNorm, F.layer_norm, nn.RMSNorm, F.rms_norm, the hand-written LLaMA
RMSNorm) is one node. A canonical norm taken by this pattern never reaches the joint-graph patterns.

Two forms:

- ``attention_block`` (anchor: a ``fusenorm::gdpa`` node): q ``[T, H, D]`` jagged; the LayerNorm reads a
  reshape of q to ``[T, H*D]``, its output is viewed ``[T, H, D]`` for the GDPA and for the first residual;
  ``gdpa(...) + ln_q`` is reshaped to ``[T, H*D]`` for the RMSNorm, whose output, reshaped, is added to q.
  Rewritten to ``flash_norm_attention`` with the GDPA's own offsets, max length, activation and scale.
- ``attention_block_dense`` (anchor: the score product ``S = ln_q K^T``, an ``einsum`` or a ``matmul`` of
  permuted operands): the dense padded composite of the baselines, q ``[B, L, H, D]``, k/v ``[B, S, H, D]``;
  the operands' layouts are checked semantically (einsum subscripts composed with any permute/transpose), so
  ``einsum("blhd,bshd->bhls")`` and ``ln.transpose(1, 2) @ k.permute(0, 2, 3, 1)`` are both recognized. The
  elementwise chain from S to P is identified numerically: it must be built from elementwise torch ops of S
  and constants only, and equal ``c * act(S)`` for every S, read from its structure (activation_forms.py: the
  chain as a sympy expression, compared with each activation's definition) for one activation name of
  ``fusenorm_inductor/activations.py`` and one constant c (the scale): the tanh-form GELU written out,
  ``F.gelu(approximate="tanh")``, ``F.gelu``, ``F.silu``, ``F.relu``, none ("raw"), with the scale after
  (before, too, for relu and raw, where it is the same function); a clamp, a soft-cap or any other op is
  rejected with the reason. Rewritten with q viewed ``[B*L, H, D]`` and offsets
  ``arange(B + 1) * L``: every padded row is computed, like the original, so the result is the same.
  A padding mask multiplied into o after the first residual (``o = o * mask[..., None, None]``) is kept
  exactly when the mask is boolean (``out = where(mask, fused, q)``: a zeroed row's RMSNorm is 0, its output
  is q, and its gradients reach q only, as in the original). A float mask, or a mask on the scores, is left
  alone and reported (a non-binary mask scales the RMSNorm's input, which the op cannot express).

Left alone and reported with the reason: a norm over D only (per head) instead of H*D; an RMSNorm before /
a LayerNorm after; softmax (or any non-elementwise op) instead of the activation; a residual that is not
ln_q / q; dtype changes inside the block; dynamic shapes (the norms are not canonicalized: left to
Inductor); partial blocks (LayerNorm -> GDPA only, or GDPA -> + residual -> RMSNorm only: no fused op for
them yet).
"""

from __future__ import annotations

import importlib
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx import Node

from fusenorm_inductor import config, fx_utils
from fusenorm_inductor.fx_utils import val
from fusenorm_inductor.report import GraphReport

from .activation_forms import identify_activation
from .base import Pattern, Reject, bind_op_args, describe, require

for _mod in ("gdpa", "flash_norm_attention"):  # the modules register the ops on import
    try:
        importlib.import_module(f"fusenorm_inductor.ops.{_mod}")
    except ModuleNotFoundError as e:  # pragma: no cover - only while the op modules are being written
        if e.name != f"fusenorm_inductor.ops.{_mod}":
            raise

NORM = torch.ops.fusenorm.norm.default
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _op(name: str):
    """``torch.ops.fusenorm.<name>.default``, or None when the op is not registered."""
    try:
        return getattr(torch.ops.fusenorm, name).default
    except (AttributeError, RuntimeError):
        return None


# ---- recognizing torch-level nodes (Dynamo graphs mix call_method and call_function) -------------------


def _is(node: Any, methods: Iterable[str], *functions) -> bool:
    if not isinstance(node, Node):
        return False
    return (node.op == "call_method" and node.target in tuple(methods)) or (
        node.op == "call_function" and node.target in functions
    )


_RESHAPE_METHODS = ("view", "reshape", "contiguous", "flatten", "unflatten")
_RESHAPE_FNS = (torch.reshape, torch.flatten, torch.unflatten, torch.ops.aten.view.default,
                torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
_PERM_METHODS = ("permute", "transpose", "contiguous")
_PERM_FNS = (torch.permute, torch.transpose)


def _is_reshape(n: Any) -> bool:
    """A row-major reshape (view/reshape/flatten/unflatten/contiguous): logical element order kept.
    ``x.view(dtype)`` is a bitcast, not a reshape."""
    if not _is(n, _RESHAPE_METHODS, *_RESHAPE_FNS):
        return False
    return not any(isinstance(a, torch.dtype) for a in n.args[1:])


def _is_add(n: Any) -> bool:
    return _is(n, ("add",), operator.add, torch.add) and len(n.args) == 2 and not n.kwargs


def _strip_reshapes(n: Any) -> tuple[Any, list[Node]]:
    """The tensor ``n`` reshapes (through any chain of reshapes), and the chain."""
    chain = []
    while _is_reshape(n):
        chain.append(n)
        n = n.args[0]
    return n, chain


def _strip_perms(n: Any) -> tuple[Any, list[int], list[Node]]:
    """``n == base.permute(perm)`` through permute/transpose/contiguous; returns (base, perm, chain)."""
    perm: Optional[list[int]] = None
    chain = []
    while _is(n, _PERM_METHODS, *_PERM_FNS):
        base = n.args[0]
        rank = val(base).dim()
        if n.target in ("contiguous",):
            step = list(range(rank))
        elif n.target in ("permute", torch.permute):
            dims = n.args[1:]
            dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else list(dims)
            dims = dims or list(n.kwargs.get("dims", []))
            step = [d % rank for d in dims]
        else:  # transpose(a, b)
            a, b = (n.args[1], n.args[2]) if len(n.args) >= 3 else (n.kwargs["dim0"], n.kwargs["dim1"])
            step = list(range(rank))
            step[a % rank], step[b % rank] = step[b % rank], step[a % rank]
        # result = base.permute(step); previous result = result.permute(perm) = base.permute(step[perm])
        perm = step if perm is None else [step[p] for p in perm]
        chain.append(n)
        n = base
    if perm is None:
        v = val(n)
        perm = list(range(v.dim())) if isinstance(v, torch.Tensor) else []
    return n, perm, chain


def _norm_of(n: Any) -> Optional[Node]:
    """The canonical norm whose output ``n`` is (``getitem(norm, 0)``), else None."""
    if (isinstance(n, Node) and n.op == "call_function" and n.target is operator.getitem
            and n.args[1] == 0 and isinstance(n.args[0], Node) and n.args[0].target is NORM):
        return n.args[0]
    return None


# ---- products: einsum or matmul, as (subscripts of each base operand, subscripts of the result) ---------

_NORM_CALLS = tuple(f for f in (F.layer_norm, torch.layer_norm, getattr(F, "rms_norm", None), torch.rms_norm)
                    if f is not None)
_EINSUM = tuple(f for f in (torch.einsum, getattr(torch.functional, "einsum", None)) if f is not None)
_MATMUL = (operator.matmul, torch.matmul)


def _product(n: Any) -> Optional[tuple[list[Node], list[str], str, list[Node]]]:
    """A two-operand contraction: (base operands, their subscripts, the result's subscripts, permute nodes
    stripped). Permutes of the operands are folded into the subscripts."""
    if _is(n, (), *_EINSUM):
        eq, *ops = n.args
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        if not isinstance(eq, str) or "..." in eq or "->" not in eq or len(ops) != 2:
            return None
        lhs, out = eq.replace(" ", "").split("->")
        subs = lhs.split(",")
    elif _is(n, ("matmul",), *_MATMUL) and len(n.args) == 2:
        ops = list(n.args)
        if any(not isinstance(val(o), torch.Tensor) or val(o).dim() != 4 for o in ops):
            return None
        subs, out = ["zyab", "zybc"], "zyac"
    else:
        return None
    if len(subs) != 2 or any(len(s) != 4 or len(set(s)) != 4 for s in subs) or len(out) != 4:
        return None
    bases, base_subs, stripped = [], [], []
    for o, s in zip(ops, subs):
        if not isinstance(o, Node):
            return None
        b, perm, chain = _strip_perms(o)
        bs = [""] * 4
        for i, p in enumerate(perm):  # operand dim i is base dim perm[i]
            bs[p] = s[i]
        bases.append(b)
        base_subs.append("".join(bs))
        stripped += chain
    return bases, base_subs, out, stripped


# ---- the elementwise activation between the scores and P ---------------------------------------------

_ELEMENTWISE_FNS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
                    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.tanh, torch.erf,
                    torch.sigmoid, torch.exp, torch.relu, torch.clamp, torch.clamp_min, torch.square,
                    F.gelu, F.silu, F.relu, torch._C._nn.gelu, torch.nn.functional.tanh, torch.nn.functional.sigmoid}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "pow", "tanh", "erf", "sigmoid", "exp", "relu",
                        "clamp", "clamp_min", "square", "__mul__", "__add__", "__rmul__", "__radd__"}
_SOFTMAX = ("softmax", "log_softmax")
_SOFTMAX_FNS = (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax, torch._softmax)


def _rms_after(o: Node) -> bool:
    """``o`` -> + residual -> reshapes -> a canonical RMSNorm (the tail of a block without its LayerNorm)."""
    add = fx_utils.single_user(o)
    nxt = fx_utils.single_user(add) if _is_add(add) else None
    while _is_reshape(nxt):
        nxt = fx_utils.single_user(nxt)
    return isinstance(nxt, Node) and nxt.target is NORM and bind_op_args(nxt)["is_rms"]


def _unique(nodes: list[Node]) -> list[Node]:
    return list(dict.fromkeys(nodes))


# ---- what a match holds -----------------------------------------------------------------------------


@dataclass
class BlockMatch:
    form: str
    q: Node  # the tensor the LayerNorm reads (through reshapes) and the second residual adds
    thd: tuple[int, int, int]  # the op's q shape [T, H, D]
    k: Node
    v: Node
    offsets: Optional[Node]  # None: dense, offsets arange(B + 1) * L are built
    max_len: int
    activation: str
    scale: float
    ln: Node
    rms: Node
    final: Node  # the second residual add; the op's output replaces it
    mask: Optional[Node] = None  # a boolean [B, L] (or broadcastable) padding mask on o
    interior: list[Node] = field(default_factory=list)  # nodes replaced (erased once unused)


class _BlockPattern(Pattern):
    stage = "pre_grad"
    switch = "patterns.attention_block"

    # ---- the part both forms share: LayerNorm before, residual + RMSNorm + residual after -------------
    def head(self, ln4: Any, shape4: tuple[int, ...], o: Optional[Node] = None) -> tuple[Node, Node, list[Node]]:
        """``ln4`` (the product's left operand, ``shape4`` = [..., H, D]) is a reshape of a LayerNorm over
        the H*D features of a token of q; returns (norm, q, interior nodes). ``o``: the attention output,
        to tell a partial block from a lone attention in the report."""
        base, chain = _strip_reshapes(ln4)
        norm = _norm_of(base)
        h, d = shape4[-2], shape4[-1]
        if norm is None:
            raise Reject(f"partial block (GDPA -> + residual -> RMSNorm only; q comes from {describe(base)}, "
                         "not from a LayerNorm over the heads): not fused yet" if o is not None and _rms_after(o)
                         else f"no LayerNorm over the heads before the attention (q comes from {describe(base)}) "
                         "and no RMSNorm after it: nothing to fuse")
        a = bind_op_args(norm)
        require(not a["is_rms"], "the norm before the attention is an RMSNorm (the fused op takes a LayerNorm)")
        xv = val(a["x"])
        require(xv.shape[-1] == h * d,
                f"LayerNorm over {xv.shape[-1]} features (per head, D={d}), not over all heads (H*D={h * d}): "
                "not fused")
        require(xv.numel() == math.prod(shape4), "LayerNorm rows are not the attention's query rows")
        q, _ = _strip_reshapes(a["x"])
        require(isinstance(q, Node) and val(q).numel() == xv.numel(), "LayerNorm input is not a reshape of q")
        self.check_dtypes(norm, a)
        return norm, q, [*chain, base, norm]

    def tail(self, o: Node, shape4: tuple[int, ...], ln_norm: Node, q: Node, allow_mask: bool
             ) -> tuple[Node, Node, Optional[Node], list[Node]]:
        """From the attention output ``o`` (``shape4``): ``+ ln_q``, [bool mask], reshape, RMSNorm over H*D,
        reshape, ``+ q``. Returns (rms norm, final add, mask, interior nodes)."""
        h, d = shape4[-2], shape4[-1]
        add1 = fx_utils.single_user(o)
        if not _is_add(add1):
            raise Reject(f"partial block (LayerNorm -> GDPA only; its output goes to {describe(add1)}): "
                         "not fused yet" if add1 is not None else
                         "partial block (LayerNorm -> GDPA only; its output has several users): not fused yet")
        r = add1.args[1] if add1.args[0] is o else add1.args[0]
        rbase, rchain = _strip_reshapes(r)
        require(_norm_of(rbase) is ln_norm and tuple(val(r).shape) == tuple(shape4),
                f"the first residual is not ln_q (it is {describe(rbase)}): not fused")
        interior = [add1, *rchain]
        cur, mask = add1, None
        nxt = fx_utils.single_user(cur)
        if _is(nxt, ("mul",), operator.mul, torch.mul) and len(nxt.args) == 2:
            mask = nxt.args[1] if nxt.args[0] is cur else nxt.args[0]
            mask = self.check_mask(mask, shape4, allow_mask)
            interior.append(nxt)
            cur = nxt
        x_rms, chain = cur, []
        nxt = fx_utils.single_user(cur)
        while _is_reshape(nxt):
            chain.append(nxt)
            nxt = fx_utils.single_user(nxt)
        rms = nxt if isinstance(nxt, Node) and nxt.target is NORM else None
        if rms is None:
            raise Reject("partial block (LayerNorm -> GDPA -> + ln_q, no RMSNorm over the heads after it): "
                         "not fused yet")
        a = bind_op_args(rms)
        x_rms = a["x"]
        require(a["is_rms"], "the norm after the attention is a LayerNorm (the fused op takes an RMSNorm)")
        xv = val(x_rms)
        require(xv.shape[-1] == h * d,
                f"RMSNorm over {xv.shape[-1]} features (per head, D={d}), not over all heads (H*D={h * d}): "
                "not fused")
        self.check_dtypes(rms, a)
        interior += [*chain, rms]
        ys = [u for u in rms.users]
        require(len(ys) == 1 and ys[0].target is operator.getitem and ys[0].args[1] == 0,
                "the RMSNorm's statistics are used")
        y = ys[0]
        interior.append(y)
        nxt = fx_utils.single_user(y)
        while _is_reshape(nxt):
            interior.append(nxt)
            nxt = fx_utils.single_user(nxt)
        require(_is_add(nxt), f"the RMSNorm's output is not added to q (it goes to {describe(nxt)}): not fused")
        other = nxt.args[1] if nxt.args[0] is interior[-1] else nxt.args[0]
        obase, ochain = _strip_reshapes(other)
        require(obase is q and tuple(val(other).shape) == tuple(val(nxt).shape),
                f"the second residual is not q (it is {describe(obase)}): not fused")
        require(val(nxt).dtype == val(q).dtype, f"the block's output dtype {val(nxt).dtype} is not q's")
        return rms, nxt, mask, interior + ochain

    def check_mask(self, mask: Any, shape4: tuple[int, ...], allow: bool) -> Node:
        """A boolean per-row padding mask ``[B, L, 1, 1]`` (through reshapes / indexing of a [B, L] mask)."""
        require(allow, "a mask multiplies o: not supported in this form")
        mv = val(mask)
        require(isinstance(mask, Node) and isinstance(mv, torch.Tensor),
                "o is scaled by a constant after the first residual: not fused")
        require(mv.dtype == torch.bool,
                f"padding mask of dtype {mv.dtype}: only a boolean mask keeps the block's semantics exactly "
                "(a non-binary factor scales the RMSNorm's input): not fused")
        ms = tuple(mv.shape)
        require(len(ms) == 4 and ms[2:] == (1, 1) and ms[:2] == tuple(shape4[:2]),
                f"mask of shape {ms} is not one value per query row [B, L, 1, 1]: not fused")
        return mask

    def check_dtypes(self, norm: Node, a: dict) -> None:
        """fp32/fp16/bf16, no dtype change in the norm (autocast's fp32 norms stay unfused)."""
        xv = val(a["x"])
        require(xv.dtype in FLOATS, f"dtype {xv.dtype} not supported")
        require((a["out_dtype"] or xv.dtype) == xv.dtype,
                f"the norm changes the dtype ({xv.dtype} -> {a['out_dtype']}): not fused")

    def check_users(self, interior: list[Node], keep: set[Node]) -> None:
        """Nothing outside the block reads an intermediate (the fused op never writes them)."""
        inside = set(interior) | keep
        for n in interior:
            others = fx_utils.users_outside(n, inside)
            if others:
                raise Reject(f"{n.name} (inside the block) has another user ({others[0].name}): not fused")

    def check_inference(self, q: Node, k: Node, v: Node, norm: Node, rms: Node, why: str) -> None:
        """Unless config.patterns.attention_block_training is set, the block is fused only where no gradient
        is needed: its fused backward is slower than what it replaces on the H200 (``why``). Gradients are
        needed when grad mode is on while compiling (the pass runs inside the caller's no_grad /
        inference_mode) and an input requires them (parameters do even under no_grad)."""
        if config.patterns.attention_block_training or not torch.is_grad_enabled():
            return
        grads = [n.name for n in (q, k, v, bind_op_args(norm)["weight"], bind_op_args(rms)["weight"])
                 if isinstance(n, Node) and getattr(val(n), "requires_grad", False)]
        require(not grads, f"gradients needed ({', '.join(grads)}): {why}, so the block is fused for inference "
                "only (config.patterns.attention_block_training = True fuses it anyway)")

    def fused_op(self):
        op = _op("flash_norm_attention")
        require(op is not None, "fusenorm::flash_norm_attention is not available")
        return op

    def check_op_accepts(self, m: BlockMatch) -> None:
        """The fused op's own checks (its fake implementation) accept the block's shapes and dtypes (e.g. a
        KV length over its short-KV limit, weights of another dtype): otherwise left alone, with its message."""
        ln, rms = bind_op_args(m.ln), bind_op_args(m.rms)
        qv = val(m.q)
        mode = fx_utils.fake_mode_of(m.final.graph, [m.q])
        b = val(m.k).shape[0]
        try:
            with mode:
                off = val(m.offsets) if m.offsets is not None else torch.empty(b + 1, dtype=torch.int32,
                                                                                 device=qv.device)
                self.fused_op()(qv.reshape(m.thd), val(m.k), val(m.v), off, m.max_len, val(ln["weight"]),
                                val(ln["bias"]), val(rms["weight"]), float(ln["eps"]), float(rms["eps"]),
                                m.activation, float(m.scale))
        except (ValueError, RuntimeError, TypeError) as e:
            raise Reject(f"fusenorm::flash_norm_attention does not take this block: {e}")

    # ---- rewrite ---------------------------------------------------------------------------------------
    def rewrite(self, graph: fx.Graph, m: BlockMatch, rep: GraphReport) -> None:
        fna = self.fused_op()
        ln, rms = bind_op_args(m.ln), bind_op_args(m.rms)
        t, h, d = m.thd
        qv = val(m.q)
        final_shape = list(val(m.final).shape)
        with graph.inserting_before(m.final):
            q3 = fx_utils.reshape(graph, m.q, [t, h, d])
            offsets = m.offsets
            if offsets is None:  # dense: B sequences of L rows each
                b = val(m.k).shape[0]
                offsets = fx_utils.call(graph, torch.arange, 0, b * m.max_len + 1, m.max_len,
                                        dtype=torch.int32, device=qv.device)
            # Offsets built here are valid by construction: no host read of them per call (a device sync).
            fused = fx_utils.call(graph, fna, q3, m.k, m.v, offsets, m.max_len, ln["weight"], ln["bias"],
                                  rms["weight"], float(ln["eps"]), float(rms["eps"]), m.activation,
                                  float(m.scale), m.offsets is not None)
            out = fx_utils.call(graph, operator.getitem, fused, 0)
            out = fx_utils.reshape(graph, out, final_shape)
            if m.mask is not None:
                lead = next(i for i in range(len(final_shape) + 1) if math.prod(final_shape[:i]) == t)
                mask = fx_utils.reshape(graph, m.mask, final_shape[:lead] + [1] * (len(final_shape) - lead))
                q_f = fx_utils.reshape(graph, m.q, final_shape)
                out = fx_utils.call(graph, torch.where, mask, out, q_f)
        out.meta.update({k: v for k, v in m.final.meta.items() if k in ("stack_trace", "nn_module_stack")})
        m.final.replace_all_uses_with(out)
        graph.erase_node(m.final)
        fx_utils.erase_if_unused(graph, reversed(m.interior))
        fx_utils.erase_if_unused(graph, _strip_reshapes(ln["x"])[1])  # q's reshape for the LayerNorm
        rep.rewrite(
            self.name, self.stage, [m.ln.name, m.rms.name, m.final.name],
            {"T": t, "H": h, "D": d, "k": list(val(m.k).shape), "q": list(qv.shape)}, qv.dtype,
            "fusenorm::flash_norm_attention",
            f"form {m.form}, activation={m.activation}, scale={m.scale:.6g}, "
            f"ln affine={'weight' if ln['weight'] is not None else 'no'}"
            f"{'+bias' if ln['bias'] is not None else ''}, rms weight={'yes' if rms['weight'] is not None else 'no'}"
            f"{', bool padding mask kept as where(mask, out, q)' if m.mask is not None else ''}",
        )


class FlashNormAttentionGdpa(_BlockPattern):
    """LayerNorm_{H*D}(q) -> ``fusenorm::gdpa`` -> + ln_q -> RMSNorm_{H*D} -> + q, q jagged ``[T, H, D]``."""

    name = "attention_block"
    # After the canonical norms: it matches fusenorm::norm nodes; the norms it takes are gone before the
    # prospects step and the joint-graph patterns.
    order = 20

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        gdpa = _op("gdpa")
        return [] if gdpa is None else [n for n in graph.nodes if n.op == "call_function" and n.target is gdpa]

    @staticmethod
    def check_gluon_gdpa(qv, kv) -> None:
        """Where the unfused ``fusenorm::gdpa`` runs the sm_90 Gluon forward, the block stays unfused: GDPA with
        Inductor's norms measures faster than the fused block there, in the forward at H >= 2 and in the
        backward at most shapes (benchmarks/results/flash_norm_attention_h200.json)."""
        from ..kernels.triton.gdpa import gluon_unsupported

        require(gluon_unsupported(qv, kv) is not None,
                "the unfused GDPA runs the sm_90 Gluon kernel here: with Inductor's norms it measures faster than "
                "the fused block")

    def match(self, g: Node) -> BlockMatch:
        a = bind_op_args(g)
        qv = val(a["q"])
        require(fx_utils.is_static(qv, val(a["k"]), val(a["v"]), val(g)), "dynamic shapes: left to Inductor")
        shape4 = tuple(qv.shape)
        require(len(shape4) == 3, f"GDPA q of shape {shape4} is not [T, H, D]")
        norm, q, head = self.head(a["q"], shape4, g)
        rms, final, _, tail = self.tail(g, shape4, norm, q, allow_mask=False)
        self.check_users(head + [g] + tail, {final})
        require(val(a["k"]).dtype == qv.dtype == val(a["v"]).dtype, "q, k, v dtypes differ")
        self.fused_op()
        self.check_gluon_gdpa(qv, val(a["k"]))
        self.check_inference(q, a["k"], a["v"], norm, rms,
                             "the fused backward measures slower than gdpa + Inductor's norms on the H200 (18-30% "
                             "against the Triton GDPA backward, 40-73% against the Gluon one)")
        m = BlockMatch("gdpa", q, shape4, a["k"], a["v"], a["q_offsets"], int(a["max_seq_len_q"]),
                       a["activation"], float(a["scale"]), norm, rms, final, None, _unique(head + [g] + tail))
        self.check_op_accepts(m)
        return m


class FlashNormAttentionDense(_BlockPattern):
    """The dense padded composite: LayerNorm_{H*D}(q) -> einsum/matmul scores -> elementwise activation
    (times a constant) -> einsum/matmul with V -> + ln_q -> [bool mask] -> RMSNorm_{H*D} -> + q."""

    name = "attention_block_dense"
    order = 21

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        out = []
        for n in graph.nodes:
            p = _product(n) if n.op == "call_function" else None
            if p is not None:
                src = _strip_reshapes(p[0][0])[0]
                # The left operand is (a view of) a norm's output: canonical, or a norm call left as written
                # (dynamic shapes), which match() reports.
                if _norm_of(src) is not None or _is(src, (), *_NORM_CALLS):
                    out.append(n)
        return out

    def match(self, s: Node) -> BlockMatch:
        (ln4, k), (xs, ks), s_out, s_perm = _product(s)
        require(fx_utils.is_static(val(ln4), val(k), val(s)), "dynamic shapes: left to Inductor")
        shape4 = tuple(val(ln4).shape)
        # ln4 [B, L, H, D] as b l h d; k [B, S, H, D] as b s h d; the scores over (b, h, l, s), d summed.
        b, ll, h, d = xs
        require(len(shape4) == 4 and ks[0] == b and ks[2] == h and ks[3] == d and ks[1] not in xs,
                f"scores {xs},{ks}->{s_out}: q is not [B, L, H, D] against k [B, S, H, D] per head")
        sl = ks[1]
        require(sorted(s_out) == sorted(b + h + ll + sl), f"scores {xs},{ks}->{s_out} do not sum over D alone")
        kv = val(k)
        require(tuple(kv.shape[i] for i in (0, 2, 3)) == (shape4[0], shape4[2], shape4[3]),
                f"k of shape {tuple(kv.shape)} does not match q {shape4}")
        norm, q, head = self.head(ln4, shape4)
        # The elementwise chain S -> P, and the product P @ V.
        pv, chain = self.find_pv(s)
        (p, v), (ps, vs), pv_out, pv_perm = _product(pv)
        tr = dict(zip(ps, s_out))  # PV's subscripts of P -> the score subscripts
        require(len(tr) == 4 and sorted(tr.values()) == sorted(s_out), "P is not the scores' layout")
        vd = next((c for c in vs if c not in tr), None)
        require(vd is not None and [tr.get(c, vd) for c in vs] == [b, sl, h, vd],
                f"P @ V subscripts {ps},{vs}->{pv_out}: v is not [B, S, H, D] summed over S")
        require(val(v).shape == kv.shape, f"v of shape {tuple(val(v).shape)} is not k's {tuple(kv.shape)}")
        o_layout = [tr.get(c, vd) for c in pv_out]
        require(sorted(o_layout) == sorted([b, ll, h, vd]), f"P @ V result {pv_out} is not over (b, l, h, d)")
        # A permute of the result back to [B, L, H, D] before the residual add.
        o, post = pv, []
        nxt = fx_utils.single_user(o)
        while _is(nxt, _PERM_METHODS, *_PERM_FNS) and nxt.args[0] is o:
            post.append(nxt)
            o = nxt
            nxt = fx_utils.single_user(o)
        if post:
            _, perm, _ = _strip_perms(o)
            o_layout = [o_layout[i] for i in perm]
        require(o_layout == [b, ll, h, vd], f"attention output laid out as {''.join(o_layout)}, not blhd")
        activation, scale = identify_activation(chain, s, p)
        rms, final, mask, tail = self.tail(o, shape4, norm, q, allow_mask=True)
        interior = head + s_perm + [s] + chain + pv_perm + [pv] + post + tail
        self.check_users(interior, {final})
        require(val(k).dtype == val(v).dtype == val(ln4).dtype, "q, k, v dtypes differ")
        self.fused_op()
        bsz, length = shape4[0], shape4[1]
        require(bsz * length > 0, "no query rows")
        require(config.patterns.attention_block_dense,
                "the dense composite's rewrite computes every padded row (lengths cannot be read from a general "
                "mask) and measures slower than Inductor's dense composite (a PFFN inference step 0.67x on the "
                "H200): left to Inductor unless config.patterns.attention_block_dense")
        self.check_inference(q, k, v, norm, rms, "a training step of the PFFN stack measures 0.63-0.75x of "
                             "Inductor's dense composite on the H200 (benchmarks/results/models_h200.json)")
        m = BlockMatch("dense", q, (bsz * length, shape4[2], shape4[3]), k, v, None, length, activation,
                       scale, norm, rms, final, mask, _unique(interior))
        self.check_op_accepts(m)
        return m

    def find_pv(self, s: Node) -> tuple[Node, list[Node]]:
        """Follow the scores' users to the product with V: every node in between must be an elementwise op
        of S and constants. Returns (the P @ V node, the elementwise nodes in graph order)."""
        chain: set[Node] = set()
        pvs: set[Node] = set()
        frontier = [s]
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u in chain or u in pvs:
                    continue
                if _is(u, _SOFTMAX, *_SOFTMAX_FNS):
                    raise Reject("softmax instead of an elementwise activation (GDPA has no row max/sum): "
                                 "not fused")
                if u.op == "call_function" and _product(u) is not None:
                    pvs.add(u)
                    continue
                require(_is(u, _ELEMENTWISE_METHODS, *_ELEMENTWISE_FNS),
                        f"{describe(u)} between the scores and P is not an elementwise activation: not fused")
                chain.add(u)
                frontier.append(u)
        require(len(pvs) == 1, f"the scores reach {len(pvs)} products (expected one, P @ V)")
        for u in chain:
            for inp in u.all_input_nodes:
                if inp is not s and inp not in chain:
                    raise Reject(f"the scores are combined with another tensor ({inp.name}) before P @ V "
                                 "(a mask on the scores?): not supported yet")
        pv = pvs.pop()
        order = {n: i for i, n in enumerate(s.graph.nodes)}
        return pv, sorted(chain, key=order.__getitem__)

