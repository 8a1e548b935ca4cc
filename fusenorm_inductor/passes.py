"""The passes fusenorm installs into Inductor, and how they are installed.

Two stages, each an Inductor ``CustomGraphPass`` (so the FX graph cache keys on ``uuid()``):

- ``pre_grad`` (slot ``pre_grad_custom_pass``, Dynamo's torch-level graph): every LayerNorm/RMSNorm form is
  rewritten into the canonical op ``fusenorm::norm`` whose autograd calls ``fusenorm::norm_backward``. The
  norms then reach the joint graph whole, the same on every device and torch version. Then the attention
  block (LayerNorm -> GDPA -> + ln_q -> RMSNorm -> + q) becomes ``fusenorm::flash_norm_attention``: before
  autograd, so its backward is the fused op's own (patterns/attention_block.py).
- ``joint`` (slot ``joint_custom_pre_pass``, the ATen forward+backward graph before partitioning): the
  fusion patterns, then the decomposition of canonical ops left unfused. The *pre* slot runs before
  Inductor's own joint-graph patterns; on CUDA one of them (pad_mm) pads unaligned GEMMs into
  pad/mm/slice, which would hide the GEMM from our patterns. The norms left unfused are decomposed here
  too, so Inductor's patterns then see them as they always do. Fusing here, before the
  partitioner decides what the backward keeps, is what lets a fused forward save the normalized ``hh``
  (or nothing extra) instead of the pre-norm tensor, which the fused kernel never writes.

Each stage runs the patterns of ``fusenorm_inductor.patterns`` that belong to it, records what it did in
the match report, and, if anything raises, restores the graph it was given (plain Inductor then compiles
it) and warns, unless ``config.fallback_on_error`` is off.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import warnings
from typing import Any, Callable, Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import config, fx_utils, report

log = logging.getLogger("fusenorm")

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(None)
def _source_files() -> tuple[str, ...]:
    """Every source file of the package and of its patterns, wherever setup.py put them."""
    # found, not imported: a warm compile that Inductor serves from its cache need not load the patterns
    spec = importlib.util.find_spec(f"{__package__}.patterns")
    dirs = {_PKG_DIR, *(os.path.abspath(d) for d in (spec.submodule_search_locations or []))}
    files = []
    for d in sorted(dirs):
        for root, _, names in os.walk(d):
            files += [os.path.join(root, n) for n in names if n.endswith(".py")]
    return tuple(sorted(files))


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    backup = fx.Graph()
    out = backup.graph_copy(graph, {})
    backup.output(out)
    return backup


def _restore_graph(graph: fx.Graph, backup: fx.Graph) -> None:
    """Put the graph back as ``backup`` holds it. The placeholders stay the graph's own nodes (the passes never
    touch them): Dynamo hangs attributes on them that a copy loses (``_dynamo_source``, which Inductor asserts
    in torch 2.11), so only the nodes after them are replaced by copies."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    copies = [n for n in backup.nodes if n.op == "placeholder"]
    if len(placeholders) != len(copies):  # a pass added or removed an input: copy everything
        placeholders, copies = [], []
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder" or not placeholders:
            graph.erase_node(node)
    with graph.inserting_after():
        out = graph.graph_copy(backup, dict(zip(copies, placeholders)))
        graph.output(out)


