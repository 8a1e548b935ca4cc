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

The match is written against ``views.GraphView``: the pre-grad stage asks it too (``prospect``, on the
torch-level graph), whether this fusion would take a canonical norm (prospects.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import config, fx_utils
from fusenorm_inductor.fx_utils import flat_like, val
from fusenorm_inductor.tuning import measure
from fusenorm_inductor.tuning.decide import Choice, charged
from fusenorm_inductor.tuning.mm_norm import describe_mm_norm, forward_choice
from fusenorm_inductor.report import GraphReport

from .base import Pattern, Reject, bind_op_args, describe, getitem_users, is_op, require
from .views import GEMMS, JOINT, VIEWS, GraphView, through_identities

aten = torch.ops.aten
NORM = torch.ops.fusenorm.norm.default
MM_NORM = torch.ops.fusenorm.mm_norm.default
CONVERT = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The widest N tile of the GEMM kernels (kernels/hopper/common.py): the whole-row epilogue's home ground.
MAX_TILE_N = 256


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
    choice: Choice  # the measured decision to fuse and the kernel configuration (tuning/mm_norm.py)


class LinearNormFwd(Pattern):
    name = "linear_norm_fwd"
    stage = "joint"
    # First of the fusions: a norm between two linears goes to the one before it when that fuses (pre-norm
    # comes next), and the forward fusions change what the norm backward reads, which the backward fusion keeps.
    order = 10
    switch = "patterns.linear_norm_fwd"
    anchor = NORM

    def match(self, norm: Node) -> PostNormMatch:
        return self.match_in(norm, JOINT)

    def prospect(self, norm: Node, view: GraphView) -> None:
        self.match_in(norm, view)

    # ---- guards ----------------------------------------------------------------------------------------
    def match_in(self, norm: Node, view: GraphView) -> PostNormMatch:
        args = bind_op_args(norm)
        x = args["x"]
        backward = view.norm_backward(norm)
        chain = [x]
        self.check_static(norm, x)
        cur, residual = x, None
        if view.is_add(cur):
            cur, residual = self.split_residual(cur, view)
            chain.append(cur)
        out = through_identities(view, cur, chain)
        gemm = view.gemm(out)
        require(gemm is not None, f"norm input is not a linear's output (comes from {describe(out)})")
        chain = chain[:-1] if chain[-1] is out else chain
        self.check_only_feeds_norm(norm, out, chain, backward)
        av, bv, biasv = view.gemm_values(gemm)
        self.check_norm_over_gemm_cols(val(x), val(out))
        self.check_dtypes(av, bv, val(x))
        if residual is not None:
            self.check_residual(val(residual), val(x))
        self.check_not_deferred(norm, val(x), view)
        self.check_input_not_deferred(gemm, val(x), view)
        choice = self.check_speed(args, av, bv, biasv, residual, view.has_backward(norm), _own_kernel_readers(norm))
        return PostNormMatch(norm, args, out, gemm.a, gemm.b, gemm.bias, residual, chain, backward, choice)

    def check_not_deferred(self, norm: Node, xv: torch.Tensor, view: GraphView) -> None:
        """On CUDA a row wider than one tile between linears goes to deferred normalization (next in the
        order): the whole-row epilogue needs the row's statistics across tiles, which costs the GEMM its speed
        on Hopper, where deferral's GEMMs keep their plain mainloop."""
        n = xv.shape[-1]
        if xv.device.type != "cuda" or n <= MAX_TILE_N or not config.patterns.deferred_norm:
            return
        m = xv.numel() // n
        ys = getitem_users(norm).get(0, [])
        if any(view.gemm_input(u, y, m, n) is not None for y in ys for u in y.users):
            raise Reject(f"a row of {n} (wider than one {MAX_TILE_N}-column tile) between linears: left to "
                         "deferred normalization (deferred_norm)")

    def check_input_not_deferred(self, gemm, xv: torch.Tensor, view: GraphView) -> None:
        """On CUDA a linear that reads a norm of a row wider than one tile is that norm's consumer under
        deferral (which applies it in this linear's epilogue): fusing this linear with the norm after it would
        leave the norm before it unfused."""
        if xv.device.type != "cuda" or not config.patterns.deferred_norm:
            return
        src = through_identities(view, gemm.a)
        if is_op(src, operator.getitem) and src.args[1] == 0 and is_op(src.args[0], NORM):
            width = val(src).shape[-1]
            if fx_utils.as_int(width) is not None and fx_utils.as_int(width) > MAX_TILE_N:
                raise Reject(f"the linear reads a norm of a row of {width} (wider than one tile): it is that "
                             "norm's consumer under deferred normalization (deferred_norm)")

    def check_speed(self, args, av: torch.Tensor, bv: torch.Tensor, biasv, residual, has_backward: bool,
                    readers: list) -> Choice:
        """Fused only where it was measured to beat cuBLAS + the norm on this shape (always on CPU). Where
        pointwise code reads the norm's output (an activation), Inductor fuses it into its norm kernel for free,
        while after the fused kernel it is a kernel of its own: a read and a write of [M, N] more, charged to
        the fused side."""
        av = fx_utils.hinted(av)
        res2 = flat_like(val(residual), av.shape[0], bv.shape[1]) if residual is not None else None
        affine = args["weight"] is not None or args["bias"] is not None
        choice = forward_choice(
            av, bv, biasv, res2, val(args["weight"]), val(args["bias"]), args["eps"],
            args["is_rms"], args["out_dtype"] or val(args["x"]).dtype, affine and has_backward,
            training=has_backward,  # a training graph: the decision judges the whole step
        )
        if readers and choice.fuse and choice.t_fused_ms is not None:
            extra = measure.norm_proxy_ms(av.shape[0], bv.shape[1], av.dtype, 2, av.device)
            choice = charged(choice, extra, f"{describe(readers[0])} reads the norm's output in a kernel of its "
                                            "own, where Inductor fuses it into its norm kernel")
        require(choice.fuse, choice.reason)
        return choice

    def check_static(self, norm: Node, x: Node) -> None:
        """The norm's width (the GEMM's N) must be static; the rows (M) may be symbolic: the kernels take M at
        run time, and the decision is measured at the traced example's M."""
        require(fx_utils.static_width(val(x), val(norm)[0]), "dynamic shapes (a symbolic width N): left to Inductor")

    def split_residual(self, add: Node, view: GraphView) -> tuple[Node, Node]:
        """``add(linear, r)`` or ``add(r, linear)``: which side is the GEMM (through views and clones), which the
        residual."""
        require(len(add.args) == 2 and not add.kwargs, "add with alpha is not a residual add")
        for side, other in ((0, 1), (1, 0)):
            s = add.args[side]
            if view.gemm(through_identities(view, s)) is not None and isinstance(add.args[other], Node):
                return s, add.args[other]
        sides = ", ".join(describe(through_identities(view, a)) if isinstance(a, Node) else repr(a) for a in add.args)
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
            f"{fx_utils.dynamic_note(mv, m.choice.t_fused_ms is not None)}"
            f"{'; its output feeds a linear: taken here before pre-norm (norm_linear_fwd)' if feeds_linear else ''}",
        )


def _own_kernel_readers(norm: Node) -> list[Node]:
    """The readers of the norm's output (directly or through a view) that are neither a linear nor the graph's
    output: pointwise code that Inductor would fuse into its norm kernel."""
    out = []
    for y in getitem_users(norm).get(0, []):
        for u in y.users:
            for g in (list(u.users) if is_op(u, *VIEWS) else [u]):
                if not is_op(g, *GEMMS) and g.op != "output":
                    out.append(g)
    return out


def _feeds_linear(y: Node) -> bool:
    """Whether the norm output (directly or through a view) is a linear's input: the pre-norm pattern's
    candidate, which this one takes first (the report says so)."""
    for u in y.users:
        inner = list(u.users) if is_op(u, *VIEWS) else [u]
        if any(is_op(g, *GEMMS) for g in inner):
            return True
    return False
