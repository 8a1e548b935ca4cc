"""fusenorm's patterns, one named object each; ``run_stage`` applies those of a stage in order.

pre_grad: canonical_layer_norm, canonical_rms_norm, canonical_llama_rms_norm, canonical_t5_rms_norm,
          canonical_gemma_rms_norm, canonical_manual_layer_norm (patterns/canonical_norms.py),
          then attention_block, attention_block_dense (attention_block.py: they match the canonical norms),
          then norm_prospects (prospects.py: canonical norms no fusion would take go back as written)
joint:    linear_norm_fwd (post_norm.py), norm_linear_fwd (pre_norm.py), dgrad_norm_bwd
          (dgrad_norm_backward.py), then the decomposition of canonical ops left unfused (decompose.py)
"""

from __future__ import annotations

import torch.fx as fx

from fusenorm_inductor import ops  # noqa: F401  (the patterns name the custom ops)
from fusenorm_inductor.report import GraphReport

from .attention_block import PATTERNS as ATTENTION_PATTERNS
from .canonical_norms import PRE_GRAD_PATTERNS
from .decompose import DecomposeUnfused, decompose_all
from .dgrad_norm_backward import DgradNormBwd
from .post_norm import LinearNormFwd
from .pre_norm import NormLinearFwd
from .prospects import NormProspects

STAGES = {
    # The attention block after the canonical norms: it matches fusenorm::norm nodes, and the norms it
    # takes are gone before the joint-graph patterns run.
    # Then the norms no joint fusion would take go back as written, so Inductor compiles them as without us.
    "pre_grad": PRE_GRAD_PATTERNS + ATTENTION_PATTERNS + (NormProspects(),),
    # Forward fusions first: they change what the norm backward reads, which the backward fusion keeps.
    # Post-norm before pre-norm: a norm between two linears goes to the one before it when that fuses.
    "joint": (LinearNormFwd(), NormLinearFwd(), DgradNormBwd(), DecomposeUnfused()),
}

PATTERN_NAMES = tuple(p.name for stage in STAGES.values() for p in stage if p.name not in ("decompose_unfused", "norm_prospects"))


def run_stage(stage: str, graph: fx.Graph, rep: GraphReport) -> int:
    return sum(p.apply(graph, rep) for p in STAGES[stage])


__all__ = ["run_stage", "decompose_all", "STAGES", "PATTERN_NAMES"]