class FusenormPass(CustomGraphPass):
    """One stage of fusenorm's rewriting; ``stage`` selects the patterns that run."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def __repr__(self) -> str:
        return f"FusenormPass({self.stage!r})"

    def __call__(self, graph: fx.Graph) -> None:
        from . import pregrad_memo
        from .tuning.baseline import in_baseline_compile

        if in_baseline_compile():  # the decision's own compile of an unfused subgraph: plain Inductor's
            return

        rep = report.for_stage(self.stage)
        if not config.cpu_reference and _cpu_only(graph):
            _preview_on_cpu(self.stage, graph, rep)
            return
        memo = pregrad_memo.key(graph, self.uuid()) if self.stage == "pre_grad" else None
        if memo is not None:
            kept = pregrad_memo.get(memo[0])
            if kept is not None:  # this graph was left as traced before, for these reasons: say them again
                pregrad_memo.replay(rep, kept)
                log.info("%s (the verdict of an earlier compile of this graph)", rep.summary(self.stage))
                return
        from .patterns import run_stage

        dumps_before = _debug_aid(lambda: _render_parts(graph, self.stage), "graph dump", rep) if config.debug_dir else None
        backup = _copy_graph(graph) if config.fallback_on_error else None
        recorded = (len(rep.rewrites), len(rep.skips))
        try:
            # The partitioner and AOTAutograd's buffer donation read the joint graph's example values,
            # aliasing included: those of the nodes the rewrites touched, and of everything downstream, are
            # recomputed (fx_utils.refresh_values says why); one that cannot be fails the pass, so no stale
            # value goes on. The pre-grad graph needs none: AOTAutograd traces it again.
            nodes_before = fx_utils.snapshot(graph) if self.stage == "joint" else None
            metas = {n.name: n.meta for n in graph.nodes}  # references: places are read only for what is reported
            run_stage(self.stage, graph, rep)
            rep.locate(metas, recorded)
            graph.lint()
            if memo is not None and len(rep.rewrites) == recorded[0] and not rep.errors \
                    and pregrad_memo.structure(graph) == memo[1]:
                pregrad_memo.put(memo[0], rep, recorded)
            if nodes_before is not None:
                fx_utils.refresh_values(graph, nodes_before)
        except Exception as e:  # a failed pass must never fail the user's compile
            if backup is None:
                raise
            _restore_graph(graph, backup)
            rep.rollback(*recorded)
            msg = f"{self.stage} pass failed ({type(e).__name__}: {e}); graph left to plain Inductor"
            rep.errors.append(msg)
            warnings.warn(f"fusenorm: {msg}")
            log.debug("fusenorm %s pass failed", self.stage, exc_info=True)
            if self.stage == "joint":
                # Canonical norms must still become aten ops (or they run as slow reference kernels).
                from .patterns import decompose_all

                try:
                    # The restored graph carries the values it came with; those of the decomposition's
                    # nodes (and downstream) are recomputed.
                    nodes_before = fx_utils.snapshot(graph)
                    decompose_all(graph)
                    fx_utils.refresh_values(graph, nodes_before)
                except Exception as e2:
                    # The decomposition itself failed (a failure in it is also what sends us here): the
                    # graph is restored once more and the canonical ops stay, running their reference
                    # implementation (correct, unfused). Raising here would fail the user's compile.
                    _restore_graph(graph, backup)
                    msg = (f"decomposing the canonical norms failed too ({type(e2).__name__}: {e2}); they run "
                           f"as fusenorm's reference ops")
                    rep.errors.append(msg)
                    warnings.warn(f"fusenorm: {msg}")
        if config.debug_dir:
            after = _debug_aid(lambda: _render_parts(graph, self.stage), "graph dump", rep) or {}
            rep.dumps.update({f"{part}.before.py": text for part, text in (dumps_before or {}).items()})
            rep.dumps.update({f"{part}.after.py": text for part, text in after.items()})
        log.info(rep.summary(self.stage))
        _debug_aid(rep.write, "debug dumps", rep)

    def uuid(self) -> Any:
        # Source of every pass, pattern and op, plus the config: any change compiles afresh.
        return (self.stage, get_hash_for_files(_source_files()).hex(), config.get_hash().hex())


def _cpu_only(graph: fx.Graph) -> bool:
    """Whether the graph's example tensors are all on the CPU (and it has some)."""
    devices = set()
    for node in graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        for t in value if isinstance(value, (list, tuple)) else (value,):
            device = getattr(t, "device", None)
            if device is not None:
                devices.add(device.type)
    return devices == {"cpu"}


CPU_NOTE = ("all tensors on the CPU: the graph is left to plain Inductor (fusenorm's fused ops have no CPU kernels; "
            "config.cpu_reference / FUSENORM_CPU_REFERENCE=1 runs their reference implementations instead)")


def _preview_on_cpu(stage: str, graph: fx.Graph, rep: report.GraphReport) -> None:
    """A CPU graph without ``config.cpu_reference``: the pre-grad stage runs for the report only (what it would
    rewrite, and which joint-graph fusion would take each norm it keeps: patterns/prospects.py), then the graph
    is put back as it came, so Inductor compiles the user's graph as without fusenorm; the joint stage then
    finds nothing of fusenorm's and leaves its graph alone."""
    if stage != "pre_grad":
        return
    from .patterns import PATTERN_NAMES, run_stage
    from .patterns.prospects import PROSPECT_KEY

    backup = _copy_graph(graph)
    recorded = (len(rep.rewrites), len(rep.skips))
    lines = []
    try:
        run_stage(stage, graph, rep)
        lines = [f"{r.pattern}: nodes {', '.join(r.nodes)}" for r in rep.rewrites[recorded[0]:]
                 if r.pattern in PATTERN_NAMES and not r.pattern.startswith("canonical_")]
        for n in graph.nodes:
            if PROSPECT_KEY in n.meta:
                fusion, name, where = n.meta[PROSPECT_KEY]
                lines.append(f"{fusion}: the norm {name}" + (f" at {where}" if where else ""))
    except Exception as e:  # the preview is a report: a failure in it leaves the graph to Inductor all the same
        rep.note(f"what would be rewritten on a GPU is unknown: the preview failed ({type(e).__name__}: {e})")
    finally:
        _restore_graph(graph, backup)
        rep.rollback(*recorded)
    for line in lines:
        rep.preview(line)
    rep.note(CPU_NOTE)


