"""``linear_norm_fwd``: linear -> [+ residual] -> norm becomes one GEMM with the norm in its epilogue.

Joint graph (ATen, forward + backward, before partitioning). Matches a canonical ``fusenorm::norm`` whose
input is ``mm``/``addmm`` (a linear, with or without bias), possibly through a view that restores the
batch dims of a 3-D input and one residual add on either side, and rewrites it to ``fusenorm::mm_norm``.

The norm's backward (``fusenorm::norm_backward``, which read the pre-norm tensor) is switched to read the
normalized ``hh`` that the fused kernel writes (or ``y`` itself when the norm has no affine): the pre-norm
tensor is never written, so it is never saved. Where y feeds a linear, the partitioner keeps y for that
linear's weight gradient, as it does in the unfused graph (which keeps the pre-norm tensor besides).
(Recomputing y from hh in the backward was tried: the partitioner then computes and saves the copy in the
forward, because a GEMM input must be materialized, which only adds a kernel.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import fx_utils
from fusenorm_inductor.fx_utils import flat_like, val
from fusenorm_inductor.tuning.decide import Choice, describe_mm_norm, forward_choice
from fusenorm_inductor.report import GraphReport

from .base import Pattern, Reject, bind_op_args, describe, getitem_users, is_op, require

aten = torch.ops.aten
NORM = torch.ops.fusenorm.norm.default
NORM_BWD = torch.ops.fusenorm.norm_backward.default
MM_NORM = torch.ops.fusenorm.mm_norm.default
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)
# Value-preserving nodes the walk from the norm to the GEMM looks through besides views: a clone is what an
# inactive dropout (p = 0, or eval mode) becomes (HF BERT's dropout between its output linear and the residual).
IDENTITIES = VIEWS + (aten.clone.default,)


def _through_identities(n: Node, chain: Optional[list] = None) -> Node:
    """The node under any views and clones of ``n``; the ones passed are appended to ``chain``."""
    while is_op(n, *IDENTITIES):
        n = n.args[0]
        if chain is not None:
            chain.append(n)
    return n
CONVERT = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class PostNormMatch:
    norm: Node
    args: dict[str, Any]
    gemm: Node
    a: Node
    b: Node
    bias: Optional[Node]
    residual: Optional[Node]
    chain: list[Node]  # nodes from the GEMM up to the norm's input, removed after the rewrite
    backward: list[Node]  # this norm's fusenorm::norm_backward nodes
    choice: Choice  # the measured decision to fuse and the kernel configuration (ops/tuning.py)


def _convert_source(node: Node) -> Optional[Node]:
    """``convert_element_type(x, dtype)`` (or ``_to_copy(x, dtype=...)``) -> x, else None."""
    if is_op(node, *CONVERT) and len(node.args) >= 1 and isinstance(node.args[0], Node):
        return node.args[0]
    return None


def norm_backward_partners(norm: Node) -> list[Node]:
    """The ``fusenorm::norm_backward`` nodes of this norm: they read its saved mean/rstd outputs (in the
    joint graph's pre pass, through chains of ``aten.alias``)."""
    found: list[Node] = []
    todo = [g for i, gs in getitem_users(norm).items() if i in (1, 2) for g in gs]
    while todo:
        for u in todo.pop().users:
            if is_op(u, NORM_BWD) and u not in found:
                found.append(u)
            elif is_op(u, aten.alias.default):
                todo.append(u)
    return found


class LinearNormFwd(Pattern):
    name = "linear_norm_fwd"
    stage = "joint"
    switch = "patterns.linear_norm_fwd"

    def candidates(self, graph: fx.Graph) -> Iterable[Node]:
        return [n for n in graph.nodes if is_op(n, NORM)]

    # ---- guards ----------------------------------------------------------------------------------------
    def match(self, norm: Node) -> PostNormMatch:
        args = bind_op_args(norm)
        x = args["x"]
        backward = norm_backward_partners(norm)
        chain = [x]
        self.check_static(norm, x)
        cur, residual = x, None
        if is_op(cur, aten.add.Tensor):
            cur, residual = self.split_residual(cur)
            chain.append(cur)
        gemm = _through_identities(cur, chain)
        require(is_op(gemm, aten.mm.default, aten.addmm.default),
                f"norm input is not a linear's output (comes from {describe(gemm)})")
        chain = chain[:-1] if chain[-1] is gemm else chain
        self.check_only_feeds_norm(norm, gemm, chain, backward)
        a, b, bias = self.gemm_operands(gemm)
        self.check_norm_over_gemm_cols(val(x), val(gemm))
        self.check_dtypes(val(a), val(b), val(x))
        if residual is not None:
            self.check_residual(val(residual), val(x))
        choice = self.check_speed(args, a, b, bias, residual, backward)
        return PostNormMatch(norm, args, gemm, a, b, bias, residual, chain, backward, choice)

    def check_speed(self, args, a: Node, b: Node, bias, residual, backward) -> Choice:
        """Fused only where it was measured to beat cuBLAS + the norm on this shape (always on CPU)."""
        av, bv = fx_utils.hinted(val(a)), val(b)
        res2 = flat_like(val(residual), av.shape[0], bv.shape[1]) if residual is not None else None
        affine = args["weight"] is not None or args["bias"] is not None
        choice = forward_choice(
            av, bv, val(bias), res2, val(args["weight"]), val(args["bias"]), args["eps"],
            args["is_rms"], args["out_dtype"] or val(args["x"]).dtype, affine and bool(backward),
        )
        require(choice.fuse, choice.reason)
        return choice

    def check_static(self, norm: Node, x: Node) -> None:
        """The norm's width (the GEMM's N) must be static; the rows (M) may be symbolic: the kernels take M at
        run time, and the decision is measured at the traced example's M."""
        require(fx_utils.static_width(val(x), val(norm)[0]), "dynamic shapes (a symbolic width N): left to Inductor")

    def split_residual(self, add: Node) -> tuple[Node, Node]:
        """``add(linear, r)`` or ``add(r, linear)``: which side is the GEMM (through views and clones), which the
        residual."""
        require(len(add.args) == 2 and not add.kwargs, "add with alpha is not a residual add")
        for side, other in ((0, 1), (1, 0)):
            s = add.args[side]
            if is_op(_through_identities(s), aten.mm.default, aten.addmm.default) and isinstance(add.args[other], Node):
                return s, add.args[other]
        sides = ", ".join(describe(_through_identities(a)) if isinstance(a, Node) else repr(a) for a in add.args)
        raise Reject(f"norm input is an add with no linear output on either side (its inputs come from {sides}; "
                     "an active dropout or another op between the linear and the add stops the match)")

    def check_only_feeds_norm(self, norm: Node, gemm: Node, chain: list[Node], backward: list[Node]) -> None:
        """The linear's output and every node up to the norm have no other user (the fused kernel never
        writes them); the norm's own backward may read its input (it is switched to hh)."""
        allowed = set(chain) | {norm} | set(backward)
        for n in [gemm] + chain:
            others = fx_utils.users_outside(n, allowed)
            if others:
                raise Reject(f"linear output {n.name} has another user ({others[0].name}): not fused")

    def gemm_operands(self, gemm: Node) -> tuple[Node, Node, Optional[Node]]:
        """``mm(a, b)`` or ``addmm(bias, a, b)`` with a 1-D bias and beta = alpha = 1."""
        if gemm.target is aten.mm.default:
            a, b = gemm.args
            return a, b, None
        require(gemm.kwargs.get("beta", 1) == 1 and gemm.kwargs.get("alpha", 1) == 1,
                "addmm with beta/alpha != 1")
        bias, a, b = gemm.args
        require(isinstance(bias, Node) and val(bias).dim() == 1, "addmm bias is not a 1-D vector")
        return a, b, bias

    def check_norm_over_gemm_cols(self, xv: torch.Tensor, gv: torch.Tensor) -> None:
        """The norm runs over the GEMM's output columns: the view (if any) only splits the rows."""
        require(xv.shape[-1] == gv.shape[-1] and fx_utils.same_shape([xv.numel()], [gv.numel()]),
                f"norm over {tuple(xv.shape)} is not over the linear's output dim {tuple(gv.shape)}")

    def check_dtypes(self, av: torch.Tensor, bv: torch.Tensor, xv: torch.Tensor) -> None:
        """fp32/fp16/bf16 operands of one dtype, on CPU or CUDA."""
        require(av.dtype in FLOATS and av.dtype == bv.dtype, f"GEMM dtypes {av.dtype}/{bv.dtype} not supported")
        require(xv.dtype in FLOATS, f"norm input dtype {xv.dtype} not supported")
        require(av.device.type in ("cpu", "cuda"), f"device {av.device} not supported")

    def check_residual(self, rv: torch.Tensor, xv: torch.Tensor) -> None:
        """The residual has exactly the pre-norm shape (no broadcasting)."""
        require(fx_utils.same_shape(rv.shape, xv.shape), f"residual {tuple(rv.shape)} broadcasts to {tuple(xv.shape)}")
        require(rv.dtype in FLOATS, f"residual dtype {rv.dtype} not supported")

    # ---- rewrite ---------------------------------------------------------------------------------------
    def rewrite(self, graph: fx.Graph, m: PostNormMatch, rep: GraphReport) -> None:
        args, norm = m.args, m.norm
        xv = val(args["x"])
        mv, nv = val(m.a).shape[0], val(m.b).shape[1]
        weight, nbias = args["weight"], args["bias"]
        affine = weight is not None or nbias is not None
        save_normed = affine and bool(m.backward)
        out_dtype = args["out_dtype"] or xv.dtype
        with graph.inserting_before(norm):
            res2 = fx_utils.reshape(graph, m.residual, [mv, nv]) if m.residual is not None else None
            fused = fx_utils.call(graph, MM_NORM, m.a, m.b, m.bias, res2, weight, nbias, args["eps"],
                                  args["is_rms"], out_dtype, save_normed)
            y2, hh2, mean1, rstd1 = fx_utils.getitems(graph, fused, 4)
            y = fx_utils.reshape(graph, y2, xv.shape)
            stats_shape = list(xv.shape[:-1])
            rstd = fx_utils.reshape(graph, rstd1, stats_shape)
            mean = mean1 if args["is_rms"] else fx_utils.reshape(graph, mean1, stats_shape)
            normed = fx_utils.reshape(graph, hh2, xv.shape) if save_normed else y
        outs = getitem_users(norm)
        feeds_linear = any(_feeds_linear(g) for g in outs.get(0, []))
        for idx, new in ((0, y), (1, mean), (2, rstd)):
            for g in outs.get(idx, []):
                g.replace_all_uses_with(new)
                graph.erase_node(g)
        for bwd in m.backward:
            # Read hh (or y, without affine) instead of the pre-norm tensor; see the module docstring.
            bargs = bind_op_args(bwd)
            bargs.update(src=normed, src_is_normed=True, mean=None)  # hh needs no mean: not saved
            bwd.args, bwd.kwargs = tuple(bargs.values()), {}
        graph.erase_node(norm)
        fx_utils.erase_if_unused(graph, m.chain + [m.gemm])
        rep.rewrite(
            self.name, self.stage, [norm.name, m.gemm.name],
            {"M": mv, "K": val(m.a).shape[1], "N": nv, "x": list(xv.shape)}, val(m.a).dtype,
            f"{describe_mm_norm(val(m.a), nv, args['is_rms'])} [{m.choice.config}]: {m.choice.reason}",
            f"{'RMSNorm' if args['is_rms'] else 'LayerNorm'}, affine={'yes' if affine else 'no'}, "
            f"bias={'yes' if m.bias is not None else 'no'}, residual={'yes' if m.residual is not None else 'no'}, "
            f"saves {'hh' if save_normed else ('y' if m.backward else 'nothing')} for backward"
            f"{fx_utils.dynamic_note(mv)}"
            f"{'; its output feeds a linear: taken here before pre-norm (norm_linear_fwd)' if feeds_linear else ''}",
        )


def _feeds_linear(y: Node) -> bool:
    """Whether the norm output (directly or through a view) is a linear's input: the pre-norm pattern's
    candidate, which this one takes first (the report says so)."""
    for u in y.users:
        inner = list(u.users) if is_op(u, *VIEWS) else [u]
        if any(is_op(g, aten.mm.default, aten.addmm.default) for g in inner):
            return True
    return False
