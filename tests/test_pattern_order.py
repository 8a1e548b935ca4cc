"""The patterns' order comes from the pattern classes (``stage`` and ``order``), found by importing every module
of fusenorm_inductor.patterns: a new pattern needs only its own file. No compile here."""

import sys
import types

import pytest
import torch

import fusenorm_inductor.patterns as patterns
from fusenorm_inductor.patterns.base import Pattern, stage_patterns
from fusenorm_inductor.patterns.prospects import NormProspects

ORDER = {
    "pre_grad": ["canonical_layer_norm", "canonical_rms_norm", "canonical_llama_rms_norm", "canonical_t5_rms_norm",
                 "canonical_gemma_rms_norm", "canonical_manual_layer_norm", "attention_block", "attention_block_dense",
                 "norm_prospects"],
    "joint": ["linear_norm_fwd", "deferred_norm", "norm_linear_fwd", "dgrad_norm_bwd", "decompose_unfused"],
}


def test_derived_order_is_the_documented_one():
    assert {stage: [p.name for p in ps] for stage, ps in patterns.STAGES.items()} == ORDER
    assert patterns.PATTERN_NAMES == tuple(n for ns in ORDER.values() for n in ns
                                           if n not in ("norm_prospects", "decompose_unfused"))
    # The package docstring lists the order as derived (one place, never stale).
    for names in ORDER.values():
        assert all(name in patterns.__doc__ for name in names)


def test_norm_prospects_asks_the_fusions_that_take_canonical_norms_in_their_order():
    assert [p.name for p in NormProspects().fusions] == ["linear_norm_fwd", "deferred_norm", "norm_linear_fwd",
                                                         "dgrad_norm_bwd"]


@pytest.fixture
def probe_module(monkeypatch):
    """A module of the package added at run time, as a new pattern's file would be."""
    name = f"{patterns.__name__}._probe"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)

    def define(order, prospect=False):
        cls = type("Probe", (Pattern,), {"__module__": name, "name": "probe", "stage": "joint", "order": order,
                                         "anchor": torch.ops.fusenorm.norm.default})
        if prospect:
            cls.prospect = lambda self, norm, view: None
        module.Probe = cls
        return cls

    return define


def test_a_new_pattern_takes_its_place_from_its_own_class(probe_module):
    probe_module(25, prospect=True)
    assert [p.name for p in stage_patterns("joint")] == ["linear_norm_fwd", "deferred_norm", "norm_linear_fwd",
                                                         "probe", "dgrad_norm_bwd", "decompose_unfused"]
    assert [p.name for p in NormProspects().fusions] == ["linear_norm_fwd", "deferred_norm", "norm_linear_fwd",
                                                         "probe", "dgrad_norm_bwd"]


def test_two_patterns_of_one_stage_may_not_share_an_order(probe_module):
    probe_module(20)
    with pytest.raises(ValueError, match="same order"):
        stage_patterns("joint")
