"""The match report: what each compiled graph had rewritten, what was seen but left alone and why.

One ``GraphReport`` per compiled graph (Dynamo frame compile). Every pass stage adds to it; when
``config.debug_dir`` is set the report and the graphs before/after each stage are written under
``<debug_dir>/<NNN>_<compile id>/``. Rewrites are also counted in
``torch._dynamo.utils.counters["fusenorm"][<pattern name>]``, and each stage logs a one-line summary on
the ``fusenorm`` logger (``TORCH_LOGS="+fusenorm"``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from torch._dynamo.utils import counters

from . import config

log = logging.getLogger("fusenorm")

_seq = itertools.count()


@dataclass
class Rewrite:
    pattern: str
    stage: str
    nodes: list[str]
    shapes: dict[str, Any]
    dtype: str
    kernel: str
    detail: str = ""


@dataclass
class Skip:
    pattern: str
    stage: str
    node: str
    reason: str


@dataclass
class GraphReport:
    graph_id: str
    rewrites: list[Rewrite] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dumps: dict[str, str] = field(default_factory=dict)

    def rewrite(self, pattern: str, stage: str, nodes, shapes, dtype, kernel, detail: str = "") -> None:
        self.rewrites.append(
            Rewrite(pattern, stage, [str(n) for n in nodes], shapes, str(dtype).replace("torch.", ""), kernel, detail)
        )
        counters["fusenorm"][pattern] += 1

    def skip(self, pattern: str, stage: str, node, reason: str) -> None:
        self.skips.append(Skip(pattern, stage, str(node), reason))

    def rollback(self, n_rewrites: int, n_skips: int) -> None:
        """Forget what a stage recorded after the given counts (its graph was restored after an error)."""
        for r in self.rewrites[n_rewrites:]:
            counters["fusenorm"][r.pattern] -= 1
            if not counters["fusenorm"][r.pattern]:
                del counters["fusenorm"][r.pattern]
        del self.rewrites[n_rewrites:], self.skips[n_skips:]

    def summary(self, stage: str) -> str:
        done = Counter(r.pattern for r in self.rewrites if r.stage == stage)
        left = sum(1 for s in self.skips if s.stage == stage)
        parts = ", ".join(f"{k} x{v}" for k, v in sorted(done.items())) or "no rewrites"
        err = f"; ERROR (fell back to Inductor): {self.errors[-1]}" if self.errors else ""
        return f"fusenorm [{self.graph_id}] {stage}: {parts}; {left} candidate(s) not rewritten{err}"

    # ---- output --------------------------------------------------------------------------------------
    def to_markdown(self) -> str:
        lines = [f"# fusenorm match report: graph {self.graph_id}", "", "## Rewritten", ""]
        if not self.rewrites:
            lines.append("(none)")
        for r in self.rewrites:
            shapes = ", ".join(f"{k}={v}" for k, v in r.shapes.items())
            lines.append(
                f"- **{r.pattern}** ({r.stage}): nodes {', '.join(r.nodes)}; {shapes}; dtype {r.dtype}; "
                f"kernel {r.kernel}" + (f"; {r.detail}" if r.detail else "")
            )
        lines += ["", "## Seen, not rewritten", ""]
        if not self.skips:
            lines.append("(none)")
        for s in self.skips:
            lines.append(f"- {s.pattern} ({s.stage}) at `{s.node}`: {s.reason}")
        if self.errors:
            lines += ["", "## Errors (the graph was left to plain Inductor)", ""]
            lines += [f"- {e}" for e in self.errors]
        if self.dumps:
            lines += ["", "## Dumps (in this directory)", ""] + [f"- {name}" for name in sorted(self.dumps)]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps(
            {
                "graph_id": self.graph_id,
                "rewrites": [asdict(r) for r in self.rewrites],
                "skips": [asdict(s) for s in self.skips],
                "errors": self.errors,
                "dumps": sorted(self.dumps),
            },
            indent=1,
        )

    def write(self) -> Optional[str]:
        """Write the report and the dumps under config.debug_dir; returns the directory or None."""
        if not config.debug_dir:
            return None
        out = os.path.join(config.debug_dir, self.graph_id.replace("/", "_"))
        os.makedirs(out, exist_ok=True)
        for name, text in self.dumps.items():
            with open(os.path.join(out, name), "w") as f:
                f.write(text)
        with open(os.path.join(out, "report.md"), "w") as f:
            f.write(self.to_markdown())
        with open(os.path.join(out, "report.json"), "w") as f:
            f.write(self.to_json())
        return out


_current: Optional[GraphReport] = None
_history: list[GraphReport] = []


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:  # not inside a Dynamo compile (e.g. compile_fx called directly)
        cid = None
    return str(cid) if cid is not None else "nocompileid"


def for_stage(stage: str) -> GraphReport:
    """The report of the graph being compiled: a new one at the pre-grad stage or on a new compile id."""
    global _current
    cid = _compile_id()
    if _current is None or stage == "pre_grad" or not _current.graph_id.endswith(f"_{cid}"):
        _current = GraphReport(graph_id=f"{next(_seq):03d}_{cid}")
        _history.append(_current)
        del _history[:-64]  # keep the last few for inspection; this is a debugging aid, not a log
    return _current


def reports() -> list[GraphReport]:
    """Reports of the graphs compiled recently in this process (newest last)."""
    return list(_history)


def last_report() -> Optional[GraphReport]:
    return _history[-1] if _history else None


def clear() -> None:
    global _current
    _current = None
    _history.clear()
