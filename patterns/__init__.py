"""fusenorm's patterns, one named class each; ``run_stage`` applies those of a stage in order.

A pattern is a class of a module of this package that declares its ``stage`` (``pre_grad``: Dynamo's
torch-level graph; ``joint``: the ATen joint graph, before partitioning) and its ``order`` in that stage
(base.Pattern). Every module is imported here and each stage runs its patterns by ascending order, so a new
pattern needs only its own file; its ``order`` comment says why it runs where it does. A joint-graph fusion
that takes canonical norms also defines ``prospect``, which ``norm_prospects`` asks at the pre-grad stage
(views.py).

The order (built from the classes when the package is imported):

"""

from __future__ import annotations

import importlib
import pkgutil

import torch.fx as fx

from fusenorm_inductor import ops  # noqa: F401  (the patterns name the custom ops)
from fusenorm_inductor.report import GraphReport

from .base import STAGE_NAMES, stage_patterns
from .decompose import decompose_all

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

STAGES = {stage: stage_patterns(stage) for stage in STAGE_NAMES}

PATTERN_NAMES = tuple(p.name for stage in STAGES.values() for p in stage if p.counted)


def run_stage(stage: str, graph: fx.Graph, rep: GraphReport) -> int:
    return sum(p.apply(graph, rep) for p in STAGES[stage])


def order_table() -> str:
    """Each stage's patterns in the order they run, with their order numbers and modules."""
    lines = []
    for stage, patterns in STAGES.items():
        for i, p in enumerate(patterns):
            module = type(p).__module__.rpartition(".")[2]
            lines.append(f"{stage + ':' if i == 0 else '':<10}{p.order:>4g}  {p.name} ({module}.py)")
    return "\n".join(lines) + "\n"


if __doc__ is not None:  # python -OO strips docstrings
    __doc__ += order_table()

__all__ = ["run_stage", "decompose_all", "order_table", "STAGES", "PATTERN_NAMES"]
