"""``norm_linear_fwd``: norm -> linear(s) becomes Lazy Pre-Norm GEMMs; the normalized tensor is never written.

Joint graph (ATen, forward + backward, before partitioning). Matches a canonical ``fusenorm::norm`` whose
output feeds only linears (``mm``/``addmm`` with the normalized tensor as the left operand, possibly through
a view that flattens the batch dims of a 3-D input) and those linears' weight gradients (``mm(X, y)`` with y
as the right operand). Several linears may read the same norm (q/k/v, gate/up: fan-out).

Rewrite, per consumer linear: ``fusenorm::norm_mm(x, b, bias, weight, norm_bias)`` (ops/norm_mm.py: the row
statistics come from the A tiles the GEMM loads, the affine folds into b); each weight gradient
``mm(X, y)`` becomes ``fusenorm::mm_normed(X, x, mean, rstd, weight, norm_bias)``, which rebuilds y from x and
the statistics. The norm's own backward already reads x, mean and rstd, so the partitioner keeps x and the
statistics and never y: the fused path saves less than the unfused one (y is gone). With fan-out, each
consumer recomputes the statistics in its own K loop (they ride on loads the GEMM makes anyway); the first
consumer's mean/rstd feed the backward.

Post-norm (``linear_norm_fwd``) runs first: a norm between two linears that it fused is not seen here; a
norm it left unfused (with its reason in the match report) is offered to this pattern.

The match is written against ``views.GraphView``: the pre-grad stage asks it too (``prospect``, on the
torch-level graph, where the weight gradients are not traced yet: one per linear whose weight requires grad).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import fx_utils
from fusenorm_inductor.fx_utils import val
from fusenorm_inductor.tuning import measure
from fusenorm_inductor.tuning.decide import Choice
from fusenorm_inductor.tuning.norm_mm import prenorm_choice, prenorm_norm_ms
from fusenorm_inductor.report import GraphReport

from .base import Pattern, Reject, bind_op_args, describe, getitem_users, require
from .post_norm import FLOATS
from .views import JOINT, GraphView

NORM = torch.ops.fusenorm.norm.default
NORM_MM = torch.ops.fusenorm.norm_mm.default
MM_NORMED = torch.ops.fusenorm.mm_normed.default


@dataclass
class Consumer:
    gemm: Node  # mm(y2, b) or addmm(bias, y2, b)
    b: Node
    bias: Optional[Node]
    bv: torch.Tensor  # b's example value as the joint graph's GEMM takes it
    choice: Optional[Choice] = None


@dataclass
class PreNormMatch:
    norm: Node
    args: dict[str, Any]
    ys: list[Node]  # getitem(norm, 0) nodes
    flat: list[Node]  # the [M, K] views of y (or y itself when 2-D) that the linears read
    consumers: list[Consumer] = field(default_factory=list)
    wgrads: list[Node] = field(default_factory=list)  # mm(X, y2): the linears' weight gradients


class NormLinearFwd(Pattern):
    name = "norm_linear_fwd"
    stage = "joint"
    order = 20  # after post-norm, which takes a norm between two linears first
    switch = "patterns.norm_linear_fwd"
    anchor = NORM

    def match(self, norm: Node) -> PreNormMatch:
        return self.match_in(norm, JOINT)

    def prospect(self, norm: Node, view: GraphView) -> None:
        self.match_in(norm, view)

    # ---- guards ----------------------------------------------------------------------------------------
    def match_in(self, norm: Node, view: GraphView) -> PreNormMatch:
        args = bind_op_args(norm)
        x = args["x"]
        xv = val(x)
        require(fx_utils.static_width(xv, val(norm)[0]), "dynamic shapes (a symbolic width K): left to Inductor")
        ys = getitem_users(norm).get(0, [])
        require(ys, "norm output unused")
        out_dtype = args["out_dtype"] or xv.dtype
        require(xv.dtype in FLOATS, f"norm input dtype {xv.dtype} not supported")
        require(out_dtype == xv.dtype,
                f"norm changes dtype ({xv.dtype} -> {out_dtype}) before the linear: not fused")
        require(xv.device.type in ("cpu", "cuda"), f"device {xv.device} not supported")
        k = xv.shape[-1]
        m = xv.numel() // k if k else 0
        require(k > 0 and fx_utils.hint(m) > 0, "empty norm input")
        match = PreNormMatch(norm, args, ys, [])
        for y in ys:
            for u in list(y.users):
                v = view.gemm_input(u, y, m, k)
                require(v is not None, f"norm output has a user that is not a linear ({describe(u)})")
                if v not in match.flat:
                    match.flat.append(v)
        for v in match.flat:
            for u in v.users:
                self.classify(u, v, match, view)
        require(match.consumers, "norm output feeds no linear")
        require(view.has_backward(norm) or not view.training(norm.graph),
                "the norm's backward was not found (its statistics feed something else)")
        n_wgrads = len(match.wgrads) + view.implied_weight_grads([c.b for c in match.consumers])
        self.check_speed(args, x, match.consumers, n_wgrads, m, k)
        return match

    def classify(self, u: Node, v: Node, match: PreNormMatch, view: GraphView) -> None:
        """A user of the flattened normalized tensor: a linear reading it as A, or a weight gradient."""
        g = view.gemm(u)
        if g is not None and g.a is v and g.b is not v:
            _, bv, _ = view.gemm_values(g)
        elif g is not None and g.bias is None and g.b is v and g.a is not v:
            match.wgrads.append(u)
            return
        else:
            raise Reject(f"normalized tensor {v.name} has a user that is not a linear ({describe(u)})")
        xv = val(match.args["x"])
        require(bv.dtype == xv.dtype, f"linear weight dtype {bv.dtype} differs from the norm's {xv.dtype}")
        require(bv.dim() == 2, "linear weight is not 2-D")
        match.consumers.append(Consumer(u, g.b, g.bias, bv))

    def check_speed(self, args, x: Node, consumers: list[Consumer], n_wgrads: int, m: int, k: int) -> None:
        a2 = fx_utils.flat_like(val(x), m, k)
        # The bias as the graph holds it: at the pre-grad stage, as traced (not in autocast's GEMM dtype).
        choices, why_not = prenorm_decision(a2, [(c.bv, val(c.bias), c.gemm.name) for c in consumers],
                                            val(args["weight"]), val(args["bias"]), args["eps"], args["is_rms"],
                                            n_wgrads)
        for c, choice in zip(consumers, choices):
            c.choice = choice
        require(why_not is None, why_not)

    # ---- rewrite ---------------------------------------------------------------------------------------
    def rewrite(self, graph: fx.Graph, m: PreNormMatch, rep: GraphReport) -> None:
        args, norm = m.args, m.norm
        x, xv = args["x"], val(args["x"])
        k = xv.shape[-1]
        rows = xv.numel() // k
        w, nb, is_rms = args["weight"], args["bias"], args["is_rms"]
        with graph.inserting_before(norm):  # after x, and after every placeholder
            a2 = fx_utils.reshape(graph, x, [rows, k])  # one [M, K] view for every consumer
        stats = None
        for c in m.consumers:
            with graph.inserting_before(c.gemm):
                fused = fx_utils.call(graph, NORM_MM, a2, c.b, c.bias, w, nb, args["eps"], is_rms, xv.dtype)
                out, mean1, rstd1 = fx_utils.getitems(graph, fused, 3)
            c.gemm.replace_all_uses_with(out)
            graph.erase_node(c.gemm)
            if stats is None:
                stats = (mean1, rstd1)
        mean1, rstd1 = stats
        for g in m.wgrads:
            with graph.inserting_before(g):
                new = fx_utils.call(graph, MM_NORMED, g.args[0], a2, None if is_rms else mean1, rstd1, w, nb, is_rms)
            g.replace_all_uses_with(new)
            graph.erase_node(g)
        # The norm's mean/rstd outputs (read by its backward) now come from the first fused GEMM, which sits
        # later in the graph than the norm did: re-sort so every node follows its inputs.
        stats_shape = list(xv.shape[:-1])
        with graph.inserting_after(rstd1):
            rstd = fx_utils.reshape(graph, rstd1, stats_shape)
            mean = mean1 if is_rms else fx_utils.reshape(graph, mean1, stats_shape)
        outs = getitem_users(norm)
        for idx, new in ((1, mean), (2, rstd)):
            for g in outs.get(idx, []):
                g.replace_all_uses_with(new)
                graph.erase_node(g)
        fx_utils.erase_if_unused(graph, [v for v in m.flat if v not in m.ys] + m.ys)
        if norm.users:  # an error, not a Reject: the pass restores the graph it was given
            raise RuntimeError(f"{self.name}: {norm.name} still has users after the rewrite")
        graph.erase_node(norm)
        fx_utils.stable_toposort(graph)
        names = [norm.name] + [c.gemm.name for c in m.consumers]
        kernels = "; ".join(f"N={val(c.b).shape[1]} [{c.choice.config}]: {c.choice.reason}" for c in m.consumers)
        affine = w is not None or nb is not None
        # Which neighbour took the norm, and why not the other: post-norm looked first (its skip, if any).
        post = [sk.reason for sk in rep.skips if sk.pattern == "linear_norm_fwd" and sk.node == norm.name]
        taken = f"; post-norm left it: {post[-1]}" if post else ""
        rep.rewrite(
            self.name, self.stage, names,
            {"M": rows, "K": k, "N": [val(c.b).shape[1] for c in m.consumers], "x": list(xv.shape)}, xv.dtype,
            f"Lazy Pre-Norm GEMM x{len(m.consumers)}: {kernels}",
            f"{'RMSNorm' if is_rms else 'LayerNorm'}, affine={'yes' if affine else 'no'}, "
            f"consumers={len(m.consumers)}, weight gradients rebuilt from stats={len(m.wgrads)}, "
            f"saves x + mean/rstd, never the normalized tensor{taken}{fx_utils.dynamic_note(rows, any(c.choice.t_fused_ms is not None for c in m.consumers))}",
        )


def prenorm_decision(a2: torch.Tensor, consumers: list[tuple], weight, norm_bias, eps: float, is_rms: bool,
                     n_wgrads: int) -> tuple[list[Choice], Optional[str]]:
    """Whether to fuse a norm into its consumer linears: (each consumer's choice, None to fuse or the reason
    not to). ``a2`` is the [M, K] normalized input, ``consumers`` (b [K, N], bias, name) per linear. Fused
    only where it was measured to win (always on CPU). The unfused graph runs the norm once for all its
    linears, so with fan-out the fused GEMMs' sum is weighed against one norm + their GEMMs. In training each
    weight gradient rebuilds norm(x) from x and the statistics (``mm_normed``: one read of x, one write of y,
    at copy speed like the norm itself), where the unfused graph reads the y it saved: that cost is added to
    the fused side, so a fusion that wins the forward but loses the step is not taken. Also asked at the
    pre-grad stage (patterns/prospects.py), with the shapes the joint graph will have."""
    choices = [prenorm_choice(a2, b, bias, weight, norm_bias, eps, is_rms, a2.dtype) for b, bias, _ in consumers]
    if any(c.t_fused_ms is None for c in choices):  # not measured (CPU, or measuring off)
        bad = [(name, c) for (_, _, name), c in zip(consumers, choices) if not c.fuse]
        return choices, (f"{bad[0][0]}: {bad[0][1].reason}" if bad else None)
    t_fused, t_unfused = prenorm_times(choices, prenorm_norm_ms(a2), n_wgrads)
    margin = max(measure.margin_for(c.config) for c in choices)
    if t_fused < t_unfused * (1.0 - margin):
        return choices, None
    if len(consumers) == 1 and not n_wgrads:
        return choices, f"{consumers[0][2]}: {choices[0].reason}"
    what = f"{len(consumers)} GEMM(s)"
    if n_wgrads:
        what += f" + {n_wgrads} rebuild(s) of norm(x) for the weight gradients"
    # The format of tuning._choice's reasons: "(measured <fused> ms fused [what] vs <unfused> ms ...)".
    return choices, (f"left unfused: fusion would not win (measured {t_fused:.4g} ms fused [{what}] vs "
                     f"{t_unfused:.4g} ms unfused: one norm + the GEMMs)")


def prenorm_times(choices: list[Choice], t_norm: float, n_wgrads: int) -> tuple[float, float]:
    """(fused, unfused) ms of a norm with its consumer linears, from their measured choices: the fused GEMMs
    plus one rebuild of norm(x) per weight gradient, against the GEMMs plus one norm for all of them."""
    return (sum(c.t_fused_ms for c in choices) + n_wgrads * t_norm,
            sum(c.t_unfused_ms - t_norm for c in choices) + t_norm)