def _debug_aid(fn: Callable[[], Any], what: str, rep: report.GraphReport) -> Any:
    """Run a debugging aid (rendering the graphs, writing the dumps and report files). A failure there
    (``debug_dir`` unwritable, not a directory or behind a symbolic link, a graph the renderer cannot print)
    warns, once per graph and reason, instead of failing the user's compile, as a failed pass does (the
    rewrites stand: they were made); with ``fallback_on_error`` off it raises."""
    try:
        return fn()
    except Exception as e:
        if not config.fallback_on_error:
            raise
        where = f" in {config.debug_dir}" if what == "debug dumps" else ""
        rep.warn_once(f"{what} of graph {rep.graph_id} not written{where}: {type(e).__name__}: {e}; "
                      f"the compile goes on")
        return None


def _render_parts(graph: fx.Graph, stage: str) -> dict[str, str]:
    """Readable code of the graph: the pre-grad graph whole; the joint graph whole and split into its
    forward and backward parts (the backward part: nodes that depend on a tangent)."""
    if stage == "pre_grad":
        return {"pre_grad": fx_utils.render(graph)}
    bwd = fx_utils.tangent_dependent(graph)
    parts = {"joint": fx_utils.render(graph),
             "forward": fx_utils.render(graph, {n for n in graph.nodes if n not in bwd and n.op != "output"})}
    if bwd:
        parts["backward"] = fx_utils.render(graph, bwd)
    return parts


# ---- installing into Inductor's config ---------------------------------------------------------------

PRE_GRAD = FusenormPass("pre_grad")
JOINT = FusenormPass("joint")
SLOTS = {"pre_grad_custom_pass": PRE_GRAD, "joint_custom_pre_pass": JOINT}


class ChainedPass(CustomGraphPass):
    """A user's pass followed by fusenorm's in the same Inductor slot (torch 2.11 takes one per slot)."""

    def __init__(self, first: Callable, second: Callable) -> None:
        self.first, self.second = first, second

    def __call__(self, graph: fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in (self.first, self.second)]
        return None if None in ids else tuple(ids)  # None: a plain function cannot be cached safely


def _contains(slot_value: Any, ours: FusenormPass) -> bool:
    if slot_value is ours:
        return True
    if isinstance(slot_value, ChainedPass):
        return _contains(slot_value.first, ours) or _contains(slot_value.second, ours)
    if isinstance(slot_value, (list, tuple)):
        return any(_contains(v, ours) for v in slot_value)
    return False


def _slots_take_lists() -> bool:
    """Whether this torch runs a list of passes per Inductor slot (torch 2.11 takes one: ChainedPass then)."""
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


def chain(existing: Any, ours: FusenormPass) -> Any:
    """The slot value that runs ``existing`` (a user's pass, a list of them, or None) and then ours: a list
    where torch takes one, so that what torch says about the user's pass (its cache warnings) names that
    pass and not a wrapper of ours."""
    if existing is None:
        return ours
    if _contains(existing, ours):
        return existing
    if isinstance(existing, (list, tuple)):
        return [*existing, ours]
    if _slots_take_lists():
        return _Pair([existing, ours])
    return ChainedPass(existing, ours)


class _Pair(list):
    """[a user's single pass, ours]: ``unchain`` gives back the single pass, as the user set it."""


def unchain(existing: Any, ours: FusenormPass) -> Any:
    """The slot value with ours taken out, the user's passes kept."""
    if existing is ours:
        return None
    if isinstance(existing, ChainedPass):
        first, second = unchain(existing.first, ours), unchain(existing.second, ours)
        if first is None or second is None:
            return first if second is None else second
        return ChainedPass(first, second)
    if isinstance(existing, _Pair):
        return next((p for p in existing if p is not ours), None)
    if isinstance(existing, list):
        return [p for p in existing if p is not ours] or None
    return existing


def install() -> None:
    import torch._inductor.config as inductor_config

    from . import graph_calls, ops  # noqa: F401  (registers the custom ops before any graph holds them)

    graph_calls.install()
    for slot, ours in SLOTS.items():
        setattr(inductor_config, slot, chain(getattr(inductor_config, slot), ours))


def uninstall() -> None:
    import torch._inductor.config as inductor_config

    for slot, ours in SLOTS.items():
        setattr(inductor_config, slot, unchain(getattr(inductor_config, slot), ours))


def _on_enabled(value: object) -> None:
    """``config.enabled`` was set: install or uninstall the passes (before the value is stored, so that a
    failing install leaves the option as it was)."""
    if value:
        install()
    else:
        uninstall()


config.on_enabled(_on_enabled)


def config_patches(options: Optional[dict]) -> dict:
    """Inductor options with fusenorm's passes chained after whatever the options or config hold."""
    import torch._inductor.config as inductor_config

    from . import graph_calls, ops  # noqa: F401

    graph_calls.install()
    patched = dict(options or {})
    for slot, ours in SLOTS.items():
        patched[slot] = chain(patched.get(slot, getattr(inductor_config, slot)), ours)
    return patched
