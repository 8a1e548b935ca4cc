"""``dgrad_norm_bwd``: the norm's backward fused into the epilogue of the next linear's data-gradient GEMM.

Joint graph. For ``n = norm(x); out = linear(n)`` the backward computes ``dn = d_out @ W`` (an ``mm``) and
feeds it, possibly through a view (3-D inputs), a dtype conversion (autocast) and adds of other gradients
of ``n`` (a residual branch, further consumers), to ``fusenorm::norm_backward``. The ``mm`` and the norm
backward become one ``fusenorm::mm_norm_backward``; the other gradients ride along as ``extra``.
This applies whether or not the forward norm was fused (the kernel reads hh, or x with mean/rstd).

The pre-grad stage asks this fusion too (``prospect``), before the backward is traced: there the norm's
gradient is predicted from the linears reading its output, and the same decision (``check_speed``) is asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import fx_utils
from fusenorm_inductor.fx_utils import flat_like, val
from fusenorm_inductor.tuning.decide import Choice
from fusenorm_inductor.tuning.mm_norm_backward import backward_choice, describe_mm_norm_backward
from fusenorm_inductor.report import GraphReport

from .base import Pattern, Reject, bind_op_args, describe, getitem_users, is_op, require
from .post_norm import CONVERT, FLOATS
from .views import VIEWS, GraphView

aten = torch.ops.aten
NORM_BWD = torch.ops.fusenorm.norm_backward.default
MM_NORM_BWD = torch.ops.fusenorm.mm_norm_backward.default


@dataclass
class DgradMatch:
    bwd: Node
    args: dict[str, Any]
    gemm: Node
    extra: Optional[Node]
    chain: list[Node]
    choice: Choice  # the measured decision to fuse and the kernel configuration (tuning/mm_norm_backward.py)


def _gemm_under(node: Any) -> Optional[Node]:
    """The mm reached from ``node`` through an optional view and an optional dtype conversion."""
    cur = node
    for _ in range(3):  # convert(view(mm)), view(convert(mm)), ...
        if is_op(cur, *CONVERT, *VIEWS):
            cur = cur.args[0]
    return cur if is_op(cur, aten.mm.default) else None


class DgradNormBwd(Pattern):
    name = "dgrad_norm_bwd"
    stage = "joint"
    order = 30  # after the forward fusions: they change what the norm backward reads, which this one keeps
    switch = "patterns.dgrad_norm_bwd"
    anchor = NORM_BWD

    def prospect(self, norm: Node, view: GraphView) -> None:
        """Whether the backward of ``norm`` would be fused, before it is traced: each linear reading the norm's
        output as its input will compute the norm's gradient in its data-gradient GEMM (``d_out @ W``, the
        other linears' gradients added as extra), and the norm backward will read x and the statistics (this
        is asked of a norm that no forward fusion takes). Taken where one of those GEMMs would be fused."""
        require(view.has_backward(norm), "no backward (inference)")
        args = bind_op_args(norm)
        ys = getitem_users(norm).get(0, [])
        require(ys, "norm output unused")
        linears = []
        for y in ys:
            for u in y.users:
                g = view.gemm(u)
                require(g is not None and g.a is y, f"norm output has a user that is not a linear ({describe(u)})")
                linears.append(g)
        require(linears, "norm output feeds no linear")
        xv, is_rms = val(args["x"]), args["is_rms"]
        k = xv.shape[-1]
        m = xv.numel() // k
        last = None
        for g in linears:
            out = val(g.node)
            try:
                _, b, _ = view.gemm_values(g)
                self.check_speed(
                    flat_like(out, m, out.shape[-1]), b.t(), flat_like(xv, m, k) if len(linears) > 1 else None,
                    flat_like(xv, m, k), val(args["weight"]), None if is_rms else flat_like(xv, m, dtype=torch.float32),
                    flat_like(xv, m, dtype=torch.float32), is_rms, False, args["bias"] is not None, xv.dtype)
                return
            except Reject as r:
                last = r
        raise last

    # ---- guards ----------------------------------------------------------------------------------------
    def match(self, bwd: Node) -> DgradMatch:
        args = bind_op_args(bwd)
        dy = args["dy"]
        require(fx_utils.static_width(val(dy), val(args["src"])), "dynamic shapes (a symbolic width): left to Inductor")
        top, extra = self.split_extra(dy)
        gemm = _gemm_under(top)
        require(gemm is not None, f"norm gradient does not come from a linear's data-gradient GEMM "
                                  f"({top.op} {getattr(top.target, '__name__', top.target)})")
        chain = self.chain_nodes(dy, top, gemm)
        self.check_only_feeds_norm_backward(bwd, gemm, chain)
        self.check_shapes(val(dy), val(gemm))
        self.check_dtypes(val(gemm.args[0]), val(gemm.args[1]))
        if extra is not None:
            require(fx_utils.same_shape(val(extra).shape, val(dy).shape) and val(extra).dtype in FLOATS,
                    "other gradient added to the GEMM's broadcasts or has an unsupported dtype")
        dyv, bv = fx_utils.hinted(val(gemm.args[0])), val(gemm.args[1])
        mv, nv = dyv.shape[0], bv.shape[1]
        mean = args["mean"] if args["mean"] is None or args["is_rms"] else flat_like(val(args["mean"]), mv)
        choice = self.check_speed(
            dyv, bv, flat_like(val(extra), mv, nv) if extra is not None else None,
            flat_like(val(args["src"]), mv, nv), val(args["weight"]), mean, flat_like(val(args["rstd"]), mv),
            args["is_rms"], args["src_is_normed"], args["has_bias"], args["dx_dtype"])
        return DgradMatch(bwd, args, gemm, extra, chain, choice)

    def check_speed(self, dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype) -> Choice:
        """Fused only where it was measured to beat cuBLAS + the norm backward (always on CPU). ``dy`` [M, N] and
        ``b`` [N, K] are the data-gradient GEMM's operands; the others are as ``fusenorm::mm_norm_backward`` takes
        them."""
        choice = backward_choice(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype)
        require(choice.fuse, choice.reason)
        return choice

    def split_extra(self, dy: Node) -> tuple[Node, Optional[Node]]:
        """``dy = add(gemm_path, other)`` (either order): the GEMM path, and the other gradient as extra."""
        if is_op(dy, aten.add.Tensor) and len(dy.args) == 2 and not dy.kwargs:
            for side, other in ((0, 1), (1, 0)):
                if _gemm_under(dy.args[side]) is not None and isinstance(dy.args[other], Node):
                    return dy.args[side], dy.args[other]
            raise Reject("norm gradient is a sum with no data-gradient GEMM directly under it")
        return dy, None

    @staticmethod
    def chain_nodes(dy: Node, top: Node, gemm: Node) -> list[Node]:
        chain, cur = [], dy
        if cur is not top:
            chain.append(cur)  # the add
            cur = top
        while cur is not gemm:
            chain.append(cur)
            cur = cur.args[0]
        return chain

    def check_only_feeds_norm_backward(self, bwd: Node, gemm: Node, chain: list[Node]) -> None:
        """The GEMM's output (and each node up to the norm backward) is used by nothing else."""
        allowed = set(chain) | {bwd}
        for n in [gemm] + chain:
            others = fx_utils.users_outside(n, allowed)
            if others:
                raise Reject(f"data gradient {n.name} has another user ({others[0].name}): not fused")

    def check_shapes(self, dyv: torch.Tensor, gv: torch.Tensor) -> None:
        """The GEMM's columns are the norm's dim; any view only splits rows."""
        require(dyv.shape[-1] == gv.shape[-1] and fx_utils.same_shape([dyv.numel()], [gv.numel()]),
                f"norm gradient {tuple(dyv.shape)} is not the GEMM output {tuple(gv.shape)} with rows split")

    def check_dtypes(self, av: torch.Tensor, bv: torch.Tensor) -> None:
        """fp32/fp16/bf16 GEMM operands of one dtype on CPU or CUDA."""
        require(av.dtype in FLOATS and av.dtype == bv.dtype, f"GEMM dtypes {av.dtype}/{bv.dtype} not supported")
        require(av.device.type in ("cpu", "cuda"), f"device {av.device} not supported")

    # ---- rewrite ---------------------------------------------------------------------------------------
    def rewrite(self, graph: fx.Graph, m: DgradMatch, rep: GraphReport) -> None:
        a = m.args
        dyv = val(a["dy"])
        dy2, b = m.gemm.args
        mv, nv = val(dy2).shape[0], val(b).shape[1]
        with graph.inserting_before(m.bwd):
            extra = fx_utils.reshape(graph, m.extra, [mv, nv]) if m.extra is not None else None
            src = fx_utils.reshape(graph, a["src"], [mv, nv])
            rstd = fx_utils.reshape(graph, a["rstd"], [mv])
            mean = a["mean"] if a["mean"] is None or a["is_rms"] else fx_utils.reshape(graph, a["mean"], [mv])
            fused = fx_utils.call(graph, MM_NORM_BWD, dy2, b, extra, src, a["weight"], mean, rstd,
                                  a["is_rms"], a["src_is_normed"], a["has_bias"], a["dx_dtype"])
            dx2, dw, db = fx_utils.getitems(graph, fused, 3)
            dx = fx_utils.reshape(graph, dx2, dyv.shape)
        for idx, new in ((0, dx), (1, dw), (2, db)):
            for g in getitem_users(m.bwd).get(idx, []):
                g.replace_all_uses_with(new)
                graph.erase_node(g)
        graph.erase_node(m.bwd)
        fx_utils.erase_if_unused(graph, m.chain + [m.gemm])
        rep.rewrite(
            self.name, self.stage, [m.bwd.name, m.gemm.name],
            {"M": mv, "K": val(dy2).shape[1], "N": nv, "dy": list(dyv.shape)}, val(dy2).dtype,
            f"{describe_mm_norm_backward(val(dy2), nv, a['is_rms'])} [{m.choice.config}]: {m.choice.reason}",
            f"{'RMSNorm' if a['is_rms'] else 'LayerNorm'}, reads {'hh' if a['src_is_normed'] else 'x + stats'}, "
            f"extra gradient={'yes' if m.extra is not None else 'no'}{fx_utils.dynamic_note(mv, m.choice.t_fused_ms is not None)}",
        )


