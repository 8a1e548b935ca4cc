"""``deferred_norm``: a norm between GEMMs, split between its producer and its consumers.

Joint graph (ATen, forward + backward, before partitioning). Matches a canonical ``fusenorm::norm`` whose
output is read by linears (``mm``/``addmm`` with the normalized tensor as the left operand, through a view
that flattens a 3-D input's batch dims; fan-out: q/k/v, gate/up), and rewrites it to
``fusenorm::deferred_mm`` calls (ops/deferred_norm.py):

- the **producer**: where the norm's input is a linear's output (+ bias, + one residual add, through views),
  that linear becomes a ``deferred_mm`` that also writes the input's partial row statistics (its residual
  add folds into its epilogue when nothing else reads the linear's own output); where that linear is
  already a ``deferred_mm`` (a tower: it applies the previous norm), it writes the statistics too. Where the
  input comes from anything else (a pre-norm block's residual sum, computed by Inductor's pointwise code),
  the statistics are a row reduction in aten ops, which Inductor fuses into the kernel that computes the
  input;
- each **consumer** linear becomes a ``deferred_mm`` that merges the statistics and applies the norm in its
  epilogue, the affine folded into its weight (per call; once per weight version in inference graphs with
  ``config.fold_cache``);
- readers of the normalized tensor that are not linears (a residual add, an activation, the graph's output)
  keep the norm, which Inductor decomposes and fuses into them (norm(x) is then computed where it is read,
  from x);
- in training, where every reader of y is a linear and the norm's output gradient is the sum of their input
  gradients, the norm's backward goes the same way (``BackwardPlan``; the algebra: kernels/deferred.py):
  one ``deferred_mm`` multiplies the consumers' output gradients (each scaled by rstd, [g_1 g_2 ...]) by
  their folded weights and applies the norm's backward in its epilogue, with x as its residual and the
  per-row terms (``res_rows``) from row reductions of dh and h that Inductor fuses into the kernel computing
  dh; the weight gradients read x (an fp32-output GEMM, centered for LayerNorm) instead of y, and the norm's
  dgamma / dbeta come from those [N2, N] products. The norm's backward kernel, its dgamma reduction over M
  and y itself disappear; the consumers' outputs are read in the backward instead of y (the plan is taken
  only where they are read there anyway, or where they are no wider than y);
- otherwise in training the consumers' weight gradients ``mm(dz^T, y)`` read y rebuilt from x and the
  statistics in aten ops (Inductor fuses the rebuild into the norm's backward, which reads x anyway), and
  the norm's backward reads the statistics merged from the partials: y is never saved (peak memory drops by
  one [M, N] per site).

Where the norm's row fits one tile the post-norm epilogue (``linear_norm_fwd``, order 10) gets the site first;
Lazy Pre-Norm (``norm_linear_fwd``, 20) gets what this one leaves. Whether to defer is measured per site
(tuning/deferred_norm.py); in an inference graph a site that Lazy Pre-Norm was measured to speed up more is
left to it (``prenorm_saves_more``). The match report says what was chosen and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx import Node

from fusenorm_inductor import backends, config, fx_utils
from fusenorm_inductor.fx_utils import flat_like, val
from fusenorm_inductor.kernels import deferred as dk
from fusenorm_inductor.ops import deferred_norm as dops
from fusenorm_inductor.ops.norm_mm import normed
from fusenorm_inductor.report import GraphReport
from fusenorm_inductor.tuning.decide import Choice
from fusenorm_inductor.tuning.norm_mm import prenorm_norm_ms
from fusenorm_inductor.tuning.deferred_norm import Consumer, Site, dgrad_unsupported, fp32_output_gemm, site_choice, \
    x_tile
from fusenorm_inductor.tuning.deferred_norm import Producer as SiteProducer

from .base import Pattern, bind_op_args, getitem_users, is_op, require
from .post_norm import FLOATS
from .pre_norm import prenorm_decision, prenorm_times
from .views import IDENTITIES, JOINT, Gemm, GraphView, norm_backward_partners, through_identities

NORM = torch.ops.fusenorm.norm.default
DEFERRED_MM = torch.ops.fusenorm.deferred_mm.default
TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int)


@dataclass
class Producer:
    """The GEMM whose epilogue will write the statistics: a linear (``gemm``) or a ``deferred_mm`` node with no
    statistics yet (``deferred``); ``end``: the node whose value the fused output replaces (the residual add,
    else the GEMM's output); ``residual``: folded into the epilogue (None: none, or not foldable)."""

    end: Node
    gemm: Optional[Gemm] = None
    deferred: Optional[Node] = None
    residual: Optional[Node] = None
    chain: list[Node] = field(default_factory=list)  # nodes from the GEMM up to ``end``, erased when unused


@dataclass
class BackwardPlan:
    """The norm's backward in the joint graph, replaced by the deferred algebra (module docstring): ``nb`` the
    ``norm_backward`` node; per consumer (``DeferredMatch.consumers``' order) the GEMM that gives it its input
    gradient (``dgrads``: mm(dh, W)), its output gradient ``dhs`` and its weight's gradient (``wgrads``: the
    mm node and whether it is transposed, mm(y^T, dh) of a [K, N] Conv1D weight; None where no gradient of
    the weight is taken); ``dead``: the adds and views that summed the input gradients into the norm's."""

    nb: Node
    dgrads: list[Node]
    dhs: list[Node]
    wgrads: list[Optional[tuple[Node, bool]]]
    dead: list[Node]


@dataclass
class DeferredMatch:
    norm: Node
    args: dict[str, Any]
    producer: Optional[Producer]
    consumers: list[tuple[Node, Gemm]]  # (the linear's node, its operands)
    readers: list[tuple[Node, Node]]  # (a reader of y in the backward, the node of y it reads): weight gradients
    flat: list[Node]  # the [M, N] views of y the linears read
    keeps_norm: bool  # a reader that is not a linear: the norm stays for it
    choice: Choice
    backward: Optional[BackwardPlan] = None  # training: the norm's backward deferred too (else y is rebuilt)
    backward_note: str = ""  # why the backward was not deferred


class DeferredNorm(Pattern):
    name = "deferred_norm"
    stage = "joint"
    # After post-norm, which takes a row that fits one tile whole where it wins; before Lazy Pre-Norm, whose
    # consumers compute the statistics in their mainloops (this one's consumers only read them).
    order = 15
    switch = "patterns.deferred_norm"
    anchor = NORM

    def match(self, norm: Node) -> DeferredMatch:
        return self.match_in(norm, JOINT)

    def apply(self, graph: fx.Graph, rep: GraphReport) -> int:
        self.decided_on_cuda = False
        count = super().apply(graph, rep)
        if self.decided_on_cuda:  # the report names a kernel backend that could not be offered, once per graph
            for name, why in backends.unavailable().items():
                rep.note(f"kernel backend {name} not offered to deferred normalization: {why}")
        return count

    def prospect(self, norm: Node, view: GraphView) -> None:
        self.match_in(norm, view)

    # ---- guards ----------------------------------------------------------------------------------------
    def match_in(self, norm: Node, view: GraphView) -> DeferredMatch:
        args = bind_op_args(norm)
        x = args["x"]
        xv = val(x)
        require(fx_utils.static_width(xv, val(norm)[0]), "dynamic shapes (a symbolic width N): left to Inductor")
        require(xv.dtype in FLOATS, f"norm input dtype {xv.dtype} not supported")
        require((args["out_dtype"] or xv.dtype) == xv.dtype,
                f"norm changes dtype ({xv.dtype} -> {args['out_dtype']}): not deferred")
        require(xv.device.type in ("cpu", "cuda"), f"device {xv.device} not supported")
        n = xv.shape[-1]
        m = xv.numel() // n if n else 0
        require(n > 0 and fx_utils.hint(m) > 0, "empty norm input")
        ys = getitem_users(norm).get(0, [])
        require(ys, "norm output unused")
        # Readers of y: linears (consumers), readers in the backward (a weight gradient, through a transpose for
        # a Conv1D-style [K, N] weight), which read y rebuilt there, and anything else, for which the norm stays.
        bwd = fx_utils.tangent_dependent(norm.graph) if view is JOINT else set()
        flat, readers, keeps_norm = [], [], False
        for y in ys:
            for u in list(y.users):
                v = view.gemm_input(u, y, m, n)
                if v is not None:
                    if v not in flat:
                        flat.append(v)
                elif _backward_reader(u, bwd):
                    readers.append((u, y))
                else:
                    keeps_norm = True
        consumers = []
        for v in flat:
            for u in v.users:
                g = view.gemm(u)
                if u not in bwd and g is not None and g.a is v and g.b is not v:
                    _, bv, _ = view.gemm_values(g)
                    require(bv.dtype == xv.dtype, f"linear weight dtype {bv.dtype} differs from the norm's {xv.dtype}")
                    consumers.append((u, g))
                elif _backward_reader(u, bwd):
                    readers.append((u, v))
                else:
                    keeps_norm = True  # read by something else: the norm stays for it
        require(consumers, "norm output feeds no linear")
        training = view.training(norm.graph)
        require(view.has_backward(norm) or not training,
                "the norm's backward was not found (its statistics feed something else)")
        producer = self.producer(x, view)
        n_wgrads = len(readers) + view.implied_weight_grads([g.b for _, g in consumers])
        plan, note = None, ""
        if view is JOINT and training:
            plan, note = self.backward_plan(norm, args, consumers, readers, keeps_norm, bwd, n)
        width = sum(val(g.node).shape[-1] for _, g in consumers)  # of the deferred backward's GEMM operand
        if view is JOINT:
            n2 = width if plan is not None else 0
        else:
            n2 = self.expected_dgrad(args, width, keeps_norm, n, n_wgrads) if training else 0
        x2 = fx_utils.hinted(flat_like(xv, m, n))
        why = dgrad_unsupported(x2, n2) if n2 else None
        if why is not None:
            plan, n2, note = None, 0, f"the Gluon kernel cannot take its input-gradient GEMM ({why})"
        g_passes = 1 if plan is not None and all(_pointwise(dh) for dh in plan.dhs) else 2
        choice = self.decide(args, producer, consumers, view, m, n, n_wgrads, training, n2, g_passes)
        require(choice.fuse, choice.reason)
        if not training and not keeps_norm and config.patterns.norm_linear_fwd:
            why = self.prenorm_saves_more(args, x2, consumers, view, choice)
            require(why is None, why)
        return DeferredMatch(norm, args, producer, consumers, readers, flat, keeps_norm, choice, plan, note)

    def expected_dgrad(self, args, n2: int, keeps_norm: bool, n: int, n_wgrads: int) -> int:
        """At the pre-grad stage, which has no backward to look at: ``n2``, the width of the deferred backward's
        GEMM (the consumers' outputs summed), where the forward shows what ``backward_plan`` will need at the
        joint stage, else 0. Needed: every reader of norm(x) a linear; a weight gradient that reads norm(x), with
        the consumers' outputs no wider than x together (the backward may keep them instead of norm(x));
        LayerNorm's fp32-output GEMM. Without this the prospect judged a training site with the norm's
        backward left as it is, and put back norms that deferral, backward included, would have won."""
        xv = val(args["x"])
        if keeps_norm or not n_wgrads or n2 > n:
            return 0
        if not args["is_rms"] and not fp32_output_gemm(xv.device, xv.dtype):
            return 0
        return n2

    def prenorm_saves_more(self, args, x2, consumers, view: GraphView, choice: Choice) -> Optional[str]:
        """Why Lazy Pre-Norm (``norm_linear_fwd``, which gets the site when this one leaves it) should take it, or
        None: where both were measured and pre-norm would fuse, the one that saves more time against its own
        unfused side. The producer's GEMM is the same in both (plain under pre-norm, with the statistics under
        deferral) and cancels out of what each saves. Inference graphs only: in training pre-norm's decision
        does not see the backward that deferral changes. ``x2``: the norm's input as [M, N]."""
        if choice.t_fused_ms is None or choice.t_unfused_ms is None:
            return None  # not measured (CPU, measuring off): no comparison to make
        cons = [(*view.gemm_values(g)[1:], g.node.name) for _, g in consumers]
        choices, why_not = prenorm_decision(x2, cons, val(args["weight"]), val(args["bias"]), args["eps"],
                                            args["is_rms"], 0)
        if why_not is not None or any(c.t_fused_ms is None for c in choices):
            return None
        t_f, t_u = prenorm_times(choices, prenorm_norm_ms(x2), 0)
        if t_u - t_f <= choice.t_unfused_ms - choice.t_fused_ms:
            return None
        return (f"left to Lazy Pre-Norm (norm_linear_fwd), which saves more here (measured: {t_u - t_f:.4g} ms of "
                f"{t_u:.4g} ms unfused, against deferral's {choice.t_unfused_ms - choice.t_fused_ms:.4g} ms of "
                f"{choice.t_unfused_ms:.4g} ms)")

    def backward_plan(self, norm: Node, args: dict, consumers, readers, keeps_norm: bool, bwd: set, n: int
                      ) -> tuple[Optional[BackwardPlan], str]:
        """The norm's backward as the deferred algebra replaces it (``BackwardPlan``), or (None, why not)."""
        if keeps_norm:
            return None, "a reader of norm(x) is not a linear"
        nbs = norm_backward_partners(norm)
        if len(nbs) != 1:
            return None, f"{len(nbs)} backward nodes of the norm"
        nb = nbs[0]
        b = bind_op_args(nb)
        if b["src"] is not args["x"] or b["src_is_normed"] or b["dx_dtype"] != val(args["x"]).dtype:
            return None, "the norm's backward reads something else than its input"
        leaves, dead, todo = [], [], [b["dy"]]
        while todo:
            chain = [todo.pop()]
            core = through_identities(JOINT, chain[0], chain)
            dead.extend(chain)
            if JOINT.is_add(core) and len(core.args) == 2 and not core.kwargs and \
                    all(isinstance(a, Node) for a in core.args):
                todo.extend(core.args)
            elif is_op(core, torch.ops.aten.mm.default):
                dead.remove(core)
                leaves.append(core)
            else:
                return None, "the norm's output gradient is not the sum of its linears' input gradients"
        allowed = set(dead) | set(leaves) | {nb}
        if any(fx_utils.users_outside(d, allowed) for d in dead + leaves):
            return None, "the linears' input gradients are read elsewhere too"
        dgrads, dhs, wgrads = [], [], []
        for _, g in consumers:
            hit = [mm for mm in leaves if _transposed(mm.args[1]) is g.b]
            if len(hit) != 1:
                return None, f"no single input-gradient GEMM of the linear {g.node.name}"
            dgrads.append(hit[0])
            dhs.append(hit[0].args[0])
            wgrads.append(None)
        if len(dgrads) != len(leaves):
            return None, "the norm's output gradient has terms besides its linears'"
        for u, _ in readers:
            found = _weight_gradient(u, dhs)
            if found is None or wgrads[found[0]] is not None:
                return None, f"a reader of norm(x) in the backward ({u.name}) is not a linear's weight gradient"
            wgrads[found[0]] = found[1:]
        xv = val(args["x"])
        if not args["is_rms"] and not fp32_output_gemm(xv.device, xv.dtype):
            return None, "this torch has no fp32-output GEMM for LayerNorm's centered weight gradients"
        # Memory: the consumers' outputs are read in the backward instead of y.
        extra = sum(val(g.node).shape[-1] for _, g in consumers if not _read_in_backward(g.node, bwd))
        if extra and (not readers or extra > n):
            return None, "it would keep the linears' outputs for the backward, more than the norm(x) it saves"
        return BackwardPlan(nb, dgrads, dhs, wgrads, dead), ""

    def producer(self, x: Node, view: GraphView) -> Optional[Producer]:
        """The GEMM that can write the statistics (module docstring), else None (statistics in aten ops)."""
        chain = [x]
        end = through_identities(view, x, chain)
        residual, inner = None, end
        if view.is_add(end) and len(end.args) == 2 and not end.kwargs:
            for side, other in ((0, 1), (1, 0)):
                s = end.args[side]
                cand_chain: list[Node] = [s] if isinstance(s, Node) else []
                cand = through_identities(view, s, cand_chain)
                r = end.args[other]
                if isinstance(r, Node) and self._gemm_like(cand, view) is not None and \
                        fx_utils.same_shape(val(r).shape, val(end).shape) and val(r).dtype == val(end).dtype and \
                        all(not fx_utils.users_outside(c, cand_chain + [end]) for c in [cand] + cand_chain[:-1]):
                    residual, inner, chain = r, cand, chain + cand_chain
                    break
        g = self._gemm_like(inner, view)
        if g is None:
            return None
        gemm, deferred = g
        if gemm is not None:
            av, bv, _ = view.gemm_values(gemm)
            if av.dtype != bv.dtype or av.dtype != val(x).dtype:
                return None
        elif deferred is not None and residual is not None and deferred.args[3] is not None:
            return None
        return Producer(end, gemm, deferred, residual, [c for c in chain if c is not end and c is not inner])

    def _gemm_like(self, node: Any, view: GraphView) -> Optional[tuple[Optional[Gemm], Optional[Node]]]:
        """(a linear, None) or (None, a deferred_mm without output statistics) producing ``node``."""
        g = view.gemm(node)
        if g is not None:
            return g, None
        if is_op(node, operator.getitem) and node.args[1] == 0 and is_op(node.args[0], DEFERRED_MM):
            d = node.args[0]
            if bind_op_args(d)["out_norm"] == dops.NONE:
                return None, d
        return None

    def decide(self, args, producer: Optional[Producer], consumers, view: GraphView, m, n: int, n_wgrads: int,
               training: bool, dgrad: int = 0, g_passes: int = 1) -> Choice:
        """``dgrad``, ``g_passes``: the deferred backward's (``Site``); dgrad 0 where the backward is not deferred."""
        xv = fx_utils.hinted(flat_like(val(args["x"]), m, n))
        self.decided_on_cuda = getattr(self, "decided_on_cuda", False) or xv.device.type == "cuda"
        code = dops.RMS if args["is_rms"] else dops.LN
        prod = None
        if producer is not None:
            res = flat_like(val(producer.residual), xv.shape[0], n) if producer.residual is not None else None
            if producer.gemm is not None:
                av, bv, biasv = view.gemm_values(producer.gemm)
                prod = SiteProducer(fx_utils.hinted(av), bv, biasv, res)
            else:
                d = bind_op_args(producer.deferred)
                t = {k: val(d[k]) if isinstance(d[k], Node) else d[k] for k in
                     ("a", "b", "bias", "residual", "a_stats", "norm_weight", "norm_bias")}
                prod = SiteProducer(fx_utils.hinted(t["a"]), t["b"], t["bias"],
                                    res if res is not None else t["residual"], t["a_stats"], t["norm_weight"],
                                    t["norm_bias"], d["a_eps"], d["a_norm"], d["a_tile"])
        cons = [Consumer(*view.gemm_values(g)[1:]) for _, g in consumers]
        site = Site(xv, prod, cons, val(args["weight"]), val(args["bias"]), args["eps"], code, n_wgrads,
                    cache=_cache_fold(training), dgrad=dgrad, g_passes=g_passes, training=training)
        return site_choice(site)

    # ---- rewrite ---------------------------------------------------------------------------------------
    def rewrite(self, graph: fx.Graph, m: DeferredMatch, rep: GraphReport) -> None:
        # Every node that replaces the norm goes right before it: after its input and after every placeholder
        # (the producer's replacement goes before the producer's last node, after all of its inputs).
        args, norm = m.args, m.norm
        xv = val(args["x"])
        n = xv.shape[-1]
        rows = xv.numel() // n
        code = dops.RMS if args["is_rms"] else dops.LN
        training = JOINT.training(graph)
        tile = x_tile(n, m.producer is not None)
        if m.producer is not None:
            x2, stats = self.rewrite_producer(graph, m.producer, code, tile, rows, n)
        else:
            with graph.inserting_before(norm):
                x2 = fx_utils.reshape(graph, args["x"], [rows, n])
                stats = fx_utils.inline(graph, lambda t: dops.partial_stats(t, code, tile), [x2])
        houts = []  # the consumers' outputs [M, N2]
        for u, g in m.consumers:
            with graph.inserting_before(u):
                fused = fx_utils.call(graph, DEFERRED_MM, x2, g.b, g.bias, None, stats, args["weight"], args["bias"],
                                      args["eps"], code, tile, dops.NONE, 0, _cache_fold(training))
                out = fx_utils.getitems(graph, fused, 1)[0]
            u.replace_all_uses_with(out)
            graph.erase_node(u)
            houts.append(out)
        outs = getitem_users(norm)
        needs_stats = bool(m.readers) or any(outs.get(i) for i in (1, 2))
        mean = rstd = None
        if needs_stats:
            if m.keeps_norm:
                mean, rstd = self.norm_stats(graph, norm, outs, rows)
            else:
                with graph.inserting_before(norm):
                    mean, rstd = fx_utils.inline(graph, lambda s: dops.merge_stats(s, n, tile, args["eps"], code),
                                                 [stats])
        if m.backward is not None:
            self.rewrite_backward(graph, m, x2, houts, mean, rstd)
        for u, inp in ([] if m.backward is not None else m.readers):
            # norm(x) rebuilt from x and the statistics in aten ops, in the backward: Inductor fuses it into
            # the norm's backward kernel, which reads x anyway, so the rebuild costs one write of norm(x)
            # where the unfused forward wrote it and the partitioner saved it.
            mean_ = None if args["is_rms"] else mean
            with graph.inserting_before(u):
                rebuilt = fx_utils.inline(
                    graph, lambda t, mu, r, w, b: normed(t, mu, r, w, b, args["is_rms"]).to(t.dtype),
                    [x2, mean_, rstd, args["weight"], args["bias"]])
                rebuilt = fx_utils.reshape(graph, rebuilt, val(inp).shape)
            u.replace_input_with(inp, rebuilt)
        if m.keeps_norm:
            fx_utils.erase_if_unused(graph, [v for v in m.flat if v not in outs.get(0, [])])
        else:
            shape = list(xv.shape[:-1])
            with graph.inserting_before(norm):
                for idx, new in ((1, mean), (2, rstd)):
                    if outs.get(idx):
                        r = new if (idx == 1 and args["is_rms"]) else fx_utils.reshape(graph, new, shape)
                        for gi in outs[idx]:
                            gi.replace_all_uses_with(r)
                            graph.erase_node(gi)
            fx_utils.erase_if_unused(graph, [v for v in m.flat if v not in outs.get(0, [])] + outs.get(0, []))
            if norm.users:  # an error, not a Reject: the pass restores the graph it was given
                raise RuntimeError(f"{self.name}: {norm.name} still has users after the rewrite")
            graph.erase_node(norm)
        fx_utils.stable_toposort(graph)
        self.report(m, rep, rows, n, tile)

    def rewrite_backward(self, graph: fx.Graph, m: DeferredMatch, x2: Node, houts: list, mean: Node, rstd: Node
                         ) -> None:
        """The norm's backward, its linears' input-gradient GEMMs and their weight gradients replaced by the
        deferred algebra (module docstring; ``BackwardPlan``)."""
        plan, args = m.backward, m.args
        code = dops.RMS if args["is_rms"] else dops.LN
        dtype = val(x2).dtype
        gamma, beta = args["weight"], args["bias"]
        fp32_out = fp32_output_gemm(val(x2).device, dtype)
        ws = [mm.args[1] for mm in plan.dgrads]  # each linear's weight as [N2, N] (the input gradient's operand)
        with graph.inserting_before(plan.nb):
            hdots = []
            for dh, h in zip(plan.dhs, houts):
                hdots.append(fx_utils.inline(graph, dk.output_dot, [dh, h]))
                hdots[-1].meta[HDOT] = True  # a later site may find it is a tower's (``_tower_dots``)
            gs, folds, rows = fx_utils.inline(
                graph, lambda dhs, hd, bs, biases, r, mu, w, b: dk.consumer_gradients(dhs, hd, bs, biases, r, mu, w, b,
                                                                                      code, dtype),
                [plan.dhs, hdots, [g.b for _, g in m.consumers], [g.bias for _, g in m.consumers], rstd, mean, gamma,
                 beta])
            cat = torch.ops.aten.cat.default
            a = gs[0] if len(gs) == 1 else fx_utils.call(graph, cat, gs, 1)
            b = folds[0] if len(folds) == 1 else fx_utils.call(graph, cat, folds, 0)
            fused = fx_utils.call(graph, DEFERRED_MM, a, b, None, x2, None, None, None, 0.0, dops.NONE, 0, dops.NONE, 0,
                                  False, rows)
            dx = fx_utils.getitems(graph, fused, 1)[0]
            self._tower_dots(graph, plan.nb, x2, args["eps"], rows)
            dgamma, dbeta = [], []
            for g, dh, w, wg in zip(gs, plan.dhs, ws, plan.wgrads):
                dw, dg, db = fx_utils.inline(
                    graph, lambda g, dh, x, mu, w, gm, bt, want=wg is not None: dk.consumer_weight_gradient(
                        g, dh, x, mu, w, gm, bt, code, want, fp32_out), [g, dh, x2, mean, w, gamma, beta])
                dgamma.append(dg)
                dbeta.append(db)
                if wg is not None:
                    mm, transposed = wg
                    mm.replace_all_uses_with(fx_utils.call(graph, torch.ops.aten.permute.default, dw, [1, 0])
                                           if transposed else dw)
                    # the transposes that fed it (the views of y are the rewrite's to erase, once, at its end)
                    operands = [a for a in mm.args if isinstance(a, Node) and a not in m.flat]
                    graph.erase_node(mm)
                    fx_utils.erase_if_unused(graph, operands)
            grads = {0: dx}
            for idx, parts in ((1, dgamma), (2, dbeta)):
                if parts[0] is not None:
                    grads[idx] = parts[0] if len(parts) == 1 else fx_utils.inline(graph, lambda *ps: sum(ps), parts)
            for idx, gis in getitem_users(plan.nb).items():
                for gi in gis:
                    if idx == 0:
                        new = fx_utils.reshape(graph, dx, val(gi).shape)
                    elif idx in grads:
                        new = grads[idx]
                    else:  # the 0-size gradient of an absent weight / bias
                        new = fx_utils.inline(graph, lambda r: r.new_empty((0,)), [rstd])
                    gi.replace_all_uses_with(new)
                    graph.erase_node(gi)
        graph.erase_node(plan.nb)
        fx_utils.erase_if_unused(graph, plan.dead + plan.dgrads)

    def _tower_dots(self, graph: fx.Graph, nb: Node, x2: Node, eps: float, rows: Node) -> None:
        """An earlier site's ``output_dot`` of this norm's input gradient with this norm's input (a tower: the
        earlier site's consumer produced x, and this norm's gradient is all of its output gradient) replaced
        by ``tower_dot`` of this backward's per-row terms: that reduction then reads neither."""
        dxs = set(getitem_users(nb).get(0, []))
        x = through_identities(JOINT, x2)
        n = val(x2).shape[-1]
        for node in list(graph.nodes):
            if not node.meta.get(HDOT):
                continue
            ops = _dot_operands(node)
            if ops is None or through_identities(JOINT, ops[0]) not in dxs or \
                    through_identities(JOINT, ops[1]) is not x:
                continue
            node.replace_all_uses_with(fx_utils.inline(graph, lambda r: dk.tower_dot(r, eps, n), [rows]))
            fx_utils.erase_if_unused(graph, [node])

    def rewrite_producer(self, graph: fx.Graph, p: Producer, code: int, tile: int, rows, n: int
                         ) -> tuple[Node, Node]:
        """The producer's GEMM replaced by a deferred_mm that also writes the statistics; returns its output
        [M, N] and the statistics node."""
        with graph.inserting_before(p.end):
            res2 = fx_utils.reshape(graph, p.residual, [rows, n]) if p.residual is not None else None
            if p.gemm is not None:
                g = p.gemm
                fused = fx_utils.call(graph, DEFERRED_MM, g.a, g.b, g.bias, res2, None, None, None, 0.0, dops.NONE,
                                      0, code, tile, False)
                old = [g.node]
            else:
                d = bind_op_args(p.deferred)
                d.update(out_norm=code, out_tile=tile)
                if res2 is not None:
                    d["residual"] = res2
                fused = fx_utils.call(graph, DEFERRED_MM, *d.values())
                old = [u for gs in getitem_users(p.deferred).values() for u in gs] + [p.deferred]
            c2, stats = fx_utils.getitems(graph, fused, 2)
            c = fx_utils.reshape(graph, c2, val(p.end).shape)
        p.end.replace_all_uses_with(c)
        fx_utils.erase_if_unused(graph, list(dict.fromkeys([p.end] + p.chain + old)))
        return c2, stats

    def norm_stats(self, graph: fx.Graph, norm: Node, outs: dict, rows) -> tuple[Node, Node]:
        """(mean [M] (RMSNorm: the 0-size output), rstd [M]) from the norm that stays for its other readers."""
        got = {}
        with graph.inserting_before(norm.next):
            for idx in (1, 2):
                got[idx] = outs[idx][0] if outs.get(idx) else fx_utils.call(graph, operator.getitem, norm, idx)
            mean = got[1] if val(got[1]).numel() == 0 else fx_utils.reshape(graph, got[1], [rows])
            rstd = fx_utils.reshape(graph, got[2], [rows])
        return mean, rstd

    def report(self, m: DeferredMatch, rep: GraphReport, rows, n: int, tile: int) -> None:
        args = m.args
        p = m.producer
        if p is None:
            made = "statistics: a row reduction in aten ops, fused by Inductor into the kernel that computes x"
        elif p.gemm is not None:
            made = (f"statistics: written by the producer linear {p.gemm.node.name}'s epilogue"
                    f"{' (with its residual add)' if p.residual is not None else ''}")
        else:
            made = f"statistics: written by {p.deferred.name} (a GEMM that applies the previous norm: a chain)"
        consumers = ", ".join(u.name for u, _ in m.consumers)
        if m.backward is not None:
            backward = ("backward deferred: one GEMM of the linears' output gradients applies the norm's backward in "
                        "its epilogue, the weight gradients read x")
        else:
            backward = (f"weight gradients reading norm(x) rebuilt from x and the statistics in the "
                        f"backward={len(m.readers)}")
            if m.backward_note:
                backward += f" (backward not deferred: {m.backward_note})"
        affine = args["weight"] is not None or args["bias"] is not None
        rep.rewrite(
            self.name, self.stage, [m.norm.name] + [u.name for u, _ in m.consumers],
            {"M": rows, "N": n, "tile": tile, "x": list(val(args["x"]).shape)}, val(args["x"]).dtype,
            f"deferred norm [{m.choice.config}]: {m.choice.reason}",
            f"{'RMSNorm' if args['is_rms'] else 'LayerNorm'}, affine={'yes' if affine else 'no'}; {made}; applied "
            f"in the epilogue of {len(m.consumers)} linear(s) ({consumers}); {backward}; "
            f"{'the norm stays for readers that are not linears (fused into them by Inductor)' if m.keeps_norm else 'norm(x) never written'}"
            f"{fx_utils.dynamic_note(rows, m.choice.t_fused_ms is not None)}",
        )


HDOT = "fusenorm_output_dot"  # node.meta key: the sum of an ``output_dot`` inlined by a deferred backward
_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _dot_operands(node: Node) -> Optional[tuple[Any, Any]]:
    """(dh, h) of an inlined ``output_dot``: sum(mul(dh [cast], h [cast]), [-1]); None if it is not that."""
    if not (is_op(node, torch.ops.aten.sum.dim_IntList) and is_op(node.args[0], torch.ops.aten.mul.Tensor)):
        return None
    ops = [a.args[0] if is_op(a, *_CASTS) else a for a in node.args[0].args]
    return (ops[0], ops[1]) if len(ops) == 2 else None


def _transposed(n: Any) -> Any:
    """The input of a 2-D transpose node, else None."""
    if is_op(n, torch.ops.aten.t.default):
        return n.args[0]
    if is_op(n, torch.ops.aten.permute.default) and list(n.args[1]) == [1, 0]:
        return n.args[0]
    if is_op(n, torch.ops.aten.transpose.int) and sorted(a % 2 for a in n.args[1:3]) == [0, 1]:
        return n.args[0]
    return None


def _same_value(a: Any, b: Any) -> bool:
    return through_identities(JOINT, a) is through_identities(JOINT, b)


def _weight_gradient(u: Node, dhs: list) -> Optional[tuple[int, Node, bool]]:
    """(which consumer, the mm node, transposed) where ``u``, a backward reader of y, is a linear's weight
    gradient: mm(dh^T, y), or a transpose of y read only by mm(y^T, dh) (a [K, N] Conv1D weight)."""
    mm = torch.ops.aten.mm.default
    if is_op(u, mm):
        for i, dh in enumerate(dhs):
            if _same_value(_transposed(u.args[0]), dh):
                return i, u, False
        return None
    if _transposed(u) is not None and len(u.users) == 1:
        w = next(iter(u.users))
        if is_op(w, mm) and w.args[0] is u:
            for i, dh in enumerate(dhs):
                if _same_value(w.args[1], dh):
                    return i, w, True
    return None


def _is_pointwise(node: Any) -> bool:
    return isinstance(node, Node) and isinstance(node.target, torch._ops.OpOverload) and \
        torch.Tag.pointwise in node.target.tags


def _pointwise(dh: Node) -> bool:
    """Whether Inductor's pointwise code computes ``dh`` (a loss's or an activation's backward), into which
    the scaling of the deferred backward fuses without a read of its own."""
    return _is_pointwise(through_identities(JOINT, dh))


def _read_in_backward(node: Node, bwd: set, limit: int = 64) -> bool:
    """Whether the backward reads ``node``'s value, directly or through views and pointwise ops of the forward
    (an activation's backward formula, which the partitioner recomputes from its input): it is kept for the
    backward anyway."""
    todo, seen = [node], set()
    while todo and len(seen) < limit:
        for u in todo.pop().users:
            if u in bwd:
                return True
            if (_is_pointwise(u) or is_op(u, *IDENTITIES)) and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def _cache_fold(training: bool) -> bool:
    """Whether the consumers keep their fold per weight version: inference graphs, where config.fold_cache
    allows it (its comment says why it is off by default)."""
    return not training and bool(config.fold_cache)


def _backward_reader(u: Node, bwd: set) -> bool:
    """Whether ``u`` reads y only for the backward: it is part of the backward, or a view or transpose of y
    that only the backward reads."""
    if u in bwd:
        return True
    return is_op(u, *IDENTITIES, *TRANSPOSES) and bool(u.users) and all(w in bwd for w in u.users)


__all__ = ["DeferredNorm"]
